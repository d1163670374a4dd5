"""A leased actor that records its key, fence and process in the Redis list ``django-runs``."""

from __future__ import annotations

import json
import os

import dramatiq
import redis

from dramatiq_leases import current_lease

RUNS = "django-runs"
record = redis.Redis.from_url(os.environ["LEASES_TEST_RECORD_URL"])


@dramatiq.actor(lock_key="django:{n}", lock_ttl=5_000, time_limit=2_000)
def fenced_job(n: int) -> None:
    lease = current_lease()
    record.rpush(RUNS, json.dumps({"n": n, "key": lease.key, "fence": lease.fence, "pid": os.getpid()}))
