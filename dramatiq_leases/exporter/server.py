"""The exporter's HTTP endpoint: ``/leases`` (the Busy page, JSON) beside prometheus_client's exposition.

A small WSGI app on a threading ``wsgiref`` server, as prometheus_client's own
``start_http_server`` is, but bounded (:mod:`._http`: connections at once, a deadline to read each
request's head, no spinning out of file descriptors): every path but ``/leases`` goes to its
``make_wsgi_app``, so ``/metrics`` answers exactly as before (content
negotiation, gzip, ``name[]`` filters).

Who may read ``/leases``
------------------------

Metrics carry no lease key and are served to anyone who reaches the port, as
Prometheus exporters do. The Busy view shows lease keys (which often carry
user ids or e-mail addresses), message ids, hosts and pids, so it is safe by
default (:class:`BusyAccess`):

* with a token (``--busy-token-file FILE``): only to requests that send
  ``Authorization: Bearer <token>``, on every bind, loopback included; 401
  otherwise. The token is compared in constant time.
* else, on a loopback bind (``127.0.0.1``, ``::1``, ``localhost``): to anyone
  who reaches the port, that is, to this host.
* else (``0.0.0.0``, ``::``, any other address) only if the operator opts in
  with ``--busy-view open``; 403 otherwise, with a body saying how.

* a request the web configuration authenticated (``--web.config.file`` with
  ``basic_auth_users``, or a verified TLS client certificate) may read it on
  any bind (a token, if set, is still required: certificates do not use the
  ``Authorization`` header; basic auth does, so it excludes a token).

``--mask-keys`` (``--busy-keys hashed``) shows each key as ``sha256:`` and
the first 16 hex digits of its SHA-256 (``printf %s KEY | sha256sum`` gives
it) and leaves ``inspect_command`` null: a pseudonym that still tells rows
apart, not anonymity (whoever can guess a key can confirm it), so it adds to
the rules above and replaces none. ``/leases/history`` then takes a row's
digest (``?key=sha256:...``, of a key the last scan showed), never a plain
key, and answers with the digest for a key.

Protecting the whole endpoint
-----------------------------

``--web.config.file`` (:mod:`.webconfig`: exporter-toolkit's format) adds
TLS (1.2 at least, optionally client certificates) and basic auth in front of
every path, ``/metrics`` included: :func:`start_server` wraps the whole WSGI
app, so a route added to :class:`ExporterApp` is covered without a check of
its own.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from ..core.errors import LeaseError, LeaseUnavailableError
from . import busy_html
from ._http import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT, BoundedServer, QuietHandler, TLSHandler
from ._masking import HASH_DIGITS, hashed_key, scrub
from .webconfig import AUTHENTICATED, WebConfig

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

logger = logging.getLogger(__name__)

#: The path of the Busy page.
LEASES_PATH = "/leases"
#: The path of a key's history (``?key=KEY``), under the Busy page's rules.
HISTORY_PATH = "/leases/history"

#: The shortest token ``--busy-token-file`` accepts (characters).
MIN_TOKEN_LENGTH = 16

#: The realm of the ``WWW-Authenticate`` challenge of a 401.
REALM = "dramatiq-leases"


class ListenError(Exception):
    """The endpoint cannot listen on ``host:port``: an unknown host, an address in use, a port not permitted.

    The message is one line naming ``host:port`` and the operating system's reason.
    """

    def __init__(self, host: str, port: int, reason: str) -> None:
        self.host, self.port, self.reason = host, port, reason
        super().__init__(f"cannot listen on {host_port(host, port)}: {reason}")


@dataclass(frozen=True)
class BusyAccess:
    """Who may read the Busy view (``/leases``), and how it shows keys.

    Attributes:
      open: serve it without a token on any bind (``--busy-view open``); by
        default it is served without a token on a loopback bind only.
      token: the bearer token every request for it must send
        (``--busy-token-file``), whatever the bind; excludes ``open``.
      hash_keys: show keys as ``sha256:<16 hex digits>`` and no
        ``inspect_command`` (``--busy-keys hashed``).
    """

    open: bool = False
    token: str | None = field(default=None, repr=False)  # never in a repr or a log line
    hash_keys: bool = False

    def __post_init__(self) -> None:
        if self.open and self.token is not None:
            raise ValueError("an open Busy view takes no token: choose one of --busy-view open, --busy-token-file")
        if self.token is not None:
            check_token(self.token)

    def describe(self, bound: str, loopback: bool, authenticated: str | None = None) -> str:
        """Who gets the Busy view on the address ``bound``, in words (for the start-up log line);
        ``authenticated``: whom the web configuration authenticates, if anyone."""
        if self.token is not None:
            rule = "served only to requests bearing the token of --busy-token-file"
        elif authenticated is not None and not self.open:
            rule = f"served to requests authenticated by {authenticated}" + (
                "" if not loopback else " (or from this host)"
            )
        elif self.open:
            rule = f"served to anyone who reaches {bound} (--busy-view open)"
        elif loopback:
            rule = f"served without a token on the loopback bind {bound}"
        else:
            rule = (
                f"refused (403) on the non-loopback bind {bound}: start the exporter with --busy-token-file "
                "FILE, --web.config.file FILE (basic_auth_users) or --busy-view open to serve it there"
            )
        return rule + (", keys masked" if self.hash_keys else "")


def check_token(token: str) -> str:
    """``token`` if it can be a bearer token here: visible ASCII, no spaces, ``MIN_TOKEN_LENGTH`` long at least.

    Raises:
      ValueError: it cannot (the message says why, never the token).
    """
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(f"the token must be at least {MIN_TOKEN_LENGTH} characters long, got {len(token)}")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError("the token must be visible ASCII characters without spaces (it goes into an HTTP header)")
    return token


def read_token_file(path: str) -> str:
    """The bearer token stored in the file ``path`` (surrounding whitespace, such as a final newline, dropped).

    Raises:
      ValueError: the file cannot be read, or holds no usable token.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(4096)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path!r}: {getattr(e, 'strerror', None) or e}") from e
    try:
        return check_token(text.strip())
    except ValueError as e:
        raise ValueError(f"{path!r}: {e}") from None


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(address: str) -> bool:
    """Whether a bound address (as ``server_address[0]`` gives it) accepts connections from this host only."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # no IPv6 zone
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


Refusal = tuple[str, dict[str, Any], list[tuple[str, str]]]


class ExporterApp:
    """The WSGI app: ``GET /leases`` from ``busy_json``, anything else from the registry's exposition.

    Parameters:
      registry: what ``/metrics`` exposes.
      busy_json: the Busy page for a ``limit`` (``None``: the default), without any Redis call;
        ``None`` turns ``/leases`` off (404).
      access: who may read ``/leases``; default :class:`BusyAccess()`.
      history_json: a key's history document (one Redis call), for ``GET /leases/history?key=KEY``, under
        the same rules; ``None``: 404.

    Attributes:
      bound: the address the endpoint listens on, set by :func:`start_server`; until then (an app
        served by some other server) the Busy view counts as served on a non-loopback bind.
      loopback: whether ``bound`` is a loopback address.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        busy_json: Callable[[int | None], dict[str, Any]] | None,
        access: BusyAccess | None = None,
        *,
        history_json: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        self.metrics = make_wsgi_app(registry)
        self.busy_json = busy_json
        self.history_json = history_json
        self.access = access or BusyAccess()
        self.bound = "an unknown address"
        self.loopback = False
        # Digests of equal length: compare_digest then reveals neither the token nor its length.
        self._token_digest = None if self.access.token is None else _digest(self.access.token)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """WSGI entry point."""
        path = environ.get("PATH_INFO", "/").rstrip("/")
        if path == HISTORY_PATH:
            return self._history(environ, start_response)
        if path not in (LEASES_PATH, busy_html.BUSY_PAGE_PATH):  # the page: same rules as its JSON
            return self.metrics(environ, start_response)  # type: ignore[no-any-return]
        if self.busy_json is None:
            return _json(start_response, "404 Not Found", {"error": "the Busy page is off (--top 0)"})
        refusal = self._refusal(environ)
        head = environ.get("REQUEST_METHOD") == "HEAD"
        if refusal is not None:  # before anything else: a refused caller learns nothing about the page
            body = _json(start_response, *refusal)
            return [] if head else body
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _json(start_response, "405 Method Not Allowed", {"error": "use GET"}, [("Allow", "GET, HEAD")])
        if path == busy_html.BUSY_PAGE_PATH:  # no data in it: its script fetches /leases
            return busy_html.respond(start_response, head)
        values = parse_qs(environ.get("QUERY_STRING", "")).get("limit")
        limit = None
        if values:
            try:
                limit = int(values[-1])
                if limit < 0:
                    raise ValueError
            except ValueError:
                return _json(
                    start_response,
                    "400 Bad Request",
                    {"error": f"limit must be a non-negative integer, got {values[-1]!r}"},
                )
        doc = self.busy_json(limit)
        if self.access.hash_keys:
            doc = _hash_keys(doc)
        body = _json(start_response, "200 OK", doc)
        return [] if head else body

    def _history(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """``GET /leases/history?key=KEY``: the key's history, read from Redis now, for those who may read
        the Busy view."""
        if self.history_json is None:
            return _json(start_response, "404 Not Found", {"error": "the Busy page is off (--top 0)"})
        refusal = self._refusal(environ)
        head = environ.get("REQUEST_METHOD") == "HEAD"
        if refusal is not None:
            body = _json(start_response, *refusal)
            return [] if head else body
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _json(start_response, "405 Method Not Allowed", {"error": "use GET"}, [("Allow", "GET, HEAD")])
        keys = parse_qs(environ.get("QUERY_STRING", "")).get("key")
        if not keys:
            return _json(start_response, "400 Bad Request", {"error": "name the key: /leases/history?key=KEY"})
        key = keys[-1]
        if self.access.hash_keys:
            found = self._unmask(key)
            if isinstance(found, tuple):
                return _json(start_response, *found)
            key = found
        try:
            doc = self.history_json(key)
        except LeaseError as e:  # an invalid key, a history that is not a list (400); Redis not answering (503)
            status = "503 Service Unavailable" if isinstance(e, LeaseUnavailableError) else "400 Bad Request"
            # The core's message quotes the key and its Redis names: masked, the digest asked by stands in.
            return _json(start_response, status, {"error": scrub(str(e), [key]) if self.access.hash_keys else str(e)})
        if self.access.hash_keys:
            doc = {**doc, "key": hashed_key(key)}
        body = _json(start_response, "200 OK", doc)
        return [] if head else body

    def _unmask(self, digest: str) -> str | tuple[str, dict[str, Any]]:
        """The key of the last scan's rows whose digest is ``digest`` (keys masked), or the refusal (status, body).

        Only a digest is taken: a plain key would travel in URLs and logs, which masking keeps keys out of.
        """
        if not (digest.startswith("sha256:") and len(digest) == len("sha256:") + HASH_DIGITS):
            return (
                "400 Bad Request",
                {"error": "keys are masked (--mask-keys): ask by a digest /leases shows, ?key=sha256:<16 hex digits>"},
            )
        doc = self.busy_json(None) if self.busy_json is not None else {}
        for table in ("leases", "hot_keys"):
            for row in doc.get(table) or ():
                if hashed_key(str(row["key"])) == digest:
                    return str(row["key"])
        return "404 Not Found", {"error": f"no key of the last scan's /leases rows has the digest {digest}"}

    def _refusal(self, environ: WSGIEnvironment) -> Refusal | None:
        """Why this request may not read the Busy view (status, body, headers), or ``None`` if it may."""
        if self._token_digest is not None:
            scheme, _, given = str(environ.get("HTTP_AUTHORIZATION", "")).strip().partition(" ")
            if scheme.lower() != "bearer" or not given.strip():
                return (
                    "401 Unauthorized",
                    {
                        "error": "unauthorized",
                        "detail": "The Busy view needs the exporter's token: send 'Authorization: Bearer <token>', "
                        "the token being the content of the exporter's --busy-token-file.",
                    },
                    [("WWW-Authenticate", f'Bearer realm="{REALM}"')],
                )
            if not hmac.compare_digest(_digest(given.strip()), self._token_digest):
                return (
                    "401 Unauthorized",
                    {
                        "error": "invalid_token",
                        "detail": "The bearer token is not the exporter's (the content of its --busy-token-file).",
                    },
                    [("WWW-Authenticate", f'Bearer realm="{REALM}", error="invalid_token"')],
                )
            return None
        if self.access.open or self.loopback or environ.get(AUTHENTICATED):
            return None
        return (
            "403 Forbidden",
            {
                "error": "forbidden",
                "detail": f"The Busy view shows lease keys, which may carry personal data, so without a token it "
                f"is served only on a loopback bind, and this exporter listens on {self.bound}. To serve "
                "it here, start the exporter with --busy-token-file FILE (clients then send "
                "'Authorization: Bearer <token>'), with --web.config.file FILE (basic_auth_users: basic "
                "auth on every path) or, on a network only trusted readers reach, --busy-view open. "
                "--mask-keys shows keys as digests. /metrics needs neither.",
            },
            [],
        )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _hash_keys(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with every row's key replaced by its digest and no ``inspect_command`` (which would name it);
    ``history_path`` stays: ``/leases/history`` takes a row's digest."""
    out = dict(doc)
    for table in ("leases", "hot_keys"):
        if isinstance(doc.get(table), list):
            out[table] = [{**row, "key": hashed_key(str(row["key"])), "inspect_command": None} for row in doc[table]]
    return out


def _json(
    start_response: StartResponse, status: str, doc: dict[str, Any], headers: list[tuple[str, str]] | None = None
) -> list[bytes]:
    body = json.dumps(doc, separators=(",", ":")).encode()
    start_response(
        status,
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            *(headers or []),
        ],
    )
    return [body]


def start_server(
    app: ExporterApp,
    host: str,
    port: int,
    web_config: WebConfig | None = None,
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``app`` on ``host:port`` (``port`` 0: any free port) from a daemon thread, as prometheus_client does.

    Sets ``app.bound`` and ``app.loopback`` from the address actually bound,
    which the Busy view's access rule reads, and logs that rule. ``web_config``
    (``--web.config.file``) wraps the whole app, every path: basic auth and
    headers in front of it, TLS around the socket. ``max_connections``
    (``--web.max-connections``): connections served at once, half of them at
    most from one client address, the excess refused at once; ``read_timeout``
    (``--web.read-timeout``): seconds each has, in all, for its TLS handshake
    and request head (:mod:`._http`).

    Raises:
      ValueError: ``port`` is not from 0 to 65535, ``max_connections`` below 1, ``read_timeout`` not
        positive; basic auth and a Busy view token both configured (both would need the ``Authorization``
        header).
      ListenError: ``host`` does not resolve, or the address cannot be bound (in use, not permitted).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be from 0 to 65535, got {port}")
    if max_connections < 1 or not read_timeout > 0:
        raise ValueError(
            f"max_connections must be 1 or more and read_timeout positive, got {max_connections}, {read_timeout}"
        )
    if web_config is not None and web_config.users and app.access.token is not None:
        raise ValueError(
            "--busy-token-file and the basic_auth_users of --web.config.file both need the Authorization header: "
            "choose one"
        )
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError; an IDNA-invalid name a UnicodeError
        raise ListenError(host, port, _reason(e)) from e

    tls = web_config.ssl_context if web_config is not None else None

    class Server(BoundedServer):
        address_family = family  # "::" listens on IPv6, "0.0.0.0" on IPv4

    Server.max_connections, Server.read_timeout = max_connections, read_timeout

    served = web_config.wrap(app) if web_config is not None else app
    try:
        server = make_server(host, port, served, Server, handler_class=TLSHandler if tls is not None else QuietHandler)
    except OSError as e:
        raise ListenError(host, port, _reason(e)) from e
    if tls is not None:  # each connection's handshake runs in its request's thread (TLSHandler)
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    address = str(server.server_address[0])
    app.bound, app.loopback = host_port(address, int(server.server_address[1])), is_loopback(address)
    authenticated = None
    if web_config is not None:
        logger.info("The endpoint is protected by %s.", web_config.describe())
        if web_config.users or web_config.verifies_clients:
            authenticated = "--web.config.file"
    if app.busy_json is not None:
        guarded = app.loopback or app.access.token is not None or authenticated is not None
        logger.log(
            logging.INFO if guarded else logging.WARNING,
            "The Busy view (%s) is %s.",
            LEASES_PATH,
            app.access.describe(app.bound, app.loopback, authenticated),
        )
    thread = threading.Thread(target=server.serve_forever, name="lease-exporter-http", daemon=True)
    thread.start()
    return server, thread


def _reason(error: BaseException) -> str:
    """The operating system's words for ``error`` ("Address already in use"), else its message."""
    return str(getattr(error, "strerror", None) or error)
