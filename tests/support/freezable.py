"""A TCP proxy to a Redis port whose connections can hang for good: a renewal or a release stuck on a socket."""

from __future__ import annotations

import contextlib
import socket
import threading


class FreezableProxy:
    """A TCP proxy on 127.0.0.1 to a Redis port that can black-hole its connections, closing nothing.

    :meth:`freeze` stops forwarding, both ways, on every connection open or opened until :meth:`thaw`;
    those stay hung for good, like half-open TCP connections whose peer is gone (no reply ever comes,
    no error either). After :meth:`thaw`, new connections work: the network is back, the hung sockets
    are not. (Were the hung sockets to resume, a stuck renewer would recover by itself, unnoticed.)
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.frozen = False
        self.closed = False
        self.links: list[tuple[threading.Event, socket.socket, socket.socket]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                return
            flowing = threading.Event()
            if not self.frozen:
                flowing.set()
            self.links.append((flowing, client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(flowing, src, dst), daemon=True).start()

    def _pump(self, flowing: threading.Event, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                flowing.wait()  # hung: hold what was read, forward nothing
                if not data or self.closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def freeze(self) -> None:
        self.frozen = True
        for flowing, _, _ in self.links:
            flowing.clear()

    def thaw(self) -> None:
        self.frozen = False

    def reset_hung(self) -> None:
        """Reset the hung connections: whoever waits on one gets a connection error (and may reconnect)."""
        for flowing, client, upstream in self.links:
            if not flowing.is_set():
                client.close()
                upstream.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for flowing, client, upstream in self.links:
            flowing.set()
            client.close()
            upstream.close()
