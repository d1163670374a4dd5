"""Figure 7's actor, loaded by the workers after :mod:`bench.app`: ``dramatiq bench.app bench.limit_app``.

``hold_limit(key, ms)`` holds ``key`` for ``ms`` milliseconds with up to
``BENCH_LIMIT`` holders at once (default 4): ours through ``lock_limit`` (in
the ``leases`` modes), the peer's through ``ConcurrentRateLimiter(limit=...)``
in ``crl`` mode, raising ``RateLimitExceeded`` when full so that Retries sends
the message back (Dramatiq's documented pattern). It shares :mod:`bench.app`'s
broker, job log and every other ``BENCH_*`` setting.

``BENCH_TRACE=1`` also records, for every message, each enqueue (``q``: the
queue, ``d``: the delay) and each delivery to a worker thread, before any
lease is asked for (``deliver``), as JSON to :data:`TRACE_KEY`: where the time
between a release and the next grant goes (``python -m bench.limit_trace``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import dramatiq
from dramatiq.middleware import Middleware
from dramatiq.rate_limits import ConcurrentRateLimiter

from .app import LEASES, MODE, _held, _log, _mutex_backend, broker
from .limit_names import HOLD_LIMIT_ACTOR, TRACE_KEY
from .names import HOLD_QUEUE

#: How many holders one key may have.
LIMIT = int(os.environ.get("BENCH_LIMIT", "4"))

#: The peer's TTL on its counter: longer than any run, as :mod:`bench.app`'s ``hold`` has it.
CRL_TTL_MS = 900_000


class _Trace(Middleware):
    """Records enqueues and deliveries with their time (``time.time()``, as the job log)."""

    def _event(self, event: str, message: Any, **fields: Any) -> None:
        record = {"event": event, "id": message.message_id, "t": time.time(), "pid": os.getpid(), **fields}
        _log.rpush(TRACE_KEY, json.dumps(record))

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        self._event("enqueue", message, q=message.queue_name, d=delay)

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        self._event("deliver", message, q=message.queue_name)


if os.environ.get("BENCH_TRACE") == "1":
    # First of all: a delivery is recorded before the lease middleware asks Redis (and may skip it).
    broker.middleware.insert(0, _Trace())


#: Ours holds ``{key}`` with up to :data:`LIMIT` holders; the peer takes its own limiter in the actor.
_OPTIONS: dict[str, Any] = {"lock_key": "{key}", "lock_limit": LIMIT} if LEASES else {}


@dramatiq.actor(actor_name=HOLD_LIMIT_ACTOR, queue_name=HOLD_QUEUE, **_OPTIONS)
def hold_limit(key: str, ms: int) -> None:
    """Figure 7: hold ``key`` for ``ms`` milliseconds, one of at most :data:`LIMIT` holders."""
    if MODE == "crl":
        limiter = ConcurrentRateLimiter(_mutex_backend, f"bench:crl:{key}", limit=LIMIT, ttl=CRL_TTL_MS)
        with limiter.acquire():  # raises RateLimitExceeded when full: Retries sends the message back
            _held("hold_limit", key, ms)
    else:
        _held("hold_limit", key, ms)
