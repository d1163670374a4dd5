"""The exporter's HTTP server: binds ``host:port`` and serves the app behind the web configuration.

A threading ``wsgiref`` server, as prometheus_client's own ``start_http_server``, but bounded
(:mod:`._http`: connections at once, a deadline to read each request's head, no spinning out of file
descriptors). ``--web.config.file`` (:mod:`.webconfig`) wraps the whole app, every path: basic auth and
headers in front of it, TLS around the socket. Who may read what: :mod:`.access`.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from wsgiref.simple_server import WSGIServer, make_server

from ._http import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT, BoundedServer, QuietHandler, TLSHandler
from .access import host_port, is_loopback
from .routes import ExporterApp
from .webconfig import WebConfig

__all__ = ["ListenError", "start_server"]

logger = logging.getLogger(__name__)


class ListenError(Exception):
    """The endpoint cannot listen on ``host:port``: an unknown host, an address in use, a port not permitted.

    The message is one line naming ``host:port`` and the operating system's reason.
    """

    def __init__(self, host: str, port: int, reason: str) -> None:
        self.host, self.port, self.reason = host, port, reason
        super().__init__(f"cannot listen on {host_port(host, port)}: {reason}")


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

    Sets ``app.access``'s address from the one actually bound, and logs who may read the lease views.
    ``web_config`` (``--web.config.file``) wraps the whole app. ``max_connections``
    (``--web.max-connections``): connections served at once, half of them at most from one client address,
    the excess refused at once; ``read_timeout`` (``--web.read-timeout``): seconds each has, in all, for its
    TLS handshake and request head.

    Raises:
      ValueError: ``port`` is not from 0 to 65535, ``max_connections`` below 1, ``read_timeout`` not positive.
      ListenError: ``host`` does not resolve, or the address cannot be bound (in use, not permitted).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be from 0 to 65535, got {port}")
    if max_connections < 1 or not read_timeout > 0:
        raise ValueError(
            f"max_connections must be 1 or more and read_timeout positive, got {max_connections}, {read_timeout}"
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
    app.access = dataclasses.replace(
        app.access, bound=host_port(address, int(server.server_address[1])), loopback=is_loopback(address)
    )
    if web_config is not None:
        logger.info("The endpoint is protected by %s.", web_config.describe())
    if app.busy_json is not None:
        level, rule = app.access.describe(web_config)
        keys = ", keys masked (--mask-keys)" if app.mask_keys else ""
        logger.log(level, "The lease views (/leases, /busy, /leases/history) are %s%s.", rule, keys)
    thread = threading.Thread(target=server.serve_forever, name="lease-exporter-http", daemon=True)
    thread.start()
    return server, thread


def _reason(error: BaseException) -> str:
    """The operating system's words for ``error`` ("Address already in use"), else its message."""
    return str(getattr(error, "strerror", None) or error)
