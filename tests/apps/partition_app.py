"""A Dramatiq app for the partition tests (tests/test_partitions.py), run on "hosts" in network namespaces.

Run by ``dramatiq tests.apps.partition_app`` from the repository root, configured by environment variables:

* ``PART_BROKER_URL``, ``PART_LEASES_URL`` (required): Redis URLs of the broker and of the leases, as
  this host reaches them (through its veth pair).
* ``PART_EVENTS`` (required): a directory shared by every host. A partitioned host cannot tell Redis
  what it does, so each records its events as JSON lines in ``<PART_EVENTS>/<PART_HOST>.jsonl`` instead:
  ``ready`` when the worker has booted, then ``start``, and ``done`` or ``error`` for each run, with the
  key, message id, fence, pid, ``at`` (``time.time()``) and ``mono`` (``time.monotonic()``; every
  process of the machine shares both clocks).
* ``PART_HOST``: this host's label (default ``a``). Actor ``hold_here`` consumes queue ``part-<label>``.
* ``PART_TTL_MS``, ``PART_RENEW_MS``: ``lock_ttl`` and ``lock_renew_interval`` (default 3 000 and 1 000).
* ``PART_HEARTBEAT_TIMEOUT_MS``: the broker's ``heartbeat_timeout`` (default 3 000); maintenance runs on
  every command, so the messages of a worker cut off that long go back to their queues.

:func:`hold` (queue ``part``, shared by every host) and :func:`hold_here` (queue ``part-<label>``, this
host only) hold the lease ``{key}`` for ``seconds``, or until the file ``<PART_EVENTS>/finish-<message
id>`` exists, in 50 ms naps so that a ``LeaseLost`` interrupts them promptly.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import dramatiq
from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker
from dramatiq.middleware import CurrentMessage, Middleware

from dramatiq_leases import LeaseMiddleware, current_lease

SHARED_QUEUE = "part"
HOST = os.environ.get("PART_HOST", "a")
HERE_QUEUE = f"part-{HOST}"
EVENTS = Path(os.environ["PART_EVENTS"])
TTL_MS = int(os.environ.get("PART_TTL_MS", "3000"))
RENEW_MS = int(os.environ.get("PART_RENEW_MS", "1000"))
HEARTBEAT_TIMEOUT_MS = int(os.environ.get("PART_HEARTBEAT_TIMEOUT_MS", "3000"))


def record(event: str, **fields: Any) -> None:
    """Append one event to this host's file (one ``write`` with ``O_APPEND``: lines never interleave)."""
    line = (
        json.dumps(
            {"event": event, "host": HOST, "pid": os.getpid(), "at": time.time(), "mono": time.monotonic(), **fields}
        )
        + "\n"
    )
    fd = os.open(EVENTS / f"{HOST}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class Ready(Middleware):
    """Records ``ready`` once the worker's consumers and threads run."""

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        record("ready")


broker = RedisBroker(
    url=os.environ["PART_BROKER_URL"],
    heartbeat_timeout=HEARTBEAT_TIMEOUT_MS,  # type: ignore[no-untyped-call]
    maintenance_chance=MAINTENANCE_SCALE,
)
broker.add_middleware(CurrentMessage())
broker.add_middleware(
    LeaseMiddleware(
        redis_url=os.environ["PART_LEASES_URL"], metrics_endpoint=False, lock_min_backoff=50, lock_max_backoff=300
    )
)
broker.add_middleware(Ready())
dramatiq.set_broker(broker)


def _hold(key: str, seconds: float) -> None:
    message = CurrentMessage.get_current_message()
    message_id = message.message_id if message is not None else ""
    fence = current_lease().fence
    record("start", key=key, message_id=message_id, fence=fence)
    finish = EVENTS / f"finish-{message_id}"
    try:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not finish.exists():
            time.sleep(min(0.05, left))
    except BaseException as e:
        reason = getattr(e, "reason", None)
        record(
            "error",
            key=key,
            message_id=message_id,
            fence=fence,
            error=type(e).__name__,
            reason=getattr(reason, "value", reason),
        )
        raise
    record("done", key=key, message_id=message_id, fence=fence)


@dramatiq.actor(queue_name=SHARED_QUEUE, lock_key="{key}", lock_ttl=TTL_MS, lock_renew_interval=RENEW_MS, max_retries=0)
def hold(key: str, seconds: float) -> None:
    """Hold the lease ``key`` for ``seconds`` (or until told to finish); any host may run it."""
    _hold(key, seconds)


@dramatiq.actor(
    actor_name="hold_here",
    queue_name=HERE_QUEUE,
    lock_key="{key}",
    lock_ttl=TTL_MS,
    lock_renew_interval=RENEW_MS,
    max_retries=0,
)
def hold_here(key: str, seconds: float) -> None:
    """The same, on this host's own queue."""
    _hold(key, seconds)
