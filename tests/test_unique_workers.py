"""Unique messages across real worker processes: a SIGKILLed run keeps its record through its redelivery.

The workers are tests/apps/limit_app.py's, on the Redis and the RabbitMQ broker (a dead worker's messages are
redelivered within seconds on both). The probe of the key's record is the script a send runs.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from dramatiq_leases.core.unique import UniqueRecords

from .support.limit_workers import LimitWorkers, call

pytestmark = pytest.mark.system


def test_a_sigkilled_unique_message_keeps_its_record_through_its_redelivery(workers: LimitWorkers) -> None:
    records = UniqueRecords(workers.leases)

    def holder() -> str | None:
        """The message a new send of the key would be refused for, or ``None`` if it would be accepted."""
        found = records.take("uq", "probe", mode="until_done", grace=1_000)
        if found is None:
            records.end("uq", "probe")
        return found

    first = workers.start(threads=2)
    workers.send([call("job", "uq", 1, 2.0, lock_unique="until_done")])
    [started] = workers.wait_runs(1, "start")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    mid = started["message_id"]
    assert holder() == mid  # killed mid-run: still the same unique message, waiting for its redelivery
    workers.start(threads=2)
    [ran] = workers.wait_runs(1, "run", timeout=60)
    assert ran["message_id"] == mid  # the broker redelivered it: the record held all along
    workers.wait(lambda: workers.settled([mid]), timeout=30, what="the redelivered message acknowledged")
    settled = time.monotonic()
    workers.wait(lambda: holder() is None, timeout=5, what="the key free for a new send after the ack")
    assert time.monotonic() - settled < 5
