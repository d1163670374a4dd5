"""The exporter's HTTP server: a thread per connection, as prometheus_client's own, but bounded.

A client that connects and sends nothing (or a byte now and then) must not hold the endpoint: every
connection has ``read_timeout`` seconds in all to complete its TLS handshake and send its request head
(a total deadline, not one per read, so a trickle does not extend it), then as long to take the answer;
at most ``max_connections`` are served at once, and at most half of them from one client address, so one
client cannot take them all; a connection over either bound is refused at once (a 503 without reading
it on plain HTTP; closed on TLS), on the accepting thread, without a thread of its own. Out of file
descriptors (EMFILE), the accepting thread waits for a connection to end (or a quarter second) instead
of spinning on a listening socket that stays readable.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import socket
import ssl
import sys
import threading
import time
from collections import Counter
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from .webconfig import AUTHENTICATED

logger = logging.getLogger(__name__)

#: Default of ``--web.max-connections``: connections served at once (half of them at most per client address).
DEFAULT_MAX_CONNECTIONS = 64
#: Default of ``--web.read-timeout``: seconds a connection has for its TLS handshake and request head, in all.
DEFAULT_READ_TIMEOUT = 10.0

#: Connections the kernel queues before they are accepted (socketserver's default, 5, drops a burst).
_BACKLOG = 128
#: Longest pause of the accepting thread out of file descriptors (it resumes as soon as a connection ends).
_OUT_OF_FILES_PAUSE = 0.25
_OUT_OF_FILES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
#: Seconds between two warnings about refused connections (an attacker must not fill the log).
_WARN_EVERY = 60.0
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 34\r\n"
    b"Connection: close\r\nRetry-After: 1\r\n\r\ntoo many connections, retry later\n"
)


class _HeadReader(io.RawIOBase):
    """Reads a socket until a deadline, in all: each read may wait only for the time left."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not read within --web.read-timeout")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class QuietHandler(WSGIRequestHandler):
    """A request on a plain connection, read under the server's deadline; no access log on stderr (a scrape
    every few seconds)."""

    server: BoundedServer

    def setup(self) -> None:
        self._read_until(time.monotonic() + self.server.read_timeout)

    def _read_until(self, deadline: float) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_HeadReader(self.connection, deadline))

    def get_environ(self) -> dict[str, str]:
        # Called once the head is read: the answer is written under a timeout of its own.
        self.connection.settimeout(self.server.read_timeout)
        return super().get_environ()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class TLSHandler(QuietHandler):
    """A request on a TLS connection: the handshake in this request's thread (never in the accepting one, which
    a slow client would block), within the same deadline as the head (ssl's timeout bounds the whole
    handshake, not each read)."""

    connection: ssl.SSLSocket

    def setup(self) -> None:
        deadline = time.monotonic() + self.server.read_timeout
        self.request.settimeout(self.server.read_timeout)
        self.request.do_handshake()
        self._read_until(deadline)

    def get_environ(self) -> dict[str, str]:
        env = super().get_environ()
        env["HTTPS"] = "on"  # wsgi.url_scheme: https
        cert = self.connection.getpeercert()  # empty unless verified against client_ca_file
        if cert:
            names = [pair[1] for rdn in cert.get("subject", ()) for pair in rdn if pair[0] == "commonName"]
            env[AUTHENTICATED] = "cert:" + str(names[0] if names else "")
        return env


class BoundedServer(ThreadingMixIn, WSGIServer):
    """One daemon thread per connection, ``max_connections`` at most (half per client address), each read
    under ``read_timeout`` (set on a subclass, as :func:`.server.start_server` does)."""

    daemon_threads = True
    request_queue_size = _BACKLOG
    max_connections = DEFAULT_MAX_CONNECTIONS
    read_timeout = DEFAULT_READ_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ended = threading.Condition()  # notified when a connection ends
        self._open = 0
        self._by_client: Counter[str] = Counter()
        self._refused = 0
        self._warned_at = -_WARN_EVERY
        self._out_of_files = False
        self._files_warned_at = -_WARN_EVERY
        super().__init__(*args, **kwargs)

    @property
    def per_client(self) -> int:
        """Connections one client address may hold at once."""
        return max(1, self.max_connections // 2)

    def get_request(self) -> tuple[Any, Any]:
        try:
            request = super().get_request()
        except OSError as e:
            if e.errno in _OUT_OF_FILES:
                self._pause(e)
            raise
        self._out_of_files = False
        return request

    def _pause(self, error: OSError) -> None:
        """Out of file descriptors: the connection stays queued and the listening socket readable, so wait for
        one of ours to end (or a short pause) rather than spin on accept."""
        now = time.monotonic()
        # Once per shortage, and at most once a minute: a shortage that one freed descriptor interrupts
        # (a connection of ours ending, then the next accept failing again) is still the same shortage.
        if not self._out_of_files and now - self._files_warned_at >= _WARN_EVERY:
            self._files_warned_at = now
            logger.warning(
                "Cannot accept connections: %s (%d open here); waiting for some to end. Lower "
                "--web.max-connections below the open files limit (ulimit -n).",
                error.strerror,
                self._open,
            )
        self._out_of_files = True
        with self._ended:
            self._ended.wait(_OUT_OF_FILES_PAUSE)

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0]) if isinstance(client_address, tuple) and client_address else ""
        with self._ended:
            full = self._open >= self.max_connections or self._by_client[client] >= self.per_client
            if not full:
                self._open += 1
                self._by_client[client] += 1
        if full:
            self._refuse(request, client)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._end(client)  # no thread: nothing else will
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._end(str(client_address[0]) if isinstance(client_address, tuple) and client_address else "")

    def _end(self, client: str) -> None:
        with self._ended:
            self._open -= 1
            self._by_client[client] -= 1
            if self._by_client[client] <= 0:
                del self._by_client[client]
            self._ended.notify_all()

    def _refuse(self, request: Any, client: str) -> None:
        """Answer 503 without reading (plain HTTP; a TLS connection is closed), on this thread: the send
        cannot block, a fresh socket's buffer being empty."""
        if not isinstance(request, ssl.SSLSocket):
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(_BUSY)
        self.shutdown_request(request)
        self._refused += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY:  # at most once a minute: a flood must not fill the log
            self._warned_at = now
            logger.warning(
                "Refused %d connection(s) since the last warning, the last from %s: %d served at once at most "
                "(--web.max-connections), %d per client address.",
                self._refused,
                client,
                self.max_connections,
                self.per_client,
            )
            self._refused = 0

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (a reset, a timeout, a failed TLS handshake) is the client's problem:
        logged at debug, not printed as a traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            logger.debug("Connection from %s failed: %s", client_address, error)
            return
        super().handle_error(request, client_address)
