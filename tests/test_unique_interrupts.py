"""``lock_unique`` under Dramatiq's asynchronous interruptions, worker stops, long delays and racing producers.

The promises attacked (docs/guide.md, "Unique messages: refused at send time"): no record ends while its
message is still queued, parked, delayed or running; none outlives its message past its stated bounds (a
new send is accepted within 5 s of the final ack or dead-lettering); never more records than the limit.
Interruptions are injected as tests/test_interrupts.py does (``raise_thread_exception``, or raised at a
chosen point of a hook). Real Redis, a real broker and worker in process, and real ``dramatiq`` worker
processes for the stops (tests/apps/limit_app.py, on both brokers).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import Middleware
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.threading import raise_thread_exception
from dramatiq.worker import ConsumerThread

from dramatiq_leases import Busy, DuplicateMessage, RateLimited
from dramatiq_leases.core.unique import UniqueRecords

from .support.interrupts import InterruptAfterEnqueue
from .support.limit_workers import LimitWorkers, call
from .support.stack import MakeStack
from .support.waiting import wait_for


def accepted(actor: Any, *args: Any, **options: Any) -> str | None:
    """The id of a new message of ``actor`` if its send is accepted, else ``None`` (refused as a duplicate)."""
    try:
        return str(actor.send_with_options(args=args, **options).message_id)
    except DuplicateMessage:
        return None


def refused_until(actor: Any, *args: Any, done: Any, timeout: float = 20.0) -> int:
    """Every send of ``actor(*args)`` is refused until ``done()`` is true (polled); how many were tried."""
    deadline = time.monotonic() + timeout
    tried = 0
    while not done():
        assert time.monotonic() < deadline, "the first message never finished"
        sent = accepted(actor, *args)
        if sent is not None and done():
            return tried  # it ended (or started) between the check and the send: rightly accepted
        assert sent is None, f"a send was accepted ({sent}) while the first message was still live"
        tried += 1
        time.sleep(0.05)
    return tried


def freed_within(actor: Any, *args: Any, seconds: float = 5.0) -> str:
    """A send of ``actor(*args)`` is accepted within ``seconds`` (the stated bound after a final ack)."""
    sent = wait_for(lambda: accepted(actor, *args), timeout=seconds, what="a send accepted after the final ack")
    assert sent is not None
    return sent


def _retry_stack(make_stack: MakeStack, mode: str, error: type[BaseException] = TimeLimitExceeded) -> tuple[Any, ...]:
    stack = make_stack()
    injector = InterruptAfterEnqueue(lambda m, d: d is not None and m.options.get("retries") == 1, error)
    stack.broker.add_middleware(injector)
    runs: list[int] = []

    @stack.actor(lock_key="r:{n}", lock_unique=mode, max_retries=1, min_backoff=1_500, max_backoff=1_500)
    def job(n: int) -> None:
        runs.append(n)
        if len(runs) == 1:
            raise RuntimeError("fails once")

    return stack, injector, job, runs


@pytest.mark.usefixtures("survivable_worker_threads")
@pytest.mark.parametrize("mode", ["until_done", "queued"])
def test_an_interruption_after_the_broker_took_the_retry_keeps_the_record(make_stack: MakeStack, mode: str) -> None:
    """The first attempt fails; Retries' enqueue of the retry reaches the broker, and an interruption lands before
    the hooks hear of it (the worker thread then acks the delivery): the retry waits in the delay queue, the same
    unique message, and its record must hold until the retry is done."""
    stack, injector, job, runs = _retry_stack(make_stack, mode)
    first = job.send(1)
    stack.start()
    wait_for(lambda: injector.fired, what="the interruption after the retry's enqueue")
    wait_for(lambda: first.message_id in stack.recorder.acked, what="the failed attempt acknowledged")
    assert len(runs) == 1  # the retry is in the delay queue
    refused_until(job, 1, done=lambda: len(runs) == 2)
    assert stack.recorder.wait_settled(first.message_id) == "acked"
    freed_within(job, 1)


@pytest.mark.usefixtures("survivable_worker_threads")
def test_an_interruption_before_the_broker_took_the_retry_ends_the_record_by_its_bound(make_stack: MakeStack) -> None:
    """The other side of the same instant: the interruption lands before the retry reached the broker (raised in
    a before-hook). Nothing of the message is left, but no hook can tell this from the instant above: the record
    is kept as if the copy were there, and ends by that bound, the retry's delay (1.5 s) plus lock_unique_ttl
    (1 s), never later."""
    stack = make_stack()

    class InterruptBeforeEnqueue(Middleware):
        def __init__(self) -> None:
            self.fired: list[str] = []

        def before_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
            if not self.fired and delay is not None and message.options.get("retries") == 1:
                self.fired.append(message.message_id)
                raise TimeLimitExceeded

    injector = InterruptBeforeEnqueue()
    stack.broker.add_middleware(injector)

    @stack.actor(
        lock_key="b:{n}",
        lock_unique="until_done",
        lock_unique_ttl=1_000,
        max_retries=1,
        min_backoff=1_500,
        max_backoff=1_500,
    )
    def job(n: int) -> None:
        raise RuntimeError("fails")

    first = job.send(1)
    stack.start()
    wait_for(lambda: first.message_id in stack.recorder.acked, what="the failed attempt acknowledged")
    acked = time.monotonic()
    assert injector.fired
    assert stack.broker.client.hlen("dramatiq:default.DQ.msgs") == 0
    freed_within(job, 1, seconds=4.0)
    assert time.monotonic() - acked < 1.5 + 1.0 + 1.0


# Delays longer than lock_unique_ttl -------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "delay"), [("until_done", 2_500), ("queued", 2_500), ("until_done", 2_500.5)])
def test_a_delay_longer_than_the_unique_ttl_is_covered_by_the_record(
    make_stack: MakeStack, mode: str, delay: float
) -> None:
    """``send_with_options(delay=...)`` longer than ``lock_unique_ttl`` (1 s): refused for the whole delay and
    until the message starts (queued) or is done (until_done); then accepted within 5 s. A delay in whole
    milliseconds as a float with a fraction (what ``seconds * 1000`` gives) is a delay too."""
    stack = make_stack()
    started = threading.Event()

    @stack.actor(lock_key="d:{n}", lock_unique=mode, lock_unique_ttl=1_000)
    def job(n: int) -> None:
        started.set()

    first = job.send_with_options(args=(1,), delay=delay)  # type: ignore[arg-type]  # typed int; brokers take a float
    stack.start()
    refused_until(job, 1, done=started.is_set)
    assert stack.recorder.wait_settled(first.message_id) == "acked"
    freed_within(job, 1)


# Producers racing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "limit"), [("queued", 1), ("until_done", 2)])
def test_producers_racing_never_take_more_records_than_the_limit(make_stack: MakeStack, mode: str, limit: int) -> None:
    """Eight threads send the same key at once (a barrier), over many rounds: exactly ``limit`` sends are
    accepted each round, the key holds that many records, and the broker that many messages."""
    stack = make_stack()

    @stack.actor(lock_key="p:{n}", lock_unique=mode, lock_limit=limit)
    def job(n: int) -> None:
        pass

    records = UniqueRecords(stack.leases)
    producers, rounds = 8, 30
    for r in range(rounds):
        barrier = threading.Barrier(producers)
        results: list[str | None] = []
        lock = threading.Lock()

        def send(
            n: int = r,
            barrier: threading.Barrier = barrier,
            results: list[str | None] = results,
            lock: threading.Lock = lock,
        ) -> None:
            barrier.wait()
            sent = accepted(job, n)
            with lock:
                results.append(sent)

        threads = [threading.Thread(target=send) for _ in range(producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        taken = [s for s in results if s is not None]
        assert len(results) == producers
        assert len(taken) == limit, f"round {r}: {len(taken)} sends accepted for a limit of {limit}"
        assert sorted(x.message_id for x in records.records(f"p:{r}")) == sorted(taken)
    assert stack.broker.client.llen("dramatiq:default") == rounds * limit


def test_a_purged_retry_frees_the_key_its_delay_plus_the_unique_ttl_later(make_stack: MakeStack) -> None:
    """Promise: a message deleted by hand ends its record ``lock_unique_ttl`` past its last sign of life. An
    "until_done" run is kept for its longest hold (10 min with TimeLimit's default); once it failed and its retry
    is in the delay queue, that hold no longer counts: the retry purged, the key frees by its delay plus ttl."""
    stack = make_stack()

    @stack.actor(lock_key="g:{n}", lock_unique="until_done", lock_unique_ttl=1_000, max_retries=1)
    def job(n: int) -> None:
        raise dramatiq.Retry(delay=2_000)

    first = job.send(1)
    stack.start()
    wait_for(lambda: first.message_id in stack.recorder.acked, what="the failed attempt acknowledged")
    acked = time.monotonic()
    assert stack.worker is not None
    stack.worker.stop(timeout=5_000)  # its prefetched retry goes back to the delay queue
    client = stack.broker.client
    client.delete("dramatiq:default.DQ.msgs", "dramatiq:default.DQ")  # the retry, deleted by hand
    stack.worker = None
    freed_within(job, 1, seconds=5.0)
    assert time.monotonic() - acked < 2.0 + 1.0 + 1.5, "the record outlived the purged retry's delay plus ttl"


# Waiting in place ---------------------------------------------------------------------------------------


@pytest.mark.usefixtures("survivable_worker_threads")
@pytest.mark.parametrize("mode", ["queued", "until_done"])
def test_an_interruption_while_waiting_in_place_keeps_the_record(make_stack: MakeStack, mode: str) -> None:
    """A unique message waits in place for its busy key; TimeLimitExceeded is raised into its thread (it lands as
    the wait returns, at the key's release): the message is sent back, still the same unique message, refused
    against until it starts (queued) or is done (until_done), run once, and its key frees within 5 s of the ack."""
    stack = make_stack(threads=4)
    threads: dict[str, int] = {}
    runs: list[str] = []  # the message ids whose body ran to its end

    class Where(Middleware):
        def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
            threads[message.message_id] = threading.get_ident()

        def after_process_message(
            self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: Any = None
        ) -> None:
            if exception is None:
                runs.append(message.message_id)

    stack.broker.middleware.insert(0, Where())

    @stack.actor(lock_key="w:{n}", lock_unique=mode, lock_unique_ttl=1_000)
    def job(n: int) -> None:
        pass

    lease = stack.leases.try_acquire("w:1", 30_000)
    assert not isinstance(lease, Busy) and lease is not None
    first = job.send(1)
    stack.start()
    wait_for(lambda: stack.leases_mw.waiting.in_place == 1, what="the message waiting in place")
    raise_thread_exception(threads[first.message_id], TimeLimitExceeded)  # type: ignore[no-untyped-call]
    held_until = time.monotonic() + 1.5  # longer than lock_unique_ttl
    refused_until(job, 1, done=lambda: time.monotonic() > held_until)
    stack.leases.release(lease)

    def over() -> bool:
        """Queued: the first started (its grant ended the record, before its body runs); else: it was acked."""
        if mode == "queued":
            started = any(h.meta.get("message_id") == first.message_id for h in stack.leases.holders("w:1"))
            return first.message_id in runs or started
        return first.message_id in runs and first.message_id in stack.recorder.acked

    refused_until(job, 1, done=over)  # a send accepted once the first started (queued) may rightly run too
    assert stack.recorder.wait_settled(first.message_id) == "acked"
    assert runs.count(first.message_id) == 1
    assert sum(1 for m, _, _ in stack.recorder.enqueues if m == first.message_id) >= 1, "never sent back"
    if mode == "until_done":
        freed_within(job, 1)


# Worker stops (real processes, both brokers) -------------------------------------------------------------


@pytest.mark.system
def test_a_worker_stop_keeps_the_records_of_a_parked_and_a_waiting_message(workers: LimitWorkers) -> None:
    """Two unique messages of two busy keys in a worker of 2 threads: one waits in place (half the threads), the
    other is parked in the delay queue. The worker is stopped (SIGTERM) and started again: both records hold
    throughout, each message runs once when its key frees, and each key frees within 5 s of its message's ack."""
    records = UniqueRecords(workers.leases)

    def holder(key: str) -> str | None:
        """The message a new send of ``key`` would be refused for, or ``None`` if it would be accepted."""
        found = records.take(key, "probe", mode="until_done", grace=1_000)
        if found is None:
            records.end(key, "probe")
        return found

    for i in (0, 1):
        workers.start(threads=1, holder=i)
    workers.send([call("hold0", "ua", 60.0), call("hold1", "ub", 60.0)])
    workers.wait_runs(2, "holding")
    first = workers.start(threads=2)
    workers.send([call("job", "ua", 1, 0.1, lock_unique="until_done"), call("job", "ub", 2, 0.1, lock_unique="queued")])
    ids = [s["message_id"] for s in workers.sent()[-2:]]
    workers.wait(
        lambda: (
            all(workers.leases.inspect_line(k).length == 1 for k in ("ua", "ub"))
            and any(n >= 2 for m, n in workers.enqueues().items() if m in ids)
        ),
        timeout=20,
        what="one message waiting in place, the other parked",
        about=ids,
    )
    # To the leader only: it passes SIGTERM on, and a worker process that got a second one (a group's) exits at once.
    first.terminate()
    first.wait(30)
    assert [holder("ua"), holder("ub")] == ids, "a record ended at the worker's stop"
    workers.start(threads=2)
    assert [holder("ua"), holder("ub")] == ids
    for key in ("ua", "ub"):
        workers.release(key)
    runs = workers.wait_runs(2, where=lambda r: r["n"] in (1, 2), timeout=40)
    assert sorted(r["message_id"] for r in runs) == sorted(ids)
    for key, mid in zip(("ua", "ub"), ids):
        workers.wait(lambda m=mid: workers.settled([m]), timeout=20, what="the message acknowledged", about=[mid])  # type: ignore[misc]
        settled = time.monotonic()
        workers.wait(lambda k=key: holder(k) is None, timeout=5, what=f"{key} free after the ack", about=[mid])  # type: ignore[misc]
        assert time.monotonic() - settled < 5
    assert len([r for r in workers.runs() if r["n"] in (1, 2)]) == 2, "a message ran twice"


class HeldMoveOn(Middleware):
    """Holds the after-hooks of a delayed copy moving on to its queue (enqueued by Dramatiq's consumer thread, or
    sent on by the middleware's line timer at its eta): added after LeaseMiddleware, its ``after_enqueue`` runs
    first, and the copy runs and is acknowledged meanwhile."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.done = threading.Event()

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        thread = threading.current_thread()
        moving = isinstance(thread, ConsumerThread) or thread.name == "dramatiq-leases-line-timer"
        if moving and not self.done.is_set():
            time.sleep(self.seconds)
            self.done.set()


@pytest.mark.parametrize("mode", ["until_done", "queued"])
@pytest.mark.parametrize("moved_by", ["delay", "rate_limited"])
def test_a_delayed_copy_acknowledged_before_its_move_is_heard_of_frees_the_key(
    make_stack: MakeStack, mode: str, moved_by: str
) -> None:
    """A delayed message leaves its delay queue (a send with ``delay``; a copy held back by RateLimited, sent on
    by the line timer when the hold ends); its copy runs and is acknowledged before the move's after-hooks run
    (another consumer fetched it at once): the final ack ended the record, and the move must not take it again
    (it would refuse the key for lock_unique_ttl, an hour)."""
    stack = make_stack()
    held = HeldMoveOn(1.0)
    stack.broker.add_middleware(held)
    runs: list[int] = []

    @stack.actor(lock_key="m:{n}", lock_unique=mode, max_retries=0)
    def job(n: int) -> None:
        runs.append(n)
        if moved_by == "rate_limited" and len(runs) == 1:
            raise RateLimited(retry_after=300)

    first = job.send_with_options(args=(1,), delay=200 if moved_by == "delay" else None)
    stack.start()
    wait_for(lambda: len(runs) == (1 if moved_by == "delay" else 2), what="the last run")
    assert stack.recorder.wait_settled(first.message_id) == "acked"
    assert not held.done.is_set()  # acknowledged while the move's after-hooks are held
    wait_for(held.done.is_set, what="the move's after-hooks")
    time.sleep(0.3)  # LeaseMiddleware's after_enqueue, which runs next
    assert accepted(job, 1) is not None
