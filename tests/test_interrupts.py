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

import json
import logging
import pathlib
import random
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import Middleware, Shutdown
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.threading import raise_thread_exception
from prometheus_client import CollectorRegistry

from dramatiq_leases import Busy, LeaseLost, PrometheusMetrics, current_lease
from dramatiq_leases.core import LostReason
from dramatiq_leases.embedded import EmbeddedRedis

from .support.brokers import pending, redis_dead_letters
from .support.interrupts import LockFreeHandler
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

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
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

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        if exception is not None:
            frame = traceback.extract_tb(exception.__traceback__)[-1]
            self.failures[message.message_id] = (type(exception).__name__, frame.filename, frame.name)


@pytest.fixture
def lease_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.close()


@pytest.mark.usefixtures("survivable_worker_threads")
def test_thousands_of_interrupts_leave_the_bookkeeping_whole(
    redis_server: EmbeddedRedis, lease_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The standard log handlers take a lock in Python code: an asynchronous exception landing just
    # after it is taken strands it, and every later log call blocks (a hazard of TimeLimit in
    # production too). The storm is about this package's state, so records go to a lock-free list;
    # set here, not in a fixture, to replace pytest's own capturing handlers as well.
    monkeypatch.setattr(logging.getLogger(), "handlers", [LockFreeHandler()])
    registry = CollectorRegistry()
    stack = Stack(
        redis_server.url(0),
        lease_server.url(0),
        threads=8,
        lock_min_backoff=1,
        lock_max_backoff=5,
        metrics=PrometheusMetrics(registry=registry),
    )
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
        # Until enough interruptions fired, however fast the machine: batches of 500, within a deadline.
        rng = random.Random(1)
        messages: list[Any] = []
        outcome: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while sum(storm.fired.values()) < 1_500 and time.monotonic() < deadline:
            batch = [work.send(i, i % 32, rng.randrange(0, 20_000)) for i in range(len(messages), len(messages) + 500)]
            outcome.update({m.message_id: stack.recorder.wait_settled(m.message_id, timeout=60) for m in batch})
            messages += batch
        total = len(messages)
    finally:
        storm.running = False

    fired = storm.fired["time_limit"] + storm.fired["lease_lost"]
    assert fired >= 1_500, f"the storm was too weak to prove anything in 120 s: {storm.fired}"
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
    landed_in_ours = [
        f
        for f in outcomes.failures.values()
        if PACKAGE in f[1] and f[0] == "LeaseLost" and f[2] not in ("begin", "guarded")
    ]
    assert landed_in_ours == [], f"a LeaseLost landed in the package's own bookkeeping: {landed_in_ours[:5]}"

    # Nothing is left renewed, held or counted: every finished message's lease ended.
    heartbeat = stack.leases_mw.heartbeat
    wait_for(lambda: heartbeat.tracked() == [], what="every lease to be untracked", timeout=5)
    wait_for(lambda: list(stack.leases.scan()) == [], what="every lease to be gone from Redis", timeout=5)
    wait_for(
        lambda: registry.get_sample_value("dramatiq_lease_held", {"actor_name": "work", "queue_name": "default"}) == 0,
        what="the held gauge to return to zero",
        timeout=5,
    )

    # No thread keeps a place to wait in place, and the lines empty: a waiter whose message was failed
    # by an interruption loses its place by its deadline (at most 12 s for one waiting in place).
    # (A thread may still wait in place for a spare copy of a message sent again after an interruption.)
    wait_for(lambda: stack.leases_mw.waiting.in_place == 0, timeout=15, what="every place to wait in place back")
    wait_for(
        lambda: not any(line.length for line in stack.leases.scan_lines()),
        timeout=15,
        what="the lines of the settled messages to empty",
    )

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
    print(
        f"interrupts fired: {storm.fired}; messages failed: "
        f"{sum(1 for v in outcome.values() if v == 'nacked')}/{total}; returned: {len(done)}"
    )


class ShutdownAtCall(Middleware):
    """Raises ``Shutdown`` at the *n*-th Python function entry (a point where CPython delivers asynchronous
    exceptions) inside ``LeaseMiddleware.before_process_message``, a different *n* for each message's first
    delivery: swept over the whole hook, from its first call to its last, for a busy key."""

    def __init__(self, hook: Any, stride: int) -> None:
        self.hook = hook.__code__
        self.stride = stride
        self.next_n = 1
        self.targets: dict[str, int] = {}  # message id -> the call it was interrupted at
        self.fired: dict[str, str] = {}  # message id -> the function entered when it fired
        self.local = threading.local()

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if message.message_id in self.targets:
            return  # one instant per message: its copies run undisturbed
        self.targets[message.message_id] = self.local.target = self.next_n
        self.next_n += self.stride
        self.local.calls = 0
        self.local.message_id = message.message_id
        sys.setprofile(self._profile)  # again each time: a raise from a profile function turns it off

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        # Entries of this package's and Dramatiq's functions. Not redis-py's: an interruption at the entry of
        # its reply parsing, just after a command was sent on a pooled connection of the *broker's* client,
        # returns that connection to the pool with the reply unread (Dramatiq's client, not ours; a real
        # Shutdown lands while the thread waits in the socket read, which redis-py handles).
        if (
            event != "call"
            or frame.f_code is self.hook
            or not any(part in frame.f_code.co_filename for part in ("/dramatiq_leases/", "/dramatiq/"))
        ):
            return
        outer = frame.f_back
        while outer is not None and outer.f_code is not self.hook:
            outer = outer.f_back
        if outer is None:
            return
        self.local.calls += 1
        if self.local.calls == self.local.target:
            sys.setprofile(None)
            self.fired[self.local.message_id] = f"{frame.f_code.co_name} ({frame.f_code.co_filename})"
            raise Shutdown

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        sys.setprofile(None)

    after_skip_message = after_process_message


@pytest.mark.usefixtures("survivable_worker_threads")
def test_a_shutdown_at_any_call_of_the_hook_never_runs_a_message_twice(
    redis_server: EmbeddedRedis, lease_server: EmbeddedRedis
) -> None:
    """The hook of a busy message parks it (the copy's enqueue, its reply) or waits in place: an interruption
    landing anywhere in it, the copy in the broker or not, ends with the message run once, never a Retries
    retry beside a copy, never dead-lettered."""
    stack = Stack(redis_server.url(0), lease_server.url(0), threads=4, lock_min_backoff=1, lock_max_backoff=20)
    injector = ShutdownAtCall(stack.leases_mw.before_process_message.__func__, stride=1)  # type: ignore[attr-defined]  # mypy types a bound method as a plain callable, without __func__
    stack.broker.add_middleware(injector)  # its before-hook runs just before LeaseMiddleware's
    stack.broker.middleware.remove(injector)
    stack.broker.middleware.insert(stack.broker.middleware.index(stack.leases_mw), injector)
    runs: list[tuple[int, int]] = []

    @stack.actor(lock_key="storm:{key}", max_retries=3)
    def work(i: int, key: int) -> None:
        current = dramatiq.middleware.CurrentMessage.get_current_message()
        runs.append((i, current.options.get("retries", 0) if current else -1))

    stack.broker.add_middleware(dramatiq.middleware.CurrentMessage())
    stack.start()
    try:
        holder = stack.leases.try_acquire("storm:1", ttl=120_000)
        assert not isinstance(holder, Busy)
        total = 0
        deadline = time.monotonic() + 120
        # Until the sweep has passed the hook's last call (a message whose target it never reached), in batches.
        while time.monotonic() < deadline:
            batch = [work.send(total + i, 1) for i in range(40)]
            total += len(batch)
            wait_for(
                lambda n=total: stack.leases.inspect_line("storm:1").length == n,  # type: ignore[misc]  # mypy cannot type a lambda's default, which binds the loop variable
                timeout=60,
                what="every message so far to wait in the line",
            )
            if len(injector.fired) < total - 10:
                break
        assert stack.leases.release(holder)
        wait_for(lambda: len({i for i, _ in runs}) == total, timeout=120, what="every message to run")
        wait_for(lambda: pending(redis_server) == 0, timeout=60, what="the broker to hold no copy")
    finally:
        stack.stop()
    assert len(injector.fired) >= 100, f"the sweep was too short to prove anything: {len(injector.fired)}"
    ran = sorted(i for i, _ in runs)
    assert ran == list(range(total)), "a message ran twice" if len(ran) > total else "a message was lost"
    assert [r for r in runs if r[1]] == [], "an interruption in the hook reached Retries"
    assert redis_dead_letters(redis_server) == []


def test_a_worker_thread_imports_nothing_on_the_lease_path(redis_server: EmbeddedRedis) -> None:
    """An import on a worker thread is a hang waiting to happen: an exception Dramatiq raises into the thread
    there (TimeLimit, Shutdown) leaves the import's module lock held, and every thread importing that module
    next waits for it for good. In a fresh interpreter, the first messages down each path (tests/apps/
    first_imports.py: waits, parks, policies, rates, debounce, unique, a lost lease) start none (a first grant
    once read a data file, whose codec lookup is an import)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.apps.first_imports", redis_server.url(0), redis_server.url(1)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=pathlib.Path(__file__).parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    imports = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [i for i in imports if i[1]] == [], f"imports started on a worker thread by this package: {imports}"


FIRST_CONNECTION = """
import sys, dramatiq_leases, dramatiq_leases.middleware
before = set(sys.modules)
leases = dramatiq_leases.Leases.from_url(sys.argv[1])
leases.release(leases.try_acquire("k", ttl=1000))
print(sorted(set(sys.modules) - before))
"""


def test_a_first_connection_by_host_name_imports_nothing(redis_server: EmbeddedRedis) -> None:
    """A worker thread's first connection may be its process's first: it must import nothing either (see the test
    above). Once the package is imported, a first grant and release over a new connection to a host name import
    no module (a name lookup imports the idna codec, and redis-py reads its version with importlib.metadata)."""
    url = redis_server.url(1).replace("127.0.0.1", "localhost")
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_CONNECTION, url], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "[]", f"imported by a first connection: {proc.stdout.strip()}"
