"""The Dramatiq app that benchmark workers load: ``dramatiq bench.app``.

Configured through the environment, so one module serves every figure:

``BENCH_REDIS_URL``
  the benchmark's private Redis (broker, leases and the job log).
``BENCH_MODE``
  ``bare`` (no lease middleware), ``leases`` (:class:`LeaseMiddleware` with
  its default Prometheus metrics), ``leases-nometrics`` (null metrics, to
  tell the metrics' cost apart), ``raw`` (the actor takes a bare ``SET NX``
  lock and releases it with a compare-and-delete script: the least any
  2-round-trip lock costs) or ``crl`` (Dramatiq's
  ``ConcurrentRateLimiter(limit=1)`` as the mutex, retried by Retries).
``BENCH_TTL``, ``BENCH_BACKOFF_MIN``, ``BENCH_BACKOFF_MAX``
  ``lock_ttl``, ``lock_min_backoff`` and ``lock_max_backoff`` (ms) for ours;
  the backoff pair also sets Retries' ``min_backoff``/``max_backoff`` in
  ``crl`` mode, so both wait the same way. Unset: LeaseMiddleware's defaults
  (:mod:`bench.defaults`; the ``raw`` and ``crl`` no-op locks use its TTL too).
``BENCH_MAX_RETRIES``
  Retries' ``max_retries`` (Dramatiq's 20 if unset): in ``crl`` mode every
  busy attempt is a retry, so a long wait needs more.
``BENCH_COUNT_ENQUEUES``
  ``1``: count every enqueue per message id (:mod:`bench.enqueues`).

Jobs log ``{"actor", "key", "start", "end", "pid", "attempts", "message_id"}`` as JSON to
the Redis list ``bench:log`` (:data:`bench.names.LOG_KEY`); ``start`` and ``end`` are ``time.time()``,
comparable across processes of one machine.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage, Retries, default_middleware
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.rate_limits.backends import RedisBackend

from dramatiq_leases.prometheus import NULL_METRICS

from .defaults import TTL_MS as DEFAULT_TTL_MS
from .enqueues import EnqueueCounter
from .names import HOLD_QUEUE, LOG_KEY, PROBE_QUEUE, THROUGHPUT_QUEUE

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
MODE = os.environ.get("BENCH_MODE", "bare")
MODES = ("bare", "raw", "leases", "leases-nometrics", "crl")
if MODE not in MODES:
    raise SystemExit(f"BENCH_MODE must be one of {MODES}, got {MODE!r}")
LEASES = MODE.startswith("leases")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


TTL = _env_int("BENCH_TTL")
BACKOFF_MIN = _env_int("BENCH_BACKOFF_MIN")
BACKOFF_MAX = _env_int("BENCH_BACKOFF_MAX")
MAX_RETRIES = _env_int("BENCH_MAX_RETRIES")

_middleware: list[Any] = [m() for m in default_middleware if m is not Retries]
# In crl mode Retries is the only backoff there is; give it ours so the comparison is like for like.
_retry_options: dict[str, Any] = {"max_retries": MAX_RETRIES} if MAX_RETRIES is not None else {}
if MODE == "crl":
    _retry_options.update(min_backoff=BACKOFF_MIN, max_backoff=BACKOFF_MAX)
_middleware.append(Retries(**_retry_options))
_middleware.append(CurrentMessage())
broker = RedisBroker(url=URL, middleware=_middleware)
if LEASES:
    from dramatiq_leases import LeaseMiddleware

    lease_defaults: dict[str, Any] = {
        k: v
        for k, v in {"lock_ttl": TTL, "lock_min_backoff": BACKOFF_MIN, "lock_max_backoff": BACKOFF_MAX}.items()
        if v is not None
    }
    broker.add_middleware(
        LeaseMiddleware(redis_url=URL, metrics=NULL_METRICS if MODE == "leases-nometrics" else None, **lease_defaults)
    )
dramatiq.set_broker(broker)

_log = redis.Redis.from_url(URL)
if os.environ.get("BENCH_COUNT_ENQUEUES") == "1":
    broker.add_middleware(EnqueueCounter(_log))
_mutex_backend = RedisBackend(client=_log)
_raw_release = _log.register_script(
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def _lock(key: str) -> dict[str, Any]:
    """Actor options that put a lease on ``key`` (nothing in the other modes)."""
    return {"lock_key": key} if LEASES else {}


def _attempts() -> int:
    """How often this message was sent back before it ran: busy retries (ours) or Retries' count (crl)."""
    message = CurrentMessage.get_current_message()
    if message is None:
        return 0
    return int(message.options.get("lease_busy_attempts", 0) or message.options.get("retries", 0))


def _message_id() -> str | None:
    message = CurrentMessage.get_current_message()
    return None if message is None else str(message.message_id)


def _record(actor: str, key: str, start: float, end: float | None) -> None:
    _log.rpush(
        LOG_KEY,
        json.dumps(
            {
                "actor": actor,
                "key": key,
                "start": start,
                "end": end,
                "pid": os.getpid(),
                "attempts": _attempts(),
                "message_id": _message_id(),
            }
        ),
    )


@dramatiq.actor(queue_name=THROUGHPUT_QUEUE, **_lock("tp:{n}"))
def noop(n: int) -> None:
    """Figure 3: nothing at all (under a lock in ``raw``/``crl`` modes): the lock's cost is all there is."""
    if MODE == "raw":
        token = secrets.token_hex(16)
        if not _log.set(f"bench:raw:tp:{n}", token, nx=True, px=TTL or DEFAULT_TTL_MS):
            raise RuntimeError("raw lock busy")  # keys are distinct: never happens
        _raw_release(keys=[f"bench:raw:tp:{n}"], args=[token])
    elif MODE == "crl":
        with ConcurrentRateLimiter(_mutex_backend, f"bench:crl:tp:{n}", limit=1, ttl=TTL or DEFAULT_TTL_MS).acquire():
            pass


def _held(actor: str, key: str, ms: int) -> None:
    start = time.time()
    _record(actor, key, start, None)  # the crash figure needs the holder's pid before it ends
    time.sleep(ms / 1000)
    _record(actor, key, start, time.time())


@dramatiq.actor(queue_name=HOLD_QUEUE, **_lock("{key}"))
def hold(key: str, ms: int) -> None:
    """Figures 4 and 5: hold ``key`` for ``ms`` milliseconds."""
    if MODE == "crl":
        mutex = ConcurrentRateLimiter(_mutex_backend, f"bench:crl:{key}", limit=1, ttl=TTL or 900_000)
        with mutex.acquire():  # raises RateLimitExceeded when busy: Retries sends the message back
            _held("hold", key, ms)
    else:
        _held("hold", key, ms)


@dramatiq.actor(queue_name=PROBE_QUEUE, **_lock("{key}"))
def probe(key: str) -> None:
    """Figure 5: take ``key`` once it is free; logs when it got it."""
    now = time.time()
    _record("probe", key, now, now)
