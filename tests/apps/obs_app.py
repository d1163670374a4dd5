"""A Dramatiq app for the observability tests (tests/test_metrics.py, tests/test_observability_e2e.py).

Run by ``dramatiq tests.apps.obs_app`` from the repository root, configured by environment variables:

* ``OBS_BROKER_URL``, ``OBS_LEASES_URL`` (required): Redis URLs of the broker and of the leases.
* ``OBS_PROMETHEUS``: where Dramatiq's own ``Prometheus`` middleware goes: ``before`` or ``after``
  ``LeaseMiddleware``, or ``none`` (then ``LeaseMiddleware`` serves its own endpoint). Default ``after``.
  Dramatiq's middleware reads ``dramatiq_prom_port``/``dramatiq_prom_db``/``dramatiq_prom_host``; the
  lease middleware's own endpoint ``DRAMATIQ_LEASES_METRICS_PORT``/``_DIR``/``_HOST``.
* ``OBS_PREFIX``: lease key prefix (default ``dramatiq-leases``).
* ``OBS_TTL_MS``: ``lock_ttl`` of :func:`work` (default 1500; renewed every third of it).
* ``OBS_LONG_TTL_MS``, ``OBS_LONG_RENEW_MS``: ``lock_ttl`` and ``lock_renew_interval`` of
  :func:`long_work` (default 20 000 and 1 000).
* ``OBS_EVENTS_KEY``: Redis list (in the leases' Redis) where the actors record, as JSON, when they
  start and how they end, with their pid and fence (default ``obs:events``).
* ``OBS_HEARTBEAT_TIMEOUT_MS``: the broker's ``heartbeat_timeout`` (default Dramatiq's); when set,
  maintenance also runs on every command, so a killed worker's messages come back within that time.

:func:`work` (queue ``obs``) holds the lease ``{key}`` for ``seconds``; :func:`long_work` (queue
``obs-long``) does the same with a long TTL, for the process that the end-to-end test kills.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker
from dramatiq.middleware import Middleware
from dramatiq.middleware.prometheus import Prometheus

from dramatiq_leases import LeaseMiddleware, current_lease

WORK_QUEUE = "obs"
LONG_QUEUE = "obs-long"

BROKER_URL = os.environ["OBS_BROKER_URL"]
LEASES_URL = os.environ["OBS_LEASES_URL"]
PROMETHEUS = os.environ.get("OBS_PROMETHEUS", "after")
PREFIX = os.environ.get("OBS_PREFIX", "dramatiq-leases")
TTL_MS = int(os.environ.get("OBS_TTL_MS", "1500"))
LONG_TTL_MS = int(os.environ.get("OBS_LONG_TTL_MS", "20000"))
LONG_RENEW_MS = int(os.environ.get("OBS_LONG_RENEW_MS", "1000"))
EVENTS_KEY = os.environ.get("OBS_EVENTS_KEY", "obs:events")
HEARTBEAT_TIMEOUT_MS = os.environ.get("OBS_HEARTBEAT_TIMEOUT_MS")

if PROMETHEUS not in {"before", "after", "none"}:
    raise RuntimeError(f"OBS_PROMETHEUS must be before, after or none, not {PROMETHEUS!r}")

broker_options: dict[str, Any] = {}
if HEARTBEAT_TIMEOUT_MS:
    broker_options = {"heartbeat_timeout": int(HEARTBEAT_TIMEOUT_MS), "maintenance_chance": MAINTENANCE_SCALE}
broker = RedisBroker(url=BROKER_URL, **broker_options)  # type: ignore[no-untyped-call]

leases_middleware = LeaseMiddleware(redis_url=LEASES_URL, prefix=PREFIX, lock_min_backoff=50, lock_max_backoff=300)
order: list[Middleware] = [leases_middleware]
if PROMETHEUS == "before":
    order.insert(0, Prometheus())
elif PROMETHEUS == "after":
    order.append(Prometheus())
for middleware in order:
    broker.add_middleware(middleware)
dramatiq.set_broker(broker)

_events = redis.Redis.from_url(LEASES_URL, socket_timeout=2.0)


def record(event: str, key: str, **fields: Any) -> None:
    """Append an event for the tests to read."""
    _events.rpush(EVENTS_KEY, json.dumps({"event": event, "key": key, "pid": os.getpid(), "at": time.time(), **fields}))


def hold(key: str, seconds: float) -> None:
    """Run for ``seconds`` in short naps, so that a LeaseLost interrupts promptly; record how it ends."""
    fence = current_lease().fence
    record("start", key, fence=fence)
    try:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.05, left))
    except BaseException as e:
        record("error", key, fence=fence, error=type(e).__name__)
        raise
    record("done", key, fence=fence)


@dramatiq.actor(queue_name=WORK_QUEUE, lock_key="{key}", lock_ttl=TTL_MS, max_retries=0)
def work(key: str, seconds: float) -> None:
    """Hold the lease ``key`` for ``seconds``."""
    hold(key, seconds)


@dramatiq.actor(
    queue_name=LONG_QUEUE, lock_key="{key}", lock_ttl=LONG_TTL_MS, lock_renew_interval=LONG_RENEW_MS, max_retries=0
)
def long_work(key: str, seconds: float) -> None:
    """Hold the lease ``key`` for ``seconds``, with a long TTL."""
    hold(key, seconds)
