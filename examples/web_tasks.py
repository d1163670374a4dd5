"""The Dramatiq side of the web example: one export per user at a time.

Run the worker with ``dramatiq examples.web_tasks`` (from the repository
root) and the web app with ``flask --app examples.flask_app run`` or
``uvicorn examples.fastapi_app:app``. Both read the same environment:

* ``REDIS_URL``: the broker and the leases (default ``redis://127.0.0.1:6379/0``).
* ``DRAMATIQ_LEASES_PREFIX``: the lease key prefix (default ``dramatiq-leases``).
* ``EXPORT_LOCK_TTL_MS``: the export lease's TTL (default 30 000). The web
  app takes the lease with it, so it must cover the time a message waits in
  the queue before a worker adopts the lease; the worker then keeps it alive
  with a heartbeat for as long as the export runs.
"""

from __future__ import annotations

import json
import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage

from dramatiq_leases import LeaseMiddleware, current_lease

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("DRAMATIQ_LEASES_PREFIX", "dramatiq-leases")
EXPORT_LOCK_TTL_MS = int(os.environ.get("EXPORT_LOCK_TTL_MS", "30000"))

#: A Redis list where each export records its start and end (the tests read it).
RUNS_KEY = "examples:export_report:runs"

lease_middleware = LeaseMiddleware(REDIS_URL, prefix=PREFIX)
broker = RedisBroker(url=REDIS_URL)  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
broker.add_middleware(CurrentMessage())
broker.add_middleware(lease_middleware)
dramatiq.set_broker(broker)

#: The leases the web app takes: the same store and prefix as the worker's.
leases = lease_middleware.leases

_redis = redis.Redis.from_url(REDIS_URL)


def _record(event: str, user_id: int) -> None:
    message = CurrentMessage.get_current_message()
    _redis.rpush(
        RUNS_KEY,
        json.dumps(
            {
                "event": event,
                "user_id": user_id,
                "fence": current_lease().fence,  # the web app's 202 returned this fence: the lease was adopted
                "message_id": message.message_id if message else None,
            }
        ),
    )


@dramatiq.actor(lock_key="export:report:{user_id}", lock_ttl=EXPORT_LOCK_TTL_MS, max_retries=0)
def export_report(user_id: int, seconds: float) -> None:
    """Build a user's report (here: wait ``seconds``) while holding the lease ``export:report:{user_id}``."""
    _record("started", user_id)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.1, left))  # short naps, so that a LeaseLost interrupts promptly
    _record("finished", user_id)


#: The holder metadata of a lease the web app takes (and of its place in the key's line): `dramatiq-leases
#: list` and the exporter show the job's actor; the worker's metadata replaces it when it adopts the lease.
WEB_META = {"actor": export_report.actor_name, "queue": export_report.queue_name}
