"""``--web.config.file``: TLS and basic auth for the exporter, in the format Prometheus exporters read.

The file is exporter-toolkit's web configuration
(https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md), so one file
can protect this exporter and node_exporter alike::

  tls_server_config:
    cert_file: exporter.crt            # relative paths: from the file's directory
    key_file: exporter.key
    client_auth_type: RequireAndVerifyClientCert   # optional, with client_ca_file
    client_ca_file: clients-ca.crt
    min_version: TLS12                 # TLS12 (default) or TLS13
  http_server_config:
    headers:
      X-Content-Type-Options: nosniff
  basic_auth_users:
    prometheus: $2y$10$X0h1gDsPszWURQaxFh.zoubFi6DXncSjhoQNJgRrnGs7EsimhC7zG   # bcrypt

It is read once, at start: a setting this exporter cannot honour (``cipher_suites``,
``curve_preferences``, ``client_allowed_sans``, ``rate_limit``, a client auth type that does not
verify the certificate) is refused there, naming the file and field, rather than silently ignored.
Basic auth covers every path the endpoint serves (:meth:`WebConfig.wrap` wraps the whole WSGI app);
passwords are checked with ``bcrypt.checkpw`` (constant time), a good one cached as an HMAC (keyed
afresh at each start) as exporter-toolkit caches a SHA-256, so a scrape costs one bcrypt per user and
restart. A wrong password costs a bcrypt each time, so at most ``BCRYPT_AT_ONCE`` checks run at once:
a request that would start one more is answered 503 at once, without a check (a cached good password
needs none, so scrapes go on during a flood of wrong ones). Reading the file needs PyYAML, checking
passwords bcrypt: ``pip install 'dramatiq-leases[exporter]'``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import ssl
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import OptExcInfo
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = ["AUTHENTICATED", "BCRYPT_AT_ONCE", "EXTRA", "WebConfig", "WebConfigError", "load_web_config"]

#: The WSGI environ key naming who the web configuration authenticated (a basic auth user, or
#: ``cert:`` and a verified client certificate's subject); only this module and the TLS handler set it.
AUTHENTICATED = "dramatiq_leases.authenticated"

#: The extra that installs what a web configuration file needs.
EXTRA = "dramatiq-leases[exporter]"

#: The headers ``http_server_config.headers`` may set (exporter-toolkit's list), with the values accepted.
HEADERS: Mapping[str, tuple[str, ...] | None] = {
    "Content-Security-Policy": None,
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-Content-Type-Options": ("nosniff",),
    "X-XSS-Protection": None,
    "Strict-Transport-Security": None,
}

_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_TLS_FIELDS = {
    "cert_file",
    "key_file",
    "client_ca_file",
    "client_ca",
    "client_auth_type",
    "min_version",
    "max_version",
    "prefer_server_cipher_suites",
}
#: Fields of the format this exporter refuses, and why.
_UNSUPPORTED = {
    "tls_server_config.cert": "inline certificates are not supported here: use cert_file",
    "tls_server_config.key": "inline keys are not supported here: use key_file",
    "tls_server_config.cipher_suites": "Go cipher suite names cannot be honoured here (OpenSSL's defaults apply)",
    "tls_server_config.curve_preferences": "Go curve names cannot be honoured here (OpenSSL's defaults apply)",
    "tls_server_config.client_allowed_sans": "not supported here: issue client certificates from a CA of their own",
    "rate_limit": "not supported here: put a reverse proxy in front to limit rates",
}
#: A good password is cached (as a digest); past this many, the cache starts again.
_CACHE_SIZE = 64
#: bcrypt checks running at once at most (each costs a core for a while): more are answered 503 at once.
BCRYPT_AT_ONCE = 2
_BCRYPT_PREFIXES = (b"$2a$", b"$2b$", b"$2y$")


class WebConfigError(ValueError):
    """The web configuration file cannot be used; the message names the file and the field."""

    def __init__(self, path: str, where: str, reason: str) -> None:
        self.path, self.field, self.reason = path, where, reason
        super().__init__(f"{path}: {where}: {reason}" if where else f"{path}: {reason}")


@dataclass(frozen=True)
class WebConfig:
    """A loaded web configuration (:func:`load_web_config`).

    Attributes:
      path: the file it was read from.
      ssl_context: the server's TLS context (TLS 1.2 at least), or ``None`` to serve plain HTTP.
      users: user name to bcrypt hash (``basic_auth_users``); empty: no basic auth.
      headers: the headers added to every response (``http_server_config.headers``).
    """

    path: str
    ssl_context: ssl.SSLContext | None = None
    users: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    headers: tuple[tuple[str, str], ...] = ()
    _bcrypt: ModuleType | None = field(default=None, repr=False, compare=False)

    @property
    def verifies_clients(self) -> bool:
        """Whether TLS asks clients for a certificate and verifies the one given."""
        return self.ssl_context is not None and self.ssl_context.verify_mode != ssl.CERT_NONE

    def describe(self) -> str:
        """What this configuration enforces, in words (for the start-up log line)."""
        parts = []
        if self.ssl_context is not None:
            parts.append("TLS" + (" with client certificates" if self.verifies_clients else ""))
        if self.users:
            parts.append(f"basic auth ({len(self.users)} user{'s' if len(self.users) > 1 else ''})")
        if self.headers:
            parts.append("headers " + ", ".join(name for name, _ in self.headers))
        return (", ".join(parts) or "nothing") + f" (--web.config.file {self.path})"

    def wrap(self, app: WSGIApplication) -> WSGIApplication:
        """``app`` behind this configuration's basic auth and headers: every path it serves is covered."""
        if not self.users and not self.headers:
            return app
        return _Guard(app, self)


class _TooManyChecksError(Exception):
    """``BCRYPT_AT_ONCE`` password checks are running: the request is answered 503 without one."""


class _Guard:
    """The WSGI middleware of :meth:`WebConfig.wrap`: basic auth in front of every path, headers on every
    answer."""

    def __init__(self, app: WSGIApplication, config: WebConfig) -> None:
        self.app, self.config = app, config
        self._good: set[bytes] = set()  # digests of credentials bcrypt accepted
        self._lock = threading.Lock()
        self._key = os.urandom(32)  # the digests' key: a memory dump gives no unkeyed hash to guess against
        self._checks = threading.BoundedSemaphore(BCRYPT_AT_ONCE)
        # An unknown user is checked against a real hash too: a miss takes as long as a wrong password.
        self._decoy = next(iter(config.users.values()), b"")

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """WSGI entry point."""
        headers = list(self.config.headers)

        def respond(status: str, response_headers: list[tuple[str, str]], exc_info: OptExcInfo | None = None) -> Any:
            return start_response(status, [*response_headers, *headers], exc_info)

        if self.config.users:
            try:
                user = self._user(str(environ.get("HTTP_AUTHORIZATION", "")))
            except _TooManyChecksError:
                return _refuse(
                    environ,
                    respond,
                    "503 Service Unavailable",
                    b'{"error":"busy","detail":"Too many password checks at once: retry."}',
                    ("Retry-After", "1"),
                )
            if user is None:
                return _refuse(
                    environ,
                    respond,
                    "401 Unauthorized",
                    b'{"error":"unauthorized","detail":"This exporter requires basic auth (--web.config.file)."}',
                    ("WWW-Authenticate", 'Basic realm="dramatiq-leases", charset="UTF-8"'),
                )
            environ[AUTHENTICATED] = user
        return self.app(environ, respond)

    def _user(self, authorization: str) -> str | None:
        """The user these ``Authorization`` credentials authenticate, or ``None``.

        Raises:
          _TooManyChecksError: they need a bcrypt check, and ``BCRYPT_AT_ONCE`` are running.
        """
        scheme, _, encoded = authorization.strip().partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            user, colon, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        if not colon:
            return None
        hashed = self.config.users.get(user)
        secret = password.encode()
        digest = hmac.new(self._key, b"\0".join((user.encode(), secret, hashed or b"")), hashlib.sha256).digest()
        if hashed is not None and digest in self._good:
            return user
        assert self.config._bcrypt is not None  # loaded with the users
        if not self._checks.acquire(blocking=False):
            raise _TooManyChecksError
        try:
            ok = bool(self.config._bcrypt.checkpw(secret, hashed if hashed is not None else self._decoy))
        except ValueError:  # bcrypt 5 refuses a password over 72 bytes: a 401 for the client, not a 500
            return None
        finally:
            self._checks.release()
        if not ok or hashed is None:
            return None
        with self._lock:
            if len(self._good) >= _CACHE_SIZE:
                self._good.clear()
            self._good.add(digest)
        return user


def _refuse(
    environ: WSGIEnvironment, respond: StartResponse, status: str, body: bytes, header: tuple[str, str]
) -> list[bytes]:
    """Answer ``status`` with a JSON ``body`` never cached, and ``header`` (``Retry-After``, ``WWW-Authenticate``)."""
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))), ("Cache-Control", "no-store")]
    respond(status, [*headers, header])
    return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]


def load_web_config(path: str) -> WebConfig:
    """The web configuration in the file ``path``, every file it names read and every hash checked now.

    Raises:
      WebConfigError: the file cannot be read or parsed, a field is unknown, unsupported or invalid, a
        certificate or key cannot be loaded, or PyYAML or bcrypt (the ``[exporter]`` extra) is missing.
    """
    doc = _read_yaml(path)
    base = os.path.dirname(os.path.abspath(path))
    _known(path, doc, "", {"tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"})
    context = None
    tls = doc.get("tls_server_config")
    if tls is not None:
        context = _tls_context(path, base, _mapping(path, tls, "tls_server_config"))
    headers: list[tuple[str, str]] = []
    server = doc.get("http_server_config")
    if server is not None:
        server = _mapping(path, server, "http_server_config")
        _known(path, server, "http_server_config", {"http2", "headers"})
        if not isinstance(server.get("http2", True), bool):
            raise WebConfigError(path, "http_server_config.http2", "must be true or false")
        headers = _headers(path, server.get("headers"))
    users, module = _users(path, doc.get("basic_auth_users"))
    return WebConfig(path, context, users, tuple(headers), module)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        raise WebConfigError(path, "", f"reading it needs PyYAML: pip install '{EXTRA}'") from None

    class StrictLoader(yaml.SafeLoader):
        """safe_load, but a key given twice is an error (as exporter-toolkit's UnmarshalStrict): a second
        ``basic_auth_users:`` or ``tls_server_config:`` block would otherwise drop the first one silently."""

    def no_duplicates(loader: StrictLoader, node: yaml.MappingNode) -> Any:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: construct_mapping refuses it
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, no_duplicates)
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.load(f, Loader=StrictLoader)  # a SafeLoader: no arbitrary objects
    except (OSError, UnicodeDecodeError) as e:
        raise WebConfigError(path, "", f"cannot read it: {getattr(e, 'strerror', None) or e}") from None
    except yaml.YAMLError as e:
        raise WebConfigError(path, "", f"not valid YAML: {' '.join(str(e).split())}") from None
    if doc is None:
        return {}  # an empty file: as exporter-toolkit, no protection
    return _mapping(path, doc, "")


def _mapping(path: str, value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise WebConfigError(path, where, f"must be a mapping of names to values, got {type(value).__name__}")
    return value


def _known(path: str, doc: Mapping[str, Any], where: str, names: set[str]) -> None:
    for name in doc:
        full = f"{where}.{name}" if where else name
        if full in _UNSUPPORTED:
            raise WebConfigError(path, full, _UNSUPPORTED[full])
        if name not in names:
            raise WebConfigError(path, full, f"unknown field (known: {', '.join(sorted(names))})")


def _string(path: str, doc: Mapping[str, Any], where: str, name: str) -> str | None:
    value = doc.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise WebConfigError(path, f"{where}.{name}", f"must be a string, got {type(value).__name__}")
    return value


def _tls_context(path: str, base: str, tls: dict[str, Any]) -> ssl.SSLContext:
    """The server context ``tls_server_config`` describes, its files loaded (relative to ``base``)."""
    where = "tls_server_config"
    _known(path, tls, where, _TLS_FIELDS)
    cert, key = _string(path, tls, where, "cert_file"), _string(path, tls, where, "key_file")
    if cert is None or key is None:
        missing = "cert_file" if cert is None else "key_file"
        raise WebConfigError(path, f"{where}.{missing}", "required: TLS needs both cert_file and key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    low, high = _version(path, tls, "min_version", "TLS12"), _version(path, tls, "max_version", "TLS13")
    if low > high:
        raise WebConfigError(path, f"{where}.min_version", "must not be above max_version")
    context.minimum_version, context.maximum_version = low, high
    cert, key = os.path.join(base, cert), os.path.join(base, key)
    for name, file in (("cert_file", cert), ("key_file", key)):
        try:
            with open(file, "rb"):
                pass
        except OSError as e:
            raise WebConfigError(path, f"{where}.{name}", f"cannot read {file!r}: {_why(e)}") from None

    def no_passphrase() -> str:
        raise WebConfigError(path, f"{where}.key_file", f"{key!r} is encrypted: give a key without a passphrase")

    try:
        context.load_cert_chain(cert, key, password=no_passphrase)
    except WebConfigError:
        raise
    except OSError as e:  # ssl.SSLError is an OSError: a bad PEM, a key that is not the certificate's
        raise WebConfigError(
            path, f"{where}.cert_file, key_file", f"cannot load {cert!r} with {key!r}: {_why(e)}"
        ) from None
    _client_auth(path, base, tls, context)
    return context


def _version(path: str, tls: Mapping[str, Any], name: str, default: str) -> ssl.TLSVersion:
    value = _string(path, tls, "tls_server_config", name) or default
    if value not in _VERSIONS:
        raise WebConfigError(
            path, f"tls_server_config.{name}", f"must be TLS12 or TLS13 (TLS 1.2 at least), got {value!r}"
        )
    return _VERSIONS[value]


def _client_auth(path: str, base: str, tls: Mapping[str, Any], context: ssl.SSLContext) -> None:
    where = "tls_server_config"
    auth = _string(path, tls, where, "client_auth_type") or "NoClientCert"
    ca_file, ca = _string(path, tls, where, "client_ca_file"), _string(path, tls, where, "client_ca")
    if auth in ("RequestClientCert", "RequireAnyClientCert"):
        raise WebConfigError(
            path,
            f"{where}.client_auth_type",
            f"{auth} accepts a client certificate without verifying it, which authenticates nobody (and Python's "
            "ssl cannot do it): use RequireAndVerifyClientCert with client_ca_file",
        )
    if auth not in _CLIENT_AUTH:
        raise WebConfigError(
            path, f"{where}.client_auth_type", f"must be one of {', '.join(_CLIENT_AUTH)}, got {auth!r}"
        )
    if _CLIENT_AUTH[auth] == ssl.CERT_NONE:
        if ca_file or ca:
            raise WebConfigError(
                path, f"{where}.client_ca_file", "a client CA without a client_auth_type that verifies certificates"
            )
        return
    if not (ca_file or ca):
        raise WebConfigError(path, f"{where}.client_auth_type", f"{auth} needs client_ca_file")
    try:
        if ca_file:
            context.load_verify_locations(cafile=os.path.join(base, ca_file))
        if ca:
            context.load_verify_locations(cadata=ca)
    except (OSError, ValueError) as e:
        name = "client_ca_file" if ca_file else "client_ca"
        raise WebConfigError(path, f"{where}.{name}", f"cannot load it: {_why(e)}") from None
    context.verify_mode = _CLIENT_AUTH[auth]


def _headers(path: str, value: object) -> list[tuple[str, str]]:
    if value is None:
        return []
    doc = _mapping(path, value, "http_server_config.headers")
    out = []
    for name, text in doc.items():
        where = f"http_server_config.headers.{name}"
        if name not in HEADERS:
            raise WebConfigError(path, where, f"this header cannot be set (settable: {', '.join(HEADERS)})")
        if text is None or text == "":
            continue  # blank: unset, as exporter-toolkit
        if not isinstance(text, str) or any(c in text for c in "\r\n\0"):
            raise WebConfigError(path, where, "must be one line of text")
        allowed = HEADERS[name]
        if allowed is not None and text.lower() not in allowed:
            raise WebConfigError(path, where, f"must be {' or '.join(allowed)}, got {text!r}")
        out.append((name, text))
    return out


def _users(path: str, value: object) -> tuple[dict[str, bytes], ModuleType | None]:
    if value is None:
        return {}, None
    doc = _mapping(path, value, "basic_auth_users")
    if not doc:
        return {}, None
    try:
        import bcrypt
    except ImportError:
        raise WebConfigError(
            path, "basic_auth_users", f"checking passwords needs bcrypt: pip install '{EXTRA}'"
        ) from None
    users = {}
    for user, hashed in doc.items():
        where = f"basic_auth_users.{user}"
        if ":" in user or not user:
            raise WebConfigError(path, where, "a user name must be non-empty and have no ':'")
        if not isinstance(hashed, str) or not hashed.encode().startswith(_BCRYPT_PREFIXES):
            raise WebConfigError(
                path, where, "must be a bcrypt hash ($2y$..., as `htpasswd -nBC 10 \"\" | tr -d ':\\n'` prints)"
            )
        try:
            bcrypt.checkpw(b"", hashed.encode())  # an invalid hash raises now, not at the first scrape
        except ValueError:
            raise WebConfigError(path, where, "not a valid bcrypt hash") from None
        users[user] = hashed.encode()
    return users, bcrypt


def _why(error: BaseException) -> str:
    return " ".join(str(getattr(error, "strerror", None) or getattr(error, "reason", None) or error).split())
