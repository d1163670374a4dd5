"""The exporter's HTTP endpoint: ``/leases`` (the Busy page, JSON) beside prometheus_client's exposition.

A small WSGI app on a threading ``wsgiref`` server, as prometheus_client's own
``start_http_server`` is: every path but ``/leases`` goes to its
``make_wsgi_app``, so ``/metrics`` answers exactly as before (content
negotiation, gzip, ``name[]`` filters).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

#: The path of the Busy page.
LEASES_PATH = "/leases"


class ListenError(Exception):
    """The endpoint cannot listen on ``host:port``: an unknown host, an address in use, a port not permitted.

    The message is one line naming ``host:port`` and the operating system's reason.
    """

    def __init__(self, host: str, port: int, reason: str) -> None:
        self.host, self.port, self.reason = host, port, reason
        super().__init__(f"cannot listen on {host_port(host, port)}: {reason}")


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request, none of which keeps the process alive."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (a scrape every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class ExporterApp:
    """The WSGI app: ``GET /leases`` from ``busy_json``, anything else from the registry's exposition.

    Parameters:
      registry: what ``/metrics`` exposes.
      busy_json: the Busy page for a ``limit`` (``None``: the default), without any Redis call;
        ``None`` turns ``/leases`` off (404).
    """

    def __init__(self, registry: CollectorRegistry,
                 busy_json: Callable[[int | None], dict[str, Any]] | None) -> None:
        self.metrics = make_wsgi_app(registry)
        self.busy_json = busy_json

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """WSGI entry point."""
        if environ.get("PATH_INFO", "/").rstrip("/") != LEASES_PATH:
            return self.metrics(environ, start_response)  # type: ignore[no-any-return]
        if self.busy_json is None:
            return _json(start_response, "404 Not Found", {"error": "the Busy page is off (--top 0)"})
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _json(start_response, "405 Method Not Allowed", {"error": "use GET"}, [("Allow", "GET, HEAD")])
        values = parse_qs(environ.get("QUERY_STRING", "")).get("limit")
        limit = None
        if values:
            try:
                limit = int(values[-1])
                if limit < 0:
                    raise ValueError
            except ValueError:
                return _json(start_response, "400 Bad Request",
                             {"error": f"limit must be a non-negative integer, got {values[-1]!r}"})
        body = _json(start_response, "200 OK", self.busy_json(limit))
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else body


def _json(start_response: StartResponse, status: str, doc: dict[str, Any],
          headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    body = json.dumps(doc, separators=(",", ":")).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store"), *(headers or [])])
    return [body]


def start_server(app: ExporterApp, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``app`` on ``host:port`` (``port`` 0: any free port) from a daemon thread, as prometheus_client does.

    Raises:
      ValueError: ``port`` is not from 0 to 65535.
      ListenError: ``host`` does not resolve, or the address cannot be bound (in use, not permitted).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be from 0 to 65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError; an IDNA-invalid name a UnicodeError
        raise ListenError(host, port, _reason(e)) from e

    class Server(_ThreadingServer):
        address_family = family  # "::" listens on IPv6, "0.0.0.0" on IPv4

    try:
        server = make_server(host, port, app, Server, handler_class=_QuietHandler)
    except OSError as e:
        raise ListenError(host, port, _reason(e)) from e
    thread = threading.Thread(target=server.serve_forever, name="lease-exporter-http", daemon=True)
    thread.start()
    return server, thread


def _reason(error: BaseException) -> str:
    """The operating system's words for ``error`` ("Address already in use"), else its message."""
    return str(getattr(error, "strerror", None) or error)
