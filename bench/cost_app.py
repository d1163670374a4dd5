"""The Dramatiq app of figure 8's worker: ``dramatiq bench.cost_app``.

``COST_BROKER_URL`` is the broker, ``COST_LOG_URL`` the job log; ``COST_LEASES_URL`` the lease store, reached
directly or through figure 8's reply-delaying proxy. Actors: ``leased`` (``lock_key``, no-op), ``plain`` (no
lease) and ``by_hand`` (redis-py's ``Lock`` taken and released in the actor, as a user would without us).
"""

from __future__ import annotations

import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

from dramatiq_leases import LeaseMiddleware

broker = RedisBroker(url=os.environ["COST_BROKER_URL"])
broker.add_middleware(LeaseMiddleware(redis_url=os.environ["COST_LEASES_URL"]))
dramatiq.set_broker(broker)
_log = redis.Redis.from_url(os.environ["COST_LOG_URL"])
_store = redis.Redis.from_url(os.environ["COST_LEASES_URL"])

#: Where each job logs ``"<actor> <time.time()>"`` when it ends.
DONE_KEY = "cost:done"


@dramatiq.actor(lock_key="cost:{n}", lock_ttl=60_000, max_retries=0)
def leased(n: int) -> None:
    """A no-op job under a lease: what the lease costs is all there is."""
    _log.rpush(DONE_KEY, f"leased {time.time()}")


@dramatiq.actor(max_retries=0)
def plain(n: int) -> None:
    """The same job without a lease: the baseline of the round trips."""
    _log.rpush(DONE_KEY, f"plain {time.time()}")


@dramatiq.actor(max_retries=0)
def by_hand(n: int) -> None:
    """redis-py's ``Lock`` taken and released in the actor: two round trips a job."""
    lock = _store.lock(f"cost:hand:{n}", timeout=60)
    if lock.acquire(blocking=False):
        lock.release()
    _log.rpush(DONE_KEY, f"by_hand {time.time()}")
