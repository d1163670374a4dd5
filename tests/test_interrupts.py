"""Asynchronous exceptions at varied instants: the lease bookkeeping must stay whole.

Dramatiq raises ``TimeLimitExceeded`` and ``Shutdown`` into worker threads, and
this package raises ``LeaseLost``; any of them can land between two bytecodes
of any code on a worker thread, including ours before, around and after the
actor. This storm injects thousands of them, each source at most once per
delivery (as the real sources do), at instants spread over a delivery's life,
and then checks what users rely on: the heartbeat still works, no finished
message's lease is left renewed or counted as held, nothing is lost, and no
actor that returned is failed by an interruption that landed after it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import Interrupt, Middleware
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.threading import raise_thread_exception
from dramatiq.worker import WorkerThread
from prometheus_client import CollectorRegistry

from dramatiq_leases import LeaseLost, PrometheusMetrics, current_lease
from dramatiq_leases.core import LostReason
from dramatiq_leases.embedded import EmbeddedRedis

from .support.stack import Stack
from .support.waiting import wait_for

PACKAGE = "/dramatiq_leases/"


class Storm(Middleware):
    """Like TimeLimit: registers each delivery at its start, and a thread interrupts it at a random instant.

    Two sources per delivery, each fired at most once while the delivery is
    registered: a ``TimeLimitExceeded`` raised into the thread, and the
    lease's own lost-callback (what the heartbeat calls), which raises
    ``LeaseLost`` if the actor is running.
    """

    def __init__(self, window: float, seed: int) -> None:
        self.window = window
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.slots: dict[int, list[Any]] = {}  # thread id -> [time_limit_at, lost_at, lost_callback]
        self.fired = {"time_limit": 0, "lease_lost": 0}
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)

    def instant(self) -> float:
        # One delivery in five gets no interruption from a source, so plenty complete.
        return time.monotonic() + self.random.uniform(0, self.window) if self.random.random() < 0.8 else float("inf")

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        with self.lock:
            self.slots[threading.get_ident()] = [self.instant(), self.instant(), None]

    def tracked(self, lease: Any, on_lost: Any) -> None:
        """Called on the worker thread when the middleware starts renewing its lease."""
        slot = self.slots.get(threading.get_ident())
        if slot is not None:
            slot[2] = (lease, on_lost)

    def after_process_message(self, broker: dramatiq.Broker, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        with self.lock:
            self.slots.pop(threading.get_ident(), None)

    after_skip_message = after_process_message

    def _run(self) -> None:
        while self.running:
            now = time.monotonic()
            callbacks = []
            with self.lock:
                for thread_id, slot in self.slots.items():
                    if slot[0] <= now:
                        slot[0] = float("inf")
                        self.fired["time_limit"] += 1
                        raise_thread_exception(thread_id, TimeLimitExceeded)  # type: ignore[no-untyped-call]
                    if slot[1] <= now and slot[2] is not None:
                        slot[1] = float("inf")
                        self.fired["lease_lost"] += 1
                        callbacks.append(slot[2])
            for lease, on_lost in callbacks:
                on_lost(lease, LostReason.STOLEN)
            time.sleep(0.0002)


class Outcomes(Middleware):
    """Where each failed delivery's exception was raised: the innermost frame of its traceback."""

    def __init__(self) -> None:
        self.failures: dict[str, tuple[str, str, str]] = {}

    def after_process_message(self, broker: dramatiq.Broker, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        if exception is not None:
            frame = traceback.extract_tb(exception.__traceback__)[-1]
            self.failures[message.message_id] = (type(exception).__name__, frame.filename, frame.name)


@pytest.fixture
def survivable_worker_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dramatiq's own handler of a failed message can be interrupted too, and the interruption then
    ends its worker thread (as TimeLimit can do in production). Keep the threads alive: the storm
    tests this package's bookkeeping, not that window of Dramatiq's."""
    process = WorkerThread.process_message

    def surviving(self: WorkerThread, message: Any) -> None:
        with contextlib.suppress(Interrupt):
            process(self, message)

    monkeypatch.setattr(WorkerThread, "process_message", surviving)


class LockFreeHandler(logging.Handler):
    """Keeps records in a list, without the handler lock an interruption could strand."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def createLock(self) -> None:  # noqa: N802 (logging's name)
        self.lock = None

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def lease_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.close()


@pytest.mark.usefixtures("survivable_worker_threads")
def test_thousands_of_interrupts_leave_the_bookkeeping_whole(redis_server: EmbeddedRedis, lease_server: EmbeddedRedis,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The standard log handlers take a lock in Python code: an asynchronous exception landing just
    # after it is taken strands it, and every later log call blocks (a hazard of TimeLimit in
    # production too). The storm is about this package's state, so records go to a lock-free list;
    # set here, not in a fixture, to replace pytest's own capturing handlers as well.
    monkeypatch.setattr(logging.getLogger(), "handlers", [LockFreeHandler()])
    registry = CollectorRegistry()
    stack = Stack(redis_server.url(0), lease_server.url(0), threads=8, lock_min_backoff=1, lock_max_backoff=5,
                  metrics=PrometheusMetrics(registry=registry))
    storm = Storm(window=0.006, seed=8)
    outcomes = Outcomes()
    # First, like TimeLimit: its window spans every other middleware's hooks and the actor.
    stack.broker.middleware.insert(0, storm)
    stack.broker.add_middleware(outcomes)
    track = stack.leases_mw.heartbeat.track

    def track_and_note(lease: Any, on_lost: Any) -> None:
        track(lease, on_lost)
        storm.tracked(lease, on_lost)

    stack.leases_mw.heartbeat.track = track_and_note  # type: ignore[method-assign]
    returned: list[int] = []
    unguarded: list[int] = []

    @stack.actor(lock_key="storm:{key}", lock_ttl=1_000, max_retries=0)
    def work(i: int, key: int, spins: int) -> int:
        if current_lease().remaining() <= 0:
            unguarded.append(i)
        for _ in range(spins):
            pass
        returned.append(i)  # the last statement: what follows is the return
        return i

    storm.thread.start()
    try:
        stack.start()
        total = 2_000
        rng = random.Random(1)
        messages = [work.send(i, i % 32, rng.randrange(0, 20_000)) for i in range(total)]
        outcome = {m.message_id: stack.recorder.wait_settled(m.message_id, timeout=60) for m in messages}
    finally:
        storm.running = False

    fired = storm.fired["time_limit"] + storm.fired["lease_lost"]
    assert fired >= 1_500, f"the storm was too weak to prove anything: {storm.fired}"
    assert unguarded == []

    # No actor that returned was failed by an interruption that landed after it returned:
    # the only failures of returned actors are raised inside the actor itself (after its
    # last statement, before its return), or in Dramatiq's own code, never in ours.
    done = set(returned)
    for i, m in enumerate(messages):
        if outcome[m.message_id] == "nacked" and i in done:
            name, filename, function = outcomes.failures[m.message_id]
            assert function == "work" or PACKAGE not in filename, (
                f"message {i} returned, then was failed by {name} raised in {function} ({filename})"
            )
    landed_in_ours = [f for f in outcomes.failures.values() if PACKAGE in f[1] and f[0] == "LeaseLost"
                      and f[2] not in ("begin", "guarded")]
    assert landed_in_ours == [], f"a LeaseLost landed in the package's own bookkeeping: {landed_in_ours[:5]}"

    # Nothing is left renewed, held or counted: every finished message's lease ended.
    heartbeat = stack.leases_mw.heartbeat
    wait_for(lambda: heartbeat.tracked() == [], what="every lease to be untracked", timeout=5)
    wait_for(lambda: list(stack.leases.scan()) == [], what="every lease to be gone from Redis", timeout=5)
    wait_for(lambda: registry.get_sample_value("dramatiq_lease_held", {"actor_name": "work", "queue_name": "default"})
             == 0, what="the held gauge to return to zero", timeout=5)

    # No thread keeps a place to wait in place, and the lines empty: a waiter whose message was failed
    # by an interruption loses its place by its deadline (at most 12 s for one waiting in place).
    assert stack.leases_mw.waiting.in_place == 0
    wait_for(lambda: not any(line.length for line in stack.leases.scan_lines()), timeout=15,
             what="the lines of the settled messages to empty")

    # The heartbeat still works: a job of three TTLs keeps its lease, renewed, and completes.
    long_runs: list[int] = []

    @stack.actor(lock_key="after:{n}", lock_ttl=300, max_retries=0)
    def long_job(n: int) -> None:
        fence = current_lease().fence
        start = time.monotonic()
        try:
            while time.monotonic() - start < 0.9:
                time.sleep(0.01)
        except LeaseLost:
            return
        long_runs.append(fence)

    assert stack.recorder.wait_settled(long_job.send(1).message_id) == "acked"
    assert len(long_runs) == 1
    stack.stop()
    print(f"interrupts fired: {storm.fired}; messages failed: "
          f"{sum(1 for v in outcome.values() if v == 'nacked')}/{total}; returned: {len(done)}")
