"""Holder and waiter processes for figure 5's comparisons outside Dramatiq.

``python -m bench.crash_peer LIB ROLE URL KEY TTL_MS``, LIB ``prl``
(python-redis-lock with ``auto_renewal=True``) or ``core`` (our
:class:`Leases` and :class:`Heartbeat`, no Dramatiq). The holder prints
``held`` once it has the lock, then sleeps until killed. The waiter prints
the ``time.time()`` at which it got the lock, then exits.
"""

from __future__ import annotations

import sys
import time

import redis
import redis_lock

from dramatiq_leases import Leases
from dramatiq_leases.core.heartbeat import Heartbeat

from .defaults import BACKOFF_MIN

#: How often the core waiter retries, in ms: LeaseMiddleware's default ``lock_min_backoff``
#: (imported by :mod:`bench.defaults`), the shortest wait a busy message gets.
CORE_RETRY_MS: int = BACKOFF_MIN


def _prl(role: str, client: redis.Redis, key: str, ttl_ms: int) -> None:
    # python-redis-lock takes whole seconds; its renewal thread extends every 2/3 of them.
    lock = redis_lock.Lock(client, key, expire=max(1, ttl_ms // 1000), auto_renewal=True)
    if role == "hold":
        lock.acquire(blocking=False) or sys.exit("busy")
        print("held", flush=True)
        time.sleep(3600)
    else:
        lock.acquire(blocking=True)  # SET NX, then BLPOP on the release signal for up to `expire` s
        print(time.time(), flush=True)


def _core(role: str, client: redis.Redis, key: str, ttl_ms: int) -> None:
    leases = Leases(client)
    if role == "hold":
        lease = leases.try_acquire(key, ttl_ms)
        if not lease:
            sys.exit("busy")
        Heartbeat(leases).track(lease, lambda *_: None)  # type: ignore[arg-type]
        print("held", flush=True)
        time.sleep(3600)
    else:
        while not leases.try_acquire(key, ttl_ms):
            time.sleep(CORE_RETRY_MS / 1000)
        print(time.time(), flush=True)


def main(argv: list[str]) -> None:
    """Entry point: see the module docstring."""
    lib, role, url, key, ttl_ms = argv
    client = redis.Redis.from_url(url)
    {"prl": _prl, "core": _core}[lib](role, client, key, int(ttl_ms))


if __name__ == "__main__":
    main(sys.argv[1:])
