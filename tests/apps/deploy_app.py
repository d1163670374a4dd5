"""A Dramatiq app for tests/test_deploy.py: a leased job that runs until the test opens its gate.

``DEPLOY_TEST_BROKER_URL``: the broker (a Redis, also where the actors record what they do, as JSON in the
list ``runs``); ``DEPLOY_TEST_LEASES_URL``: the Redis of the leases; ``DEPLOY_TEST_OVERLONG``: when set,
also declare an actor whose time limit outlasts any shutdown timeout the tests use.
"""

from __future__ import annotations

import json
import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

from dramatiq_leases import LeaseMiddleware, current_lease
from dramatiq_leases.middleware.stop_budget import worker_shutdown_timeout

BROKER_URL = os.environ["DEPLOY_TEST_BROKER_URL"]

broker = RedisBroker(url=BROKER_URL)  # type: ignore[no-untyped-call]
broker.add_middleware(LeaseMiddleware(redis_url=os.environ["DEPLOY_TEST_LEASES_URL"], metrics_endpoint=False))
dramatiq.set_broker(broker)
record = redis.Redis.from_url(BROKER_URL)


def note(**event: object) -> None:
    record.rpush("runs", json.dumps({"pid": os.getpid(), "at": time.time(), **event}))


# Within the budget of deploy/supervisor/dramatiq-worker.conf: 60 s + 2 s is below its 120 s shutdown timeout.
@dramatiq.actor(lock_key="deploy:{key}", lock_ttl=2_000, time_limit=60_000, max_retries=0)
def gated_job(key: str) -> None:
    """Runs until the test opens the gate of ``key`` (50 s at most, inside its time limit)."""
    lease = current_lease()
    note(kind="started", key=key, fence=lease.fence, shutdown_timeout=worker_shutdown_timeout())
    deadline = time.monotonic() + 50
    while not record.exists(f"gate:{key}") and time.monotonic() < deadline:
        time.sleep(0.01)
    note(kind="done", key=key, fence=lease.fence, gated=bool(record.exists(f"gate:{key}")))


if os.environ.get("DEPLOY_TEST_OVERLONG"):

    @dramatiq.actor(lock_key="overlong:{key}", time_limit=3_600_000)
    def overlong_job(key: str) -> None:
        """Never sent: its hour-long time limit is what the boot check warns of."""
