"""A Dramatiq app whose workers keep each key's history (``LeaseMiddleware(history=50)``), for test_history.py.

``LEASES_TEST_BROKER_URL``: the broker (a Redis); ``LEASES_TEST_LEASES_URL``: the Redis of the leases;
``LEASES_TEST_QUEUE``: the actors' queue (``first`` consumes ``<queue>-first``: a worker that consumes only the
other never redelivers a killed worker's ``first`` message). Both record in the broker's Redis list ``runs`` that
they started (message id and fence), then hold their key for ``seconds``.
"""

from __future__ import annotations

import json
import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker

from dramatiq_leases import LeaseMiddleware, current_lease

BROKER_URL = os.environ["LEASES_TEST_BROKER_URL"]
QUEUE = os.environ.get("LEASES_TEST_QUEUE", "default")

# Redeliver a dead worker's messages within seconds, not Dramatiq's default minute.
broker = RedisBroker(url=BROKER_URL, heartbeat_timeout=3_000, maintenance_chance=MAINTENANCE_SCALE)  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
broker.add_middleware(
    LeaseMiddleware(
        redis_url=os.environ["LEASES_TEST_LEASES_URL"], lock_min_backoff=20, lock_max_backoff=200, history=50
    )
)
dramatiq.set_broker(broker)
record = redis.Redis.from_url(BROKER_URL)


def _hold(seconds: float) -> None:
    lease = current_lease()
    record.rpush("runs", json.dumps({"message_id": lease.meta["message_id"], "fence": lease.fence}))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # short sleeps: a lost lease's interruption lands between them
        time.sleep(0.02)


@dramatiq.actor(queue_name=QUEUE, lock_key="h:{key}", lock_ttl=2_000, max_retries=0)
def hold(key: str, seconds: float) -> None:
    _hold(seconds)


@dramatiq.actor(queue_name=f"{QUEUE}-first", lock_key="h:{key}", lock_ttl=2_000, max_retries=0)
def first(key: str, seconds: float) -> None:
    _hold(seconds)
