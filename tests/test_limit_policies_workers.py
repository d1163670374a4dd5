"""``lock_on_busy`` behind a running holder, across real worker processes on each broker; and the interrupt storm of
tests/test_interrupts.py on keys held by three at once, under each policy.

The worker tests read what tests/apps/limit_app.py recorded (first deliveries, acks and nacks with their
instants), the worker's log file (the INFO line of each message that does not run) and its lease metrics
endpoint (``dramatiq_lease_not_run_total{reason}``).
"""

from __future__ import annotations

import collections
import gc
import itertools
import logging
import math
import os
import random
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, cast

import dramatiq
import pytest
import redis
from dramatiq import Message
from dramatiq.middleware import Middleware, Shutdown
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.threading import raise_thread_exception
from prometheus_client import CollectorRegistry

from dramatiq_leases import Busy, PrometheusMetrics, current_lease
from dramatiq_leases.core import keys
from dramatiq_leases.core.keys import DEFAULT_PREFIX
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.middleware.options import SENT_BACK_OPTION

from .support.brokers import RABBITMQ_URL, pending, redis_dead_letters
from .support.interrupts import LockFreeHandler
from .support.limit_workers import LimitWorkers, call, most_at_once
from .support.processes import value
from .support.stack import Stack
from .support.waiting import wait_for

#: Dramatiq's INFO line for a message that does not run (dramatiq_leases/middleware/acquiring.py's not_run).
NOT_RUN = "Message %s of actor %r did not run (%s): %s (%s); lease %r is held by %s."
#: And for a copy of one that already ran, or was refused (busy.py).
DUPLICATE = (
    "Message %s is a copy of one that already ran, or was refused by lock_on_busy, under lease %r; not running it."
)


# --- behind a running holder, across worker processes --------------------------------------------------------


def behind_a_holder(
    workers: LimitWorkers, key: str, seconds: float, calls: list[dict[str, Any]]
) -> tuple[str, list[str]]:
    """Start a job holding ``key`` for ``seconds``, then send ``calls`` behind it: the holder's message id and theirs."""
    workers.start(threads=4)
    workers.send([call("job", key, -1, seconds)])
    (holder,) = workers.wait_runs(1, "start")
    workers.send(calls)
    return holder["message_id"], [s["message_id"] for s in workers.sent()[1:]]


def holder_running(workers: LimitWorkers) -> bool:
    """Whether the holder (``n == -1``) has not finished yet."""
    return [r for r in workers.runs() if r["n"] == -1] == []


def last_at(events: list[dict[str, Any]]) -> dict[str, float]:
    """Each message's last event instant."""
    return {e["message_id"]: e["at"] for e in events}


def counted(workers: LimitWorkers, reason: str, expected: int) -> None:
    """Wait until the worker's endpoint counts ``expected`` messages of actor job or policy not run for ``reason``."""

    def count() -> float:
        text = workers.metrics()
        return value(text, "dramatiq_lease_not_run_total", reason=reason) if text else -1

    wait_for(
        lambda: count() == expected, timeout=10, what=f"dramatiq_lease_not_run_total{{reason={reason!r}}} == {expected}"
    )


def logged(workers: LimitWorkers, message_ids: list[str], actor: str, holder: str, reason: str) -> None:
    """Wait until the worker log has, for each of ``message_ids``, the INFO line naming it, ``actor``, the holder's
    message id and ``reason``."""

    def missing() -> list[str]:
        lines = [line for line in workers.log_lines() if "[INFO]" in line and "did not run" in line]
        return [
            m
            for m in message_ids
            if not any(
                m in line and f"actor {actor!r}" in line and holder in line and f"({reason})" in line for line in lines
            )
        ]

    workers.wait(lambda: missing() == [], timeout=10, what=f"the INFO lines ({reason})", about=message_ids)


def test_skip_is_acknowledged_at_once_without_running(workers: LimitWorkers) -> None:
    holder, ids = behind_a_holder(
        workers, "skip", 6.0, [call("job", "skip", i, 0.0, lock_on_busy="skip") for i in range(3)]
    )
    workers.wait(lambda: workers.settled(ids), timeout=10, what="the skipped messages to be acknowledged", about=ids)
    assert holder_running(workers), "the holder ended before the skips were settled: not behind a running holder"
    delivered, acked = workers.delivered(), last_at(workers.acks())
    assert {m: round(acked[m] - delivered[m], 3) for m in ids if acked[m] - delivered[m] > 2.0} == {}
    assert workers.nacks() == []
    assert [r for r in workers.runs("start") if r["n"] >= 0] == [], "a skipped message ran"
    logged(workers, ids, "job", holder, "skipped")
    counted(workers, "skipped", 3)


def test_fail_dead_letters_at_once_without_running_or_a_retry(workers: LimitWorkers) -> None:
    # ``policy`` has Dramatiq's default retries: a busy failure must not spend one.
    holder, ids = behind_a_holder(
        workers, "fail", 6.0, [call("policy", "fail", i, 0.0, lock_on_busy="fail") for i in range(3)]
    )
    workers.wait(lambda: workers.settled(ids), timeout=10, what="the failed messages to be dead-lettered", about=ids)
    assert holder_running(workers), "the holder ended before the fails were settled: not behind a running holder"
    delivered, nacked = workers.delivered(), last_at(workers.nacks())
    assert set(nacked) == set(ids)
    assert {m: round(nacked[m] - delivered[m], 3) for m in ids if nacked[m] - delivered[m] > 2.0} == {}
    workers.wait(lambda: set(workers.dead_letters()) == set(ids), timeout=10, what="the 3 dead letters", about=ids)
    assert [r for r in workers.runs("start") if r["n"] >= 0] == [], "a failed message ran"
    assert {m: workers.enqueues()[m] for m in ids} == dict.fromkeys(ids, 1), "a failed message was retried"
    logged(workers, ids, "policy", holder, "failed")
    counted(workers, "failed", 3)


def test_latest_runs_only_the_newest_right_after_the_holder(workers: LimitWorkers) -> None:
    sends = 30  # every 100 ms for 3 s
    # The holder outlasts the 3 s of sends with room for a loaded machine's slower sender.
    holder, ids = behind_a_holder(
        workers, "latest", 9.0, [call("job", "latest", i, 0.0, lock_on_busy="latest", pause=0.1) for i in range(sends)]
    )
    if not holder_running(workers):
        pytest.fail("the holder ended before the last send: not behind a running holder")
    (held,) = workers.wait_runs(1, where=lambda r: r["n"] == -1, timeout=15)
    workers.wait(lambda: workers.settled(ids), timeout=15, what="every latest message to be settled", about=ids)
    runs = [r for r in workers.runs("start") if r["n"] >= 0]
    assert [r["n"] for r in runs] == [sends - 1], "not exactly one more run, of the newest arguments"
    # Right after: granted from the line at the holder's release (a handoff), not at its lease's expiry, and
    # woken by the release, not by its wait in place running out at the holder's TTL (limit_app's 2 s, renewed:
    # such a wake-up comes at a point spread over it). How soon a woken waiter runs is figure 4's measure
    # (bench/fig4_handoff.py); half the TTL here leaves a loaded machine room.
    assert value(workers.metrics() or "", "dramatiq_lease_handoff_duration_seconds_count", actor_name="job") == 1
    assert runs[0]["start"] - held["end"] < 1.0, (
        f"the newest started {runs[0]['start'] - held['end']:.3f}s after the holder: not woken by its release"
    )
    # Each other one is acknowledged within 10 s of the send that superseded it.
    sent, acked = workers.sent()[1:], last_at(workers.acks())
    late = {
        i: round(acked[ids[i]] - sent[i + 1]["at"], 3)
        for i in range(sends - 1)
        if acked[ids[i]] - sent[i + 1]["at"] > 10
    }
    assert late == {}
    assert workers.nacks() == []
    logged(workers, ids[:-1], "job", holder, "superseded")
    counted(workers, "superseded", sends - 1)


def queued(workers: LimitWorkers) -> int:
    """How many messages wait in the jobs' queue, taken by no consumer yet (a consumer's prefetch has taken them)."""
    if workers.broker == "redis":
        client = redis.Redis.from_url(workers.server.url(0))
        try:
            return int(client.llen(f"dramatiq:{workers.queue}"))
        finally:
            client.close()
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        return int(connection.channel().queue_declare(workers.queue, passive=True).method.message_count)
    finally:
        connection.close()


def superseded_by(workers: LimitWorkers, message_id: str, newer: str) -> None:
    """Wait until the worker log has the INFO line of ``message_id`` not run (superseded), naming ``newer``."""

    def found() -> bool:
        return any(
            "[INFO]" in line and message_id in line and "(superseded)" in line and f"message {newer}" in line
            for line in workers.log_lines()
        )

    workers.wait(found, timeout=10, what=f"the superseded line of {message_id} naming {newer}", about=[message_id])


def revisions_run(workers: LimitWorkers, kind: str = "run") -> list[int]:
    """The revisions (actor ``revision``) that ran (``kind`` "run") or started, by start."""
    return [r["n"] for r in sorted(workers.runs(kind), key=lambda r: r["start"]) if r["key"] == "doc"]


def test_latest_keeps_the_revision_sent_last_not_the_one_a_prefetch_holds_back(workers: LimitWorkers) -> None:
    """Revisions 0, 1, 2 of one document, sent in that order: worker A (one thread) runs 0 and its prefetch holds 1
    behind it; worker B takes 2, which waits behind 0. When 0 ends, 1 reaches the lease after 2: it is acknowledged
    without running (superseded by 2, named in its line), and 2 runs last."""
    workers.start(threads=1)  # prefetch 2: the running message and the next
    workers.send([call("revision", "doc", 0, 60.0)])
    workers.wait_runs(1, "start")
    workers.send([call("revision", "doc", 1, 0.0)])
    workers.wait(lambda: queued(workers) == 0, timeout=10, what="A's prefetch to take revision 1")
    workers.start(threads=2)
    workers.send([call("revision", "doc", 2, 0.0)])
    ids = [s["message_id"] for s in workers.sent()]
    workers.wait(
        lambda: workers.leases.inspect_line("doc").head == f"{ids[2]}:0", timeout=30, what="revision 2 to wait"
    )
    assert revisions_run(workers) == [], "revision 0 ended before 2 was waiting: the test proved nothing"
    workers.release("doc")
    workers.wait(lambda: workers.settled(ids), timeout=20, what="every revision to be settled", about=ids)
    assert revisions_run(workers, "start") == [0, 2], "a revision sent before the last ran after it"
    assert workers.nacks() == []
    superseded_by(workers, ids[1], ids[2])
    counted(workers, "superseded", 1)


def test_latest_redelivery_of_a_killed_revision_does_not_run_after_a_newer_one(workers: LimitWorkers) -> None:
    """Revision 1 runs on worker A, revision 2 waits behind it on worker B; A is SIGKILLed. 2 runs once 1's lease
    has expired, and the broker's redelivery of 1 never runs again: it supersedes itself (traced), however it meets
    the key (held by its own dead lease, by 2, or free)."""
    a = workers.start(threads=1, env={"dramatiq_queue_prefetch": "1"})  # A takes nothing but revision 1
    workers.send([call("revision", "doc", 1, 60.0)])
    workers.wait_runs(1, "start")
    workers.start(threads=2)
    workers.send([call("revision", "doc", 2, 0.5)])
    ids = [s["message_id"] for s in workers.sent()]
    workers.wait(
        lambda: workers.leases.inspect_line("doc").head == f"{ids[1]}:0", timeout=30, what="revision 2 to wait"
    )
    os.killpg(a.pid, signal.SIGKILL)
    a.wait()
    workers.wait(lambda: revisions_run(workers) == [2], timeout=20, what="revision 2 to run", about=ids)

    def redelivered() -> bool:
        """Revision 1's last copy acknowledged (the broker's redelivery, and any copy sent back), or run again."""
        return workers.settled(ids[:1]) or revisions_run(workers, "start").count(1) > 1

    workers.wait(redelivered, timeout=30, what="the redelivery of revision 1 to be settled", about=ids)
    assert revisions_run(workers, "start") == [1, 2], "the killed revision ran again, after a newer one"
    workers.wait(lambda: workers.settled(ids), timeout=20, what="every revision to be settled", about=ids)
    superseded_by(workers, ids[0], ids[1])
    counted(workers, "superseded", 1)


# --- the interrupt storm, on keys held by three at once -------------------------------------------------------


class Storm(Middleware):
    """Like TimeLimit and the worker's Shutdown: a thread raises ``TimeLimitExceeded`` and ``Shutdown`` into each
    delivery's worker thread, each at most once per delivery (with probability ``chance``), at random instants
    over its life.

    ``chance`` is kept low enough that most deliveries complete: an interrupted delivery is sent back, an
    interrupted send-back is sent again, and each copy is a delivery of its own, so too strong a storm breeds
    copies faster than they settle (no real source fires at every delivery).
    """

    def __init__(self, window: float, chance: float, seed: int) -> None:
        self.window = window
        self.chance = chance
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.slots: dict[int, list[float]] = {}  # thread id -> [time_limit_at, shutdown_at]
        self.delivering: dict[int, str] = {}  # thread id -> the message id of its delivery
        self.fired = {"time_limit": 0, "shutdown": 0}
        self.fired_at: list[tuple[str, str, float]] = []  # (message id, what, when) of each interruption
        self.finished: list[tuple[str, int, float]] = []  # (message id, thread id, when) of each delivery's end
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _instant(self) -> float:
        return (
            time.monotonic() + self.random.uniform(0, self.window)
            if self.random.random() < self.chance
            else float("inf")
        )

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        with self.lock:
            self.slots[threading.get_ident()] = [self._instant(), self._instant()]
            self.delivering[threading.get_ident()] = message.message_id

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        with self.lock:
            self.slots.pop(threading.get_ident(), None)
        # Its hooks run last (it is first in the list): the delivery's lease, if any, is released by now.
        self.finished.append((message.message_id, threading.get_ident(), time.time()))

    after_skip_message = after_process_message

    def _run(self) -> None:
        while self.running:
            now = time.monotonic()
            frames = current_frames()
            with self.lock:
                for thread_id, slot in self.slots.items():
                    if in_pool(frames.get(thread_id)):
                        continue  # postponed: see in_pool
                    for i, (name, error) in enumerate((("time_limit", TimeLimitExceeded), ("shutdown", Shutdown))):
                        if slot[i] <= now:
                            slot[i] = float("inf")
                            self.fired[name] += 1
                            self.fired_at.append((self.delivering.get(thread_id, "?"), name, time.time()))
                            raise_thread_exception(thread_id, error)  # type: ignore[no-untyped-call]
            time.sleep(0.0002)


def current_frames() -> dict[int, Any]:
    """``sys._current_frames()``, with the cyclic garbage collector off meanwhile.

    CPython 3.11 builds those frames holding its lock of the thread states; a collection started by one of them
    that frees a ``threading.local`` takes that lock again, and the process hangs (seen here: every thread
    waiting for the GIL, the collecting one for the lock).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def in_pool(frame: Any) -> bool:
    """Whether a thread stands in a method of redis-py's connection pools.

    An exception landing there breaks the pool's own bookkeeping (a connection neither free nor in use: "pop
    from empty list", then "Too many connections"), for the broker's client as much as ours; that is redis-py's
    hazard, not this package's. The storm waits for the thread to leave (it holds the GIL while it looks, so
    the thread is where it was seen when the exception is set). A chain that is not all frames (the GIL passed
    to that thread mid-walk, and CPython 3.11 let the walk read a frame it had left: seen here, an ``int``) is
    taken as in a pool: the storm looks again next round.
    """
    while frame is not None:
        if not isinstance(frame, types.FrameType):
            return True
        code: Any = frame.f_code  # co_qualname: Python 3.11+, as this file's storm
        if code.co_qualname.split(".")[0].endswith("ConnectionPool"):
            return True
        frame = frame.f_back
    return False


def not_run_traces(handler: LockFreeHandler) -> dict[str, set[str]]:
    """The message ids of each reason a message did not run, from the log records."""
    traces: dict[str, set[str]] = collections.defaultdict(set)
    for record in handler.records:
        if record.msg == NOT_RUN and isinstance(record.args, tuple):
            traces[str(record.args[2])].add(str(record.args[0]))
        elif record.msg == DUPLICATE and isinstance(record.args, tuple):
            traces["duplicate"].add(str(record.args[0]))
    return traces


@dataclass
class StormRun:
    """What one storm did: the messages sent, the ``i`` of each actor entry, each key's run spans, the log."""

    stack: Stack
    handler: LockFreeHandler
    storm: Storm
    messages: list[Any] = field(default_factory=list)
    entered: list[int] = field(default_factory=list)
    #: (i, when, when its lease was granted, thread) of each actor entry
    entries: list[tuple[int, float, float, int]] = field(default_factory=list)
    ends: dict[tuple[int, float], float] = field(default_factory=dict)  # (i, when it entered) -> when it left
    spans: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: collections.defaultdict(list))

    def at_once(self, i: int) -> bool:
        """Whether two runs of message ``i`` held their leases at once: the later was granted before the delivery
        of the earlier ended, its lease released (a delivery not seen to end counts as never ending)."""
        message_id = self.messages[i].message_id

        def ended(thread: int, entered: float) -> float:
            ends = [at for m, t, at in self.storm.finished if m == message_id and t == thread and at >= entered]
            return min(ends, default=math.inf)

        runs = sorted((at, granted, thread) for j, at, granted, thread in self.entries if j == i)
        return any(b[1] < ended(a[2], a[0]) for a, b in itertools.pairwise(runs))

    def history(self, i: int) -> str:
        """What the broker, the actor and the log say of message ``i``, in order, for a failure message."""
        message_id = self.messages[i].message_id
        recorder = self.stack.recorder
        acks = sum(m == message_id for m in recorder.acked)
        nacks = sum(m == message_id for m in recorder.nacked)
        sends = [f"delay={d} {o}" for m, d, o in recorder.enqueues if m == message_id]
        events = [(at, f"actor entered in {t}") for j, at, _, t in self.entries if j == i]
        events += [(granted, "lease granted") for j, _, granted, _ in self.entries if j == i]
        events += [(at, f"delivery ended in {t}") for m, t, at in self.storm.finished if m == message_id]
        events += [(at, f"storm raised {what}") for m, what, at in self.storm.fired_at if m == message_id]
        events += [(end, "actor left") for (j, _), end in self.ends.items() if j == i]
        events += [
            (r.created, f"{r.levelname} {r.threadName} {r.name}: {r.getMessage()}{naming(r, message_id)}")
            for r in self.handler.records
            if message_id in r.getMessage()
        ]
        return "\n".join(
            [f"message {i} ({message_id}): {acks} acks, {nacks} nacks, {len(sends)} enqueues:", *sends]
            + [f"{at:.4f} {what}" for at, what in sorted(events)]
        )


def storm(policy: str, redis_server: EmbeddedRedis, handler: LockFreeHandler) -> StormRun:
    """Send batches of messages on 2 keys of limit 3, under 8 threads and the storm, until 600 interruptions have
    fired; return once the broker holds none of them (each ran, or was acknowledged or dead-lettered for good)."""
    # No endpoint of its own: it would switch this process's metric values to a shared directory.
    stack = Stack(
        redis_server.url(0),
        redis_server.url(1),
        threads=8,
        lock_min_backoff=1,
        lock_max_backoff=5,
        metrics_endpoint=False,
    )
    interrupts = Storm(window=0.006, chance=0.3, seed=21)
    run = StormRun(stack, handler, interrupts)
    stack.broker.middleware.insert(0, interrupts)  # first, like TimeLimit: its window spans every other hook

    @stack.actor(lock_key="storm:{key}", lock_ttl=1_000, max_retries=0, lock_limit=3, lock_on_busy=policy)
    def work(i: int, key: int, spins: int) -> None:
        start = time.time()
        try:
            run.entered.append(i)
            run.entries.append((i, start, current_lease().acquired_at, threading.get_ident()))
            for _ in range(spins):
                pass
        finally:
            end = time.time()  # within the lease: recorded spans never overcount
            run.spans[key].append((start, end))
            run.ends[(i, start)] = end

    interrupts.thread.start()
    try:
        stack.start()
        rng = random.Random(2)
        deadline = time.monotonic() + 90
        while sum(interrupts.fired.values()) < 600 and time.monotonic() < deadline:
            base = len(run.messages)
            run.messages += [work.send(i, i % 2, rng.randrange(0, 20_000)) for i in range(base, base + 400)]
            # Not each message's acks against its enqueues: an interruption may land in the recorder's own hook.
            drained(run, redis_server, timeout=30)
    finally:
        interrupts.running = False
    assert sum(interrupts.fired.values()) >= 600, (
        f"the storm was too weak to prove anything in 90 s: {interrupts.fired}"
    )
    print(f"policy {policy}: interrupts {interrupts.fired}, {len(run.messages)} messages")
    return run


def drained(run: StormRun, server: EmbeddedRedis, timeout: float) -> None:
    """Wait until the broker holds no message; else fail with what the keys and the first message left say."""
    deadline = time.monotonic() + timeout
    while pending(server) > 0:
        if time.monotonic() > deadline:
            broker = redis.Redis.from_url(server.url(0))
            leases = redis.Redis.from_url(server.url(1), decode_responses=True)
            try:
                # What pending() counts: queued, delayed or being processed. A client without decode_responses
                # answers bytes, which redis-py's return type does not narrow to.
                held = [*broker.hvals("dramatiq:default.msgs"), *broker.hvals("dramatiq:default.DQ.msgs")]
                left = {Message.decode(cast(bytes, data)).message_id for data in held}
                state = []
                for key in ("storm:0", "storm:1"):
                    holders = [(h.fence, h.meta.get("message_id")) for h in run.stack.leases.holders(key)]
                    line = keys.line_name(DEFAULT_PREFIX, key)
                    state.append(
                        f"{key}: holders {holders}; line {leases.zrange(line, 0, -1, withscores=True)}; "
                        f"waiters {leases.hgetall(line.replace(':line:', ':waiters:', 1))}"
                    )
            finally:
                broker.close()
                leases.close()
            stuck = [i for i, m in enumerate(run.messages) if m.message_id in left]
            pytest.fail(
                f"the broker still holds {len(left)} messages after {timeout}s\n"
                + "\n".join(state)
                + f"\n{first_of(stuck, run)}"
            )
        time.sleep(0.05)


def naming(record: logging.LogRecord, message_id: str) -> str:
    """A mark on a log line that names ``message_id`` as another message's newer one, not as its subject."""
    args = record.args if isinstance(record.args, tuple) else ()
    return "" if not args or str(args[0]) == message_id else " [names it, not about it]"


def first_of(indexes: list[int], run: StormRun) -> str:
    """How many of ``indexes`` there are, and the history of the first."""
    return f"{len(indexes)} of them, the first:\n{run.history(indexes[0])}" if indexes else ""


@pytest.mark.usefixtures("survivable_worker_threads")
@pytest.mark.parametrize("policy", ["wait", "skip", "fail", "latest"])
def test_an_interrupt_storm_keeps_three_at_once_and_loses_nothing(
    policy: str, redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TimeLimitExceeded and Shutdown raised into worker threads at random instants, on 2 keys of limit 3 under 8
    threads: never more than 3 run one key at once, no message runs twice, and each either runs or leaves its
    trace: dead-lettered, or acknowledged with an INFO line saying why; a message said not to run does not."""
    # As in tests/test_interrupts.py: records go to a lock-free list (an interruption can strand a handler's lock).
    handler = LockFreeHandler()
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    ours = logging.getLogger("dramatiq_leases")
    monkeypatch.setattr(ours, "level", logging.INFO)  # the INFO line of each message that does not run
    ours.manager._clear_cache()  # type: ignore[attr-defined]  # levels are cached per logger
    run = storm(policy, redis_server, handler)
    try:
        for key, spans in run.spans.items():
            assert most_at_once(spans) <= 3, f"more than 3 ran key {key} at once"
        traces = not_run_traces(handler)
        dead = {m.message_id for m in redis_dead_letters(redis_server)}
        ran = set(run.entered)
        ids = [m.message_id for m in run.messages]
        # Two defects the storm once showed (the tests of copies below) are told apart: two copies of one message
        # holding a key of several holders at once, and a copy said not to run while its sibling runs.
        twice = [i for i, n in collections.Counter(run.entered).items() if n > 1]
        at_once = [i for i in twice if run.at_once(i)]
        assert [i for i in twice if i not in at_once] == [], f"messages ran twice: {first_of(twice, run)}"
        lost = [
            i for i, m in enumerate(ids) if i not in ran and m not in dead and not any(m in t for t in traces.values())
        ]
        assert lost == [], f"messages neither ran, nor were dead-lettered, nor left a trace: {first_of(lost, run)}"
        said = {
            r: [i for i, m in enumerate(ids) if m in traces[r] and i in ran]
            for r in ("skipped", "failed", "superseded")
        }
        alive = [i for i, m in enumerate(ids) if m in traces["failed"] and m not in dead]
        assert alive == [], f"messages traced failed are not in the dead-letter queue: {first_of(alive, run)}"
        expected = {"wait": None, "skip": "skipped", "fail": "failed", "latest": "superseded"}[policy]
        assert expected is None or traces[expected], f"the storm never found a key full: no message {expected}"
        others = {r: len(traces[r]) for r in {"skipped", "failed", "superseded"} - {expected} if traces[r]}
        assert others == {}, f"lock_on_busy={policy!r}, yet messages were {others}"
        # Nothing is left held or renewed.
        wait_for(lambda: run.stack.leases_mw.heartbeat.tracked() == [], what="every lease to be untracked", timeout=5)
        wait_for(lambda: list(run.stack.leases.scan()) == [], what="every lease to be gone from Redis", timeout=5)
    finally:
        run.stack.stop()
    assert at_once == [], f"copies ran at once: {first_of(at_once, run)}"
    assert not any(said.values()), ", ".join(f"traced {r} yet ran: {len(v)}" for r, v in said.items() if v)


# --- two copies of one message, as a send-back that was interrupted leaves ---------------------------------------


# The defects the storm showed (fixed: each grant names its waiter; a copy finding it among the holders asks
# again later), each made certain here with two copies of one message in the broker at once (an
# interrupted send-back sends its copy again, busy.py's _send_copy_back: "a second copy never runs, its run is
# remembered by its waiter id"; a timed-out enqueue tried again does the same).
@pytest.mark.parametrize(
    ("limit", "policy"),
    [
        (1, "wait"),
        (1, "latest"),
        (3, "wait"),
        (3, "latest"),
        (1, "skip"),
        (1, "fail"),
    ],
)
def test_two_copies_of_a_message_run_once_and_leave_no_trace_of_not_running(
    limit: int, policy: str, redis_server: EmbeddedRedis
) -> None:
    """Two copies of one message never hold two slots of a key at once, and a copy behind its own sibling's run
    is never counted skipped or failed (nor dead-lettered): it asks again later, and is dropped once it ran."""
    registry = CollectorRegistry()
    stack = Stack(
        redis_server.url(0),
        redis_server.url(1),
        threads=4,
        metrics_endpoint=False,
        metrics=PrometheusMetrics(registry=registry),
    )
    runs: list[float] = []

    # A short TTL: a copy that meets its sibling holding is sent back to ask later, not woken by the release.
    @stack.actor(lock_key="copies", lock_ttl=1_000, lock_limit=limit, lock_on_busy=policy, max_retries=0)
    def work(n: int) -> None:
        runs.append(time.time())
        time.sleep(0.5)  # its sibling copy is delivered meanwhile

    stack.start()
    try:
        copy = work.message(1).copy(options={SENT_BACK_OPTION: True})
        stack.broker.enqueue(copy)
        stack.broker.enqueue(copy)
        wait_for(lambda: runs and pending(redis_server) == 0, timeout=10, what="both copies to leave the broker")
    finally:
        stack.stop()
    assert (len(runs), not_run(registry), redis_dead_letters(redis_server)) == (1, {"skipped": 0, "failed": 0}, [])


def not_run(registry: CollectorRegistry) -> dict[str, float]:
    """``dramatiq_lease_not_run_total`` of actor ``work``, for the reasons skipped and failed."""
    labels = {"actor_name": "work", "queue_name": "default"}
    return {
        reason: registry.get_sample_value("dramatiq_lease_not_run_total", {**labels, "reason": reason}) or 0
        for reason in ("skipped", "failed")
    }


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_a_copy_said_not_to_run_never_runs_after_all(policy: str, redis_server: EmbeddedRedis) -> None:
    """One copy of a message meets its key held by another message and is skipped (or failed); a sibling copy of it
    (an interrupted send-back sent twice) comes once the key is free. The message either ran, or has its trace of
    not running: not both."""
    registry = CollectorRegistry()
    stack = Stack(
        redis_server.url(0),
        redis_server.url(1),
        threads=2,
        metrics_endpoint=False,
        metrics=PrometheusMetrics(registry=registry),
    )
    runs: list[int] = []

    @stack.actor(lock_key="full", lock_ttl=1_000, lock_on_busy=policy, max_retries=0)
    def work(n: int) -> None:
        runs.append(n)

    stack.start()
    try:
        other = stack.leases.try_acquire("full", ttl=10_000)
        assert not isinstance(other, Busy)
        copy = work.message(1).copy(options={SENT_BACK_OPTION: True})
        stack.broker.enqueue(copy)
        wait_for(lambda: sum(not_run(registry).values()) == 1, timeout=10, what="the first copy not to run")
        assert stack.leases.release(other)
        stack.broker.enqueue(copy)
        wait_for(lambda: pending(redis_server) == 0, timeout=10, what="the second copy to leave the broker")
    finally:
        stack.stop()
    said = bool(sum(not_run(registry).values()) or redis_dead_letters(redis_server))
    assert not (runs and said), f"ran {len(runs)} times, and counted {not_run(registry)}"
