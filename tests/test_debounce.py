"""``lock_debounce`` and ``lock_debounce_max``: one run per burst of sends, with the newest arguments
(``core/debounce.py``, ``lua/debounce.lua``, ``middleware/debouncing.py``). Real Redis; real Dramatiq workers on
both brokers.

Send times come from the record the sends wrote and run times from the fences (the Redis server's clock in µs),
so the checks are on the clock the scripts decided with, whatever this machine's speed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from dramatiq_leases import LeaseOptionError, PrometheusMetrics, RateLimited, current_lease
from dramatiq_leases.core import Leases
from dramatiq_leases.core.debounce import STAMP_SKEW_MS, Debounces, Pick, Verdict, genuine

from .support.interrupts import InterruptAfterEnqueue
from .support.runs import Runs
from .support.stack import MakeStack
from .support.waiting import wait_for


def pick(records: Debounces, seq: int, message_id: str, **options: Any) -> Pick:
    """A delivery's verdict, the key's quiet window 100 ms (what a sequence the record never saw is registered with)."""
    return records.pick("k", seq, message_id, 100, None, **options)


# --- the record --------------------------------------------------------------------------------------------------


def test_the_newest_send_of_a_burst_runs_once_it_is_due(redis_client: redis.Redis) -> None:
    """Each send within the quiet window of the last extends the burst; the older give way to the newest in the
    broker; the newest runs once due, and once picked it stays picked (a copy, a retry)."""
    records = Debounces(Leases(redis_client, prefix="t").runner, "t")
    a = records.send("k", "a", 300, None)
    records.confirm("k", a.seq, "a")
    b = records.send("k", "b", 300, None)
    assert b.seq > a.seq and 250 < b.due_in_ms <= 300
    early = pick(records, b.seq, "b")
    assert early.verdict is Verdict.WAIT and 0 < early.wait_ms <= 300
    # b not confirmed yet (its producer is between the send and the broker): a waits for it, a while.
    assert pick(records, a.seq, "a").verdict is Verdict.WAIT
    records.confirm("k", b.seq, "b")
    assert pick(records, a.seq, "a") == pick(records, a.seq, "a")
    assert pick(records, a.seq, "a").verdict is Verdict.DEBOUNCED and pick(records, a.seq, "a").by == "b"
    time.sleep(early.wait_ms / 1000 + 0.01)
    assert pick(records, b.seq, "b").verdict is Verdict.RUN
    assert pick(records, b.seq, "b").verdict is Verdict.RUN  # a copy of it
    assert pick(records, a.seq, "a").by == "b"  # never older than the last run
    c = records.send("k", "c", 300, None)  # after the pick: the next burst
    assert 250 < c.due_in_ms <= 300


def test_the_cap_bounds_a_burst_from_its_first_send(redis_client: redis.Redis) -> None:
    """Sends that never leave a quiet window still run by the cap: the burst is due at its first send plus the
    cap, stored with the burst (no key that expires on its own)."""
    records = Debounces(Leases(redis_client, prefix="t").runner, "t")
    first = records.send("k", "m0", 200, 500)
    started = time.monotonic()
    last = first
    n = 0
    while time.monotonic() - started < 0.45:
        n += 1
        last = records.send("k", f"m{n}", 200, 500)
        records.confirm("k", last.seq, f"m{n}")
        time.sleep(0.05)
    assert last.due_in_ms <= 500 - 400  # the cap, not the quiet window, sets the due instant now
    assert redis_client.hget("t:debounce:{k}", "first") is not None and redis_client.pttl("t:debounce:{k}") > 0


def test_a_burst_whose_newest_comes_after_the_next_burst_began_still_runs(redis_client: redis.Redis) -> None:
    """The cap cut a stream, or a backlog held the newest back: the ended burst's newest runs when it comes, its
    older messages give way to it, and the next burst runs after it with newer arguments."""
    records = Debounces(Leases(redis_client, prefix="t").runner, "t")
    old = records.send("k", "old", 100, None)
    records.confirm("k", old.seq, "old")
    a = records.send("k", "a", 100, None)
    records.confirm("k", a.seq, "a")
    time.sleep(0.12)
    b = records.send("k", "b", 100, None)  # after a's burst was due, before a came: the next burst
    records.confirm("k", b.seq, "b")
    assert pick(records, old.seq, "old").by == "a"
    assert pick(records, a.seq, "a").verdict is Verdict.RUN
    time.sleep(0.12)
    assert pick(records, b.seq, "b").verdict is Verdict.RUN
    assert pick(records, a.seq, "a").verdict is Verdict.DEBOUNCED  # never after a newer run


def test_a_newer_send_never_confirmed_holds_an_older_one_back_for_a_while_only(redis_client: redis.Redis) -> None:
    """Its producer failed after the send: the older message runs in its stead once confirm_ms has passed."""
    records = Debounces(Leases(redis_client, prefix="t").runner, "t")
    a = records.send("k", "a", 50, None)
    records.confirm("k", a.seq, "a")
    records.send("k", "ghost", 50, None)
    assert pick(records, a.seq, "a", confirm_ms=300).verdict is Verdict.WAIT
    wait_for(
        lambda: pick(records, a.seq, "a", confirm_ms=300).verdict is Verdict.RUN,
        timeout=10,
        what="the older message to run in the unconfirmed one's stead",
    )


def test_a_record_the_store_lost_keeps_the_send_order_of_what_it_forgot(redis_client: redis.Redis) -> None:
    """The store lost the record (a restart without persistence): each genuine sequence is registered at itself
    when delivered, so the newest of the forgotten sends runs, whichever is delivered first."""
    records = Debounces(Leases(redis_client, prefix="t").runner, "t")
    old = records.send("k", "old", 100, None)
    new = records.send("k", "new", 100, None)
    redis_client.delete("t:debounce:{k}")
    assert pick(records, new.seq, "new").verdict is Verdict.WAIT  # registered at its own sequence
    assert pick(records, old.seq, "old").by == "new"  # older than one in the broker
    time.sleep(0.12)
    assert pick(records, new.seq, "new").verdict is Verdict.RUN
    redis_client.delete("t:debounce:{k}")
    again = records.send("k", "later", 100, None)  # a record made again by a send: older sequences are older
    assert pick(records, new.seq, "new").verdict is Verdict.WAIT  # a newer send on its way to the broker
    records.confirm("k", again.seq, "later")
    assert pick(records, new.seq, "new").by == "later"


def test_only_a_sequence_near_its_send_time_is_taken_for_one() -> None:
    """A sequence is a message option, input from whoever writes to the broker: taken only if it can be a send's."""
    sent_ms = 1_796_000_000_000
    assert genuine(sent_ms * 1000 + 7, sent_ms)
    assert not genuine(1, sent_ms)
    assert not genuine((sent_ms + STAMP_SKEW_MS + 1) * 1000, sent_ms)
    assert not genuine("1796000000000000", sent_ms) and not genuine(True, sent_ms) and not genuine(2**60, sent_ms)


# --- declaration ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"lock_debounce": -1}, "lock_debounce"),
        ({"lock_debounce": 0}, "lock_debounce"),
        ({"lock_debounce": 1.5}, "lock_debounce"),
        ({"lock_debounce": 1000.0}, "lock_debounce"),
        ({"lock_debounce": True}, "lock_debounce"),
        ({"lock_debounce": "1s"}, "lock_debounce"),
        ({"lock_debounce": 1000, "lock_debounce_max": 999}, "lock_debounce_max"),
        ({"lock_debounce": 1000, "lock_debounce_max": -5}, "lock_debounce_max"),
        ({"lock_debounce_max": 5000}, "lock_debounce_max"),
        ({"lock_debounce": 1000, "lock_unique": "queued"}, "lock_unique"),
    ],
)
def test_bad_debounces_are_refused_at_declaration(make_stack: MakeStack, options: dict[str, Any], named: str) -> None:
    stack = make_stack(metrics=PrometheusMetrics(registry=CollectorRegistry()), metrics_endpoint=False)
    with pytest.raises(LeaseOptionError) as info:

        @stack.actor(actor_name="sync_record", lock_key="record:{rid}", **options)
        def sync_record(rid: int) -> None:
            pass

    assert "actor 'sync_record'" in str(info.value) and named in str(info.value), info.value


# --- in workers ----------------------------------------------------------------------------------------------------


def test_a_burst_runs_once_with_its_newest_arguments_after_the_quiet_window(make_broker_stack: MakeStack) -> None:
    """Ten edits in a row: one run, of the last, starting once the key had no send for the quiet window (not
    before it, and within a second of it); the nine others acknowledged, counted and logged."""
    stack = make_broker_stack()
    runs = Runs()

    @stack.actor(lock_key="record:{rid}", lock_debounce=1_500, max_retries=0)
    def sync_record(rid: int, revision: int) -> None:
        runs.add(revision=revision, fence=current_lease().fence)

    stack.start()
    messages = []
    # 50 ms apart against a quiet window of 1.5 s: one burst even when a loaded machine stalls a send.
    for revision in range(10):
        messages.append(sync_record.send(7, revision))
        time.sleep(0.05)
    last_sent = int(stack.leases.client.hget("dramatiq-leases:debounce:{record:7}", "newest_at") or 0)
    for message in messages:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    [run] = runs.items
    assert run["revision"] == 9
    started_ms = int(run["fence"]) // 1000
    assert last_sent + 1_500 <= started_ms
    assert started_ms - (last_sent + 1_500) < 1_000, started_ms - (last_sent + 1_500)
    assert stack.not_run("sync_record", "debounced") == 9
    # Each names a message sent after it: the newest of the burst when it was delivered.
    order = {m.message_id: n for n, m in enumerate(messages)}
    events = [e for e in stack.leases.history("record:7") if e.event == "debounced"]
    assert len(events) == 9 and all(order[e.by] > order[e.message_id] for e in events)


def test_the_cap_runs_a_burst_that_never_pauses(make_broker_stack: MakeStack) -> None:
    """Sends every 100 ms for 2 s with a quiet window of 300 ms and a cap of 800 ms: a run at least every
    800 ms of sends (the cap), each with the newest arguments sent before it, and never one going backwards."""
    stack = make_broker_stack()
    runs = Runs()

    @stack.actor(lock_key="record:{rid}", lock_debounce=300, lock_debounce_max=800, max_retries=0)
    def sync_record(rid: int, revision: int) -> None:
        runs.add(revision=revision, fence=current_lease().fence)

    stack.start()
    messages = []
    started = time.monotonic()
    revision = 0
    while time.monotonic() - started < 2.0:
        messages.append(sync_record.send(7, revision))
        revision += 1
        time.sleep(0.1)
    for message in messages:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    done = sorted(runs.items, key=lambda r: int(r["fence"]))
    revisions = [r["revision"] for r in done]
    assert revisions == sorted(revisions) and revisions[-1] == revision - 1  # never backwards; the last one runs
    assert 2 <= len(done) <= 5, revisions  # the cap ran the stream about every 800 ms, not once at its end
    assert stack.not_run("sync_record", "debounced") == len(messages) - len(done)


def test_a_send_during_the_run_starts_the_next_burst(make_broker_stack: MakeStack) -> None:
    """The burst's run is running; a send now is the next burst's, which runs after it, with its arguments."""
    stack = make_broker_stack()
    runs = Runs()
    running = threading.Event()
    release = threading.Event()

    @stack.actor(lock_key="record:{rid}", lock_debounce=1_000, max_retries=0)
    def sync_record(rid: int, revision: int) -> None:
        runs.add(revision=revision)
        if revision == 1:
            running.set()
            assert release.wait(20)

    stack.start()
    first = [sync_record.send(7, 0), sync_record.send(7, 1)]
    assert running.wait(20)
    second = [sync_record.send(7, 2), sync_record.send(7, 3)]
    release.set()
    for message in first + second:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    assert [r["revision"] for r in runs.items] == [1, 3]


def test_a_debounced_run_still_waits_for_its_rate_and_its_limit(make_broker_stack: MakeStack) -> None:
    """Debounce picks the run; lock_rate and lock_limit then hold for it as for any message: a key's two bursts
    under a rate of 1/3s start at least 3 s apart (the quiet window alone would part them by about 1.3 s)."""
    stack = make_broker_stack()
    runs = Runs()

    @stack.actor(lock_key="tenant:{tenant}", lock_debounce=1_000, lock_rate="1/3s", max_retries=0)
    def sync_tenant(tenant: str, revision: int) -> None:
        runs.add(revision=revision, fence=current_lease().fence)

    stack.start()
    messages = [sync_tenant.send("acme", n) for n in range(3)]
    for message in messages:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    wait_for(lambda: runs.count() == 1, timeout=10, what="the first burst's run")
    time.sleep(0.3)  # a second burst, after the first one ran
    messages = [sync_tenant.send("acme", n) for n in range(3, 6)]
    for message in messages:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    fences = [int(r["fence"]) for r in runs.items]
    assert [r["revision"] for r in runs.items] == [2, 5]
    assert fences[1] - fences[0] >= 3_000_000  # the rate held for the debounced run


def test_a_message_without_a_sequence_of_ours_is_registered_at_its_delivery(make_broker_stack: MakeStack) -> None:
    """A sequence is input from whoever writes to the broker: one that is none of ours (made up, or from a producer
    without the middleware) is registered when delivered, as a send then; the burst still runs once."""
    stack = make_broker_stack()
    runs = Runs()

    @stack.actor(lock_key="record:{rid}", lock_debounce=1_000, max_retries=0)
    def sync_record(rid: int, revision: int) -> None:
        runs.add(revision=revision)

    stack.start()
    messages = [
        sync_record.send_with_options(args=(7, 0), lease_debounce="bogus"),
        sync_record.send_with_options(args=(7, 1), lease_debounce=2**60),
    ]
    for message in messages:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    assert runs.count() == 1


def test_a_held_back_message_debounced_on_its_return_does_not_block_the_newer_run(make_broker_stack: MakeStack) -> None:
    """RateLimited with lock_debounce: burst 1's run raises it; burst 2, sent during the hold, is picked and waits
    behind the held-back message. Back at the hold's end, that one gives way to burst 2 (debounced) and leaves the
    line at once: burst 2 runs then, not once the held-back place lapses (10 s later)."""
    stack = make_broker_stack()
    runs = Runs()

    @stack.actor(lock_key="record:{rid}", lock_debounce=200, max_retries=0)
    def sync_record(rid: int, revision: int) -> None:
        runs.add(revision=revision, fence=current_lease().fence)
        if revision == 0:
            raise RateLimited(retry_after=1_500)

    stack.start()
    sync_record.send(7, 0)
    wait_for(lambda: runs.count() == 1, timeout=20, what="burst 1's run")
    sync_record.send(7, 1)  # burst 2, due 200 ms later, well within the hold
    wait_for(lambda: runs.count(revision=1) == 1, timeout=30, what="burst 2's run")
    [held] = [e for e in stack.leases.history("record:7") if e.event == "rate_limited"]
    started_ms = int(runs.where(revision=1)[0]["fence"]) // 1000
    late = started_ms - (held.time_ms + 1_500)
    assert late < 5_000, f"burst 2's run started {late} ms after the hold ended"


def test_a_store_that_forgot_the_record_still_runs_the_newest_message(make_broker_stack: MakeStack) -> None:
    """Two revisions sent, then the lease store loses its data (a restart without persistence; the broker keeps its
    messages): each message is registered at its own sequence when delivered, the older first, and the newest
    runs, the older giving way to it."""
    stack = make_broker_stack(threads=1)
    runs = Runs()

    @stack.actor(lock_key="record:{rid}", lock_debounce=1_000, max_retries=0)
    def sync_record(rid: int, revision: int) -> None:
        runs.add(revision=revision)

    messages = [sync_record.send(7, 0), sync_record.send(7, 1)]
    stack.leases.client.flushdb()  # the lease store restarts without persistence (the broker keeps its messages)
    stack.start()
    for message in messages:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    assert [r["revision"] for r in runs.items] == [1], "the older revision ran, the newest was dropped as debounced"


def test_a_sequence_the_record_never_handed_out_is_registered_anew_not_dropped(make_broker_stack: MakeStack) -> None:
    """A sequence written by hand (``lease_debounce=1``: no send took it) on a message sent after the last run is
    registered anew at its delivery, as a send then: it runs, not taken for an old send that gives way."""
    stack = make_broker_stack()
    runs = Runs()

    @stack.actor(lock_key="record:{rid}", lock_debounce=200, max_retries=0)
    def sync_record(rid: int, revision: int) -> None:
        runs.add(revision=revision)

    stack.start()
    first = sync_record.send(7, 0)
    assert stack.recorder.wait_settled(first.message_id, timeout=30) == "acked"
    wait_for(lambda: runs.count() == 1, timeout=10, what="the first burst's run")
    later = sync_record.send_with_options(args=(7, 1), lease_debounce=1)
    assert stack.recorder.wait_settled(later.message_id, timeout=30) == "acked"
    assert [r["revision"] for r in runs.items] == [0, 1], "the later message was dropped as debounced"


@pytest.mark.usefixtures("survivable_worker_threads")
def test_an_interrupted_debounce_send_back_never_runs_the_burst_twice(make_broker_stack: MakeStack) -> None:
    """An interruption lands just after the broker took the "not due yet" copy: the copy is sent again, and of the
    two, the first to run is remembered, so the spare is a duplicate: the burst runs once."""
    stack = make_broker_stack()
    injector = InterruptAfterEnqueue(lambda m, d: d is not None and "lease_debounce" in m.options)
    stack.broker.add_middleware(injector)  # after LeaseMiddleware: its after_enqueue runs first
    runs = Runs()

    @stack.actor(lock_key="record:{rid}", lock_debounce=300, max_retries=0)
    def sync_record(rid: int, revision: int) -> None:
        runs.add(revision=revision, fence=current_lease().fence)

    stack.start()
    message = sync_record.send(7, 0)
    wait_for(lambda: injector.fired, timeout=20, what="the interruption after the send-back's enqueue")
    wait_for(lambda: runs.count() >= 1, timeout=20, what="the burst's run")
    assert stack.recorder.wait_settled(message.message_id, timeout=10) == "acked"
    assert runs.count() == 1, f"the burst ran {runs.count()} times"
