"""A TCP proxy in front of a real Redis that can be cut off: a partition between one client and the server.

While cut, whatever either side sends is swallowed, both ways, and the connections stay open: a client sees
its calls time out, as in a real partition (not "connection refused"), and Redis sees nothing of it. New
connections are accepted and go nowhere either. Healing closes the connections that lived through the
cut (their streams lost bytes midway) and forwards again.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType


class Blackhole:
    """Forwards 127.0.0.1:``port`` to the Redis at 127.0.0.1:``upstream`` until :meth:`cut`.

    Attributes:
      port: the port clients connect to.
      cut_at: ``time.time()`` of the last :meth:`cut` (0: never cut).
    """

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.cut_at = 0.0
        self._cut = False
        self._closed = False
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # so that the accepting thread sees close() soon
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="blackhole", daemon=True)

    def __enter__(self) -> Blackhole:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def cut(self) -> float:
        """Swallow everything from now on; returns the instant (``time.time()``)."""
        self._cut = True
        self.cut_at = time.time()
        return self.cut_at

    def heal(self) -> None:
        """Close the connections that lived through the cut, and forward again."""
        with self._lock:
            stale = list(self._open)
        for sock in stale:
            _close(sock)
        self._cut = False

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed = True
        self._listener.close()
        self.heal()
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                _close(client)
                continue
            for sock in (client, server):
                sock.settimeout(None)
            with self._lock:
                self._open.update((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), name="blackhole-pipe", daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    return
                if not self._cut:
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                _close(sock)
                with self._lock:
                    self._open.discard(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
