"""The Dramatiq app that ``dramatiq-leases demo`` runs in its worker processes.

Not meant to be imported by hand: :func:`dramatiq_leases.demo.run` starts
``python -m dramatiq dramatiq_leases.demo.app`` with the environment
variables below set, pointing at the demo's Redis and its run-specific
names. The actor :func:`process_invoice` takes ``seconds`` to process an
invoice while holding the lease ``invoice:{invoice_id}``, and records when
it starts and finishes in a Redis list that the demo reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker
from dramatiq.middleware import CurrentMessage
from dramatiq.middleware.prometheus import Prometheus

from ..core.client import client_from_url
from ..middleware import LeaseMiddleware, current_lease
from . import (
    ACTOR_NAME,
    ENV_EVENTS_KEY,
    ENV_LOCK_TTL,
    ENV_NAMESPACE,
    ENV_PARENT_PID,
    ENV_PREFIX,
    ENV_PRIVATE_REDIS,
    ENV_REDIS_URL,
    HEARTBEAT_TIMEOUT_MS,
    QUEUE_NAME,
)

try:
    REDIS_URL = os.environ[ENV_REDIS_URL]
except KeyError:
    raise RuntimeError(
        f"dramatiq_leases.demo.app is run by `dramatiq-leases demo`, which sets {ENV_REDIS_URL}; "
        "run that command instead"
    ) from None
PREFIX = os.environ[ENV_PREFIX]
EVENTS_KEY = os.environ[ENV_EVENTS_KEY]
LOCK_TTL_MS = int(os.environ[ENV_LOCK_TTL])


class _Prometheus(Prometheus):
    """Dramatiq's own metrics, minus its exposition server.

    The demo runs several worker instances, which would all try to bind the
    same port; the demo serves the shared multiprocess directory itself.
    """

    @property
    def forks(self) -> list[Any]:
        """No exposition server process."""
        return []


broker = RedisBroker(  # type: ignore[no-untyped-call]
    url=REDIS_URL,
    namespace=os.environ[ENV_NAMESPACE],
    # The demo SIGKILLs a worker: its unacked messages go back to the queue once
    # it has missed heartbeats this long, and live workers run that maintenance
    # on every command instead of on one in a thousand, so redelivery takes
    # seconds rather than a minute. Production keeps Dramatiq's defaults.
    heartbeat_timeout=HEARTBEAT_TIMEOUT_MS,
    maintenance_chance=MAINTENANCE_SCALE,
)
broker.add_middleware(CurrentMessage())
broker.add_middleware(_Prometheus())
broker.add_middleware(LeaseMiddleware(REDIS_URL, prefix=PREFIX))
dramatiq.set_broker(broker)

_events = client_from_url(REDIS_URL)


def _record(event: str, invoice_id: int, job: int, **fields: Any) -> None:
    """Append a job event, stamped with Redis server time so all processes share one clock."""
    seconds, micros = _events.time()
    data = {
        "event": event,
        "invoice": invoice_id,
        "job": job,
        "pid": os.getpid(),
        "t_ms": seconds * 1000 + micros // 1000,
        **fields,
    }
    _events.rpush(EVENTS_KEY, json.dumps(data))


@dramatiq.actor(
    actor_name=ACTOR_NAME,
    queue_name=QUEUE_NAME,
    lock_key="invoice:{invoice_id}",
    lock_ttl=LOCK_TTL_MS,
    lock_min_backoff=100,
    lock_max_backoff=1000,
    # Retries stay fast so that an unexpected failure shows up within the demo.
    max_retries=3,
    min_backoff=100,
    max_backoff=500,
)
def process_invoice(invoice_id: int, job: int, seconds: float) -> None:
    """Process one invoice for ``seconds`` while holding the lease on ``invoice:{invoice_id}``."""
    lease = current_lease()
    message = CurrentMessage.get_current_message()
    ids = {"fence": lease.fence, "message_id": message.message_id if message else ""}
    _record("start", invoice_id, job, **ids)
    try:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.05, left))  # short naps, so a LeaseLost interrupts promptly
    except BaseException as e:
        _record("error", invoice_id, job, error=repr(e), **ids)
        raise
    _record("done", invoice_id, job, **ids)


def _exit_with_demo(parent: int) -> None:
    """Stop this worker's whole instance if the demo died without cleaning up (it was SIGKILLed).

    The demo's private Redis goes too: nobody else knows it is there.
    """
    while True:
        time.sleep(0.5)
        try:
            os.kill(parent, 0)
        except (ProcessLookupError, PermissionError):  # PermissionError: the pid now belongs to another user
            if os.environ.get(ENV_PRIVATE_REDIS):
                with contextlib.suppress(redis.RedisError):
                    _events.shutdown(nosave=True)
            # The instance's main process stops its workers cleanly (this one included).
            main = os.getppid()
            os.kill(main if main > 1 else os.getpid(), signal.SIGTERM)
            return


if os.environ.get(ENV_PARENT_PID):
    threading.Thread(
        target=_exit_with_demo, args=(int(os.environ[ENV_PARENT_PID]),), daemon=True, name="dramatiq-leases-demo-watch"
    ).start()
