"""A TCP proxy in front of a real Redis that loses replies: the command ran, its reply never arrives.

A client's connection is forwarded command by command: the proxy reads complete commands (RESP arrays,
as redis-py sends them), forwards them, reads as many complete replies from Redis, then either passes
them on or, when :attr:`LossyProxy.lose` says so, closes the client's connection (and its own to Redis)
without a byte of them. The client sees "connection closed" for a command Redis executed: the lost
reply a retry with the same token must survive. Pub/sub and blocking commands are not for it.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

#: Decides, for each batch of commands a client sent at once (each a list of its arguments), whether the
#: replies are lost.
Loser = Callable[[Sequence[list[bytes]]], bool]


def _end(buf: bytes, pos: int) -> int | None:
    """The offset just past the RESP value (RESP2 or RESP3) starting at ``pos`` in ``buf``, or ``None`` if it is
    incomplete."""
    line_end = buf.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind, head, after = buf[pos : pos + 1], buf[pos + 1 : line_end], line_end + 2
    if kind in _SIMPLE:
        return after
    if kind in _BLOBS:
        n = int(head)
        if n < 0:
            return after
        return after + n + 2 if len(buf) >= after + n + 2 else None
    if kind in _AGGREGATES:
        end: int | None = after
        items = max(int(head), 0) * _AGGREGATES[kind]
        for _ in range(items):
            assert end is not None
            end = _end(buf, end)
            if end is None:
                return None
        if kind == b"|" and end is not None:  # an attribute precedes the value it describes
            return _end(buf, end)
        return end
    raise ValueError(f"not a RESP value: {buf[pos : pos + 20]!r}")


# RESP value kinds by their first byte: one line; a length then that many bytes; a count of nested values
# (times how many values each counted item is).
_SIMPLE = {b"+", b"-", b":", b"_", b",", b"#", b"("}
_BLOBS = {b"$", b"!", b"="}
_AGGREGATES = {b"*": 1, b"~": 1, b">": 1, b"%": 2, b"|": 2}


def _arguments(command: bytes) -> list[bytes]:
    """The arguments of one complete command (an array of bulk strings)."""
    count_end = command.find(b"\r\n")
    args, pos = [], count_end + 2
    for _ in range(int(command[1:count_end])):
        len_end = command.find(b"\r\n", pos)
        n = int(command[pos + 1 : len_end])
        args.append(command[len_end + 2 : len_end + 2 + n])
        pos = len_end + 2 + n + 2
    return args


def scripts_at_random(rate: float, seed: int) -> Loser:
    """A :data:`Loser` that loses the replies of script calls (``EVALSHA``/``EVAL``) at ``rate``, reproducibly."""
    rng = random.Random(seed)
    lock = threading.Lock()

    def lose(commands: Sequence[list[bytes]]) -> bool:
        if not any(c and c[0].upper() in (b"EVALSHA", b"EVAL") for c in commands):
            return False
        with lock:
            return rng.random() < rate

    return lose


class LossyProxy:
    """Forwards 127.0.0.1:``port`` to the Redis at 127.0.0.1:``upstream``, losing the replies ``lose`` picks.

    Parameters:
      upstream: the Redis server's port.
      lose: which replies are lost (default none); may be replaced while running.

    Attributes:
      port: the port clients connect to.
      lost: how many batches of replies were lost so far.
      forwarded: how many batches of replies were passed on.
    """

    def __init__(self, upstream: int, lose: Loser | None = None) -> None:
        self.upstream = upstream
        self.lose: Loser = lose or (lambda commands: False)
        self.lost = 0
        self.forwarded = 0
        self._counts = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # so that the accepting thread sees close() soon
        self.port: int = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="lossy-proxy", daemon=True)

    def __enter__(self) -> LossyProxy:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed = True
        self._listener.close()
        for sock in list(self._open):
            _close(sock)
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            threading.Thread(target=self._serve, args=(client,), name="lossy-proxy-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.upstream))
        self._open.update((client, server))
        try:
            self._forward(client, server)
        except OSError:
            pass
        finally:
            for sock in (client, server):
                _close(sock)
                self._open.discard(sock)

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        pending = b""
        while not self._closed:
            data = client.recv(65536)
            if not data:
                return
            pending += data
            commands, pos = [], 0
            while pos < len(pending) and (end := _end(pending, pos)) is not None:
                commands.append(pending[pos:end])
                pos = end
            if not commands:
                continue
            pending = pending[pos:]
            server.sendall(b"".join(commands))
            replies, rpos, count = b"", 0, 0
            while count < len(commands):
                end = _end(replies, rpos) if rpos < len(replies) else None
                if end is None:
                    chunk = server.recv(65536)
                    if not chunk:
                        return
                    replies += chunk
                    continue
                rpos, count = end, count + 1
            if self.lose([_arguments(c) for c in commands]):
                with self._counts:
                    self.lost += 1
                return  # the commands ran; their replies go nowhere
            client.sendall(replies)
            with self._counts:
                self.forwarded += 1


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
