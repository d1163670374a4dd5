"""The worker app of :mod:`bench.rate_backlog`: ``dramatiq bench.rate_app`` (settings from the environment).

``RATE_URL``: the private Redis (broker unless ``RATE_BROKER=rabbitmq``, leases, and the log); ``RATE``: the
rate (``"50/s"``); ``RATE_MODE``: ``leases`` (``lock_rate``, waiting in the key's line) or ``window``
(Dramatiq's ``WindowRateLimiter`` over the same window, a message over it raising so that Retries sends it
back). Each run appends its grant time (µs: ours, its lease's fence, which is the grant's server time; the
peer's, ``time.time()``) to ``rate:starts``; every enqueue counts in ``rate:enqueues``. ``RATE_TRACE=1``
(leases only): each run also appends to ``rate:trace`` when its delivery reached the worker and how its copy
got there (the send, a parked copy moved by Dramatiq's delay queue at its eta, or sent on by the middleware),
for :func:`bench.rate_backlog.trace_report`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware
from dramatiq.rate_limits import WindowRateLimiter
from dramatiq.rate_limits.backends import RedisBackend

from dramatiq_leases import LeaseMiddleware, current_lease
from dramatiq_leases.core.rates import parse_rate

URL = os.environ["RATE_URL"]
RATE = os.environ.get("RATE", "50/s")
MODE = os.environ.get("RATE_MODE", "leases")
_log = redis.Redis.from_url(URL)


TRACE = os.environ.get("RATE_TRACE") == "1" and MODE == "leases"
_delivery = threading.local()


def _mover() -> str:
    """Who enqueues a copy without a delay: Dramatiq's delay queue at its eta, or the middleware (a promotion, or
    the eta by its own timer), or nobody's: the send."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "handle_delayed_messages":
            return "eta"
        if frame.f_code.co_name == "_send_on":
            return "sent_on"
        frame = frame.f_back  # type: ignore[assignment]
    return "send"


class _CountEnqueues(Middleware):
    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        _log.incr("rate:enqueues")
        if TRACE:  # how this copy left: parked (with its delay), or moved on to its queue (by whom)
            now = int(time.time() * 1_000_000)
            if delay:
                _log.hset("rate:parks", message.message_id, f"{delay}@{now}")
            else:
                _log.hset("rate:moves", message.message_id, f"{_mover()}@{now}")

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if TRACE:  # runs before LeaseMiddleware's: when this delivery reached a worker thread, and how
            _delivery.arrived = int(time.time() * 1_000_000)
            moved, parked = (_log.hget(name, message.message_id) for name in ("rate:moves", "rate:parks"))
            _delivery.how = tuple(
                x.decode() if isinstance(x, bytes) else d for x, d in ((moved, "send@0"), (parked, "0@0"))
            )


broker: dramatiq.Broker
if os.environ.get("RATE_BROKER") == "rabbitmq":
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    broker = RabbitmqBroker(url=os.environ.get("RATE_AMQP", "amqp://guest:guest@127.0.0.1:5672/"))
else:
    broker = RedisBroker(url=URL)  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
broker.add_middleware(_CountEnqueues())
if MODE == "leases":
    broker.add_middleware(LeaseMiddleware(redis_url=URL, metrics_endpoint=False))
dramatiq.set_broker(broker)

if MODE == "leases":

    @dramatiq.actor(lock_key="vendor:{account}", lock_rate=RATE, lock_max_wait=None, max_retries=0)
    def call_vendor(account: str, n: int) -> None:
        lease = current_lease()
        assert lease is not None
        _log.rpush("rate:starts", lease.fence)
        if TRACE:
            (how, _, moved), (delay, _, parked) = (part.partition("@") for part in _delivery.how)
            fact = {"fence": lease.fence, "arrived": _delivery.arrived, "how": how, "moved": int(moved), "n": n}
            fact.update(park_delay=int(delay), parked=int(parked))
            _log.rpush("rate:trace", json.dumps(fact))

else:
    _rate = parse_rate(RATE)
    _limiter = WindowRateLimiter(
        RedisBackend(client=_log), "rate:window", limit=_rate.count, window=max(1, _rate.window // 1000)
    )

    @dramatiq.actor(max_retries=100_000, min_backoff=50, max_backoff=2_000)
    def call_vendor(account: str, n: int) -> None:
        with _limiter.acquire():  # raises RateLimitExceeded over the window: Retries sends the message back
            _log.rpush("rate:starts", int(time.time() * 1_000_000))
