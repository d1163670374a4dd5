"""Unique sends (``lock_unique``) through a real broker, worker and Redis, in one process.

The record of a unique message must end on every path its message can leave by (ran, failed for good,
dead-lettered, skipped, a purged queue, a send whose broker call failed), and only its own message may end
it; it outlives no message and ends with none early (a run longer than ``lock_unique_ttl``, a stray copy, a
retry the broker refused, a superseded waiter), and never lacks a TTL. Each test sends, then asks: is a new
send of the key accepted, or refused naming the holder?
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import dramatiq
import pytest
import redis

from dramatiq_leases import DuplicateMessage, LeaseOptionError, LeaseSendUnavailableError, try_send
from dramatiq_leases.core.keys import line_name, unique_name
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.middleware import LeaseMiddleware

from .support.brokers import redis_dead_letters
from .support.stack import Stack
from .support.waiting import wait_for

MakeStack = Callable[..., Stack]


def pending(stack: Stack, queue: str = "default") -> int:
    """Messages of ``queue`` the broker holds (queued, not yet taken by a worker)."""
    client = stack.broker.client
    return int(client.hlen(f"dramatiq:{queue}.msgs"))


def accepted(actor: Any, *args: Any, **options: Any) -> str | None:
    """The id of a new message of ``actor`` if its send is accepted, else ``None`` (refused as a duplicate)."""
    try:
        return str(actor.send_with_options(args=args, **options).message_id)
    except DuplicateMessage:
        return None


def test_a_second_queued_send_is_refused_and_enqueues_nothing(make_stack: MakeStack, caplog: Any) -> None:
    stack = make_stack()
    started, go = threading.Event(), threading.Event()
    runs: list[int] = []

    @stack.actor(lock_key="export:{report}", lock_unique="queued")
    def export(report: int, n: int) -> None:
        started.set()
        go.wait(10)
        runs.append(n)

    first = export.send(42, 1)
    with (
        caplog.at_level(logging.INFO, logger="dramatiq_leases.middleware.unique"),
        pytest.raises(DuplicateMessage) as refused,
    ):
        export.send(42, 2)
    assert refused.value.key == "export:42" and refused.value.message_id == first.message_id
    assert first.message_id in str(refused.value) and "'export:42'" in str(refused.value)
    assert pending(stack) == 1  # nothing enqueued for the refused send
    line = next(r.getMessage() for r in caplog.records if "duplicate" in r.getMessage())
    assert first.message_id in line and "'export'" in line
    assert try_send(export, 42, 3) == (False, first.message_id, None)
    other = export.send(43, 1)  # another key is its own
    stack.start()
    assert started.wait(10)
    # Started: its run lease took over; a new send is accepted and waits its turn.
    wait_for(lambda: accepted(export, 42, 4), what="a send accepted once the first started")
    go.set()
    assert stack.recorder.wait_settled(other.message_id) == "acked"
    wait_for(lambda: 4 in runs, what="the second export, after the first")
    assert runs.index(1) < runs.index(4) and 2 not in runs and 3 not in runs


def test_until_done_refuses_until_the_first_is_acknowledged(make_stack: MakeStack) -> None:
    stack = make_stack()
    go = threading.Event()

    @stack.actor(lock_key="export:{report}", lock_unique="until_done")
    def export(report: int) -> None:
        go.wait(10)

    first = export.send(7)
    stack.start()
    wait_for(lambda: stack.leases.inspect("export:7"), what="the first holding its lease")
    assert accepted(export, 7) is None  # running: still refused
    go.set()
    assert stack.recorder.wait_settled(first.message_id) == "acked"
    settled = time.monotonic()
    assert wait_for(lambda: accepted(export, 7), timeout=5, what="a send accepted after the ack")
    assert time.monotonic() - settled < 5


@pytest.mark.parametrize("path", ["failed", "skipped", "dead_lettered_busy", "gave_up"])
def test_the_record_ends_with_a_message_that_ends_without_success(make_stack: MakeStack, path: str) -> None:
    stack = make_stack()
    hold = threading.Event()

    @stack.actor(lock_key="job:{n}", max_retries=0)
    def holder(n: int) -> None:
        hold.wait(10)

    options: dict[str, dict[str, Any]] = {
        "failed": {},
        "skipped": {"lock_on_busy": "skip"},
        "dead_lettered_busy": {"lock_on_busy": "fail"},
        "gave_up": {"lock_max_wait": 300, "lock_give_up": "drop"},
    }

    @stack.actor(lock_key="job:{n}", lock_unique="until_done", max_retries=0, **options[path])
    def job(n: int) -> None:
        raise RuntimeError("boom")

    stack.start()
    if path != "failed":
        holder.send(1)
        wait_for(lambda: stack.leases.inspect("job:1"), what="the key held")
    first = job.send(1)
    assert stack.recorder.wait_settled(first.message_id) == ("acked" if path in ("skipped", "gave_up") else "nacked")
    hold.set()
    assert wait_for(lambda: accepted(job, 1), timeout=5, what=f"a send accepted after the first {path}")


def test_a_retry_never_ends_a_newer_messages_record(make_stack: MakeStack) -> None:
    stack = make_stack()
    started = threading.Event()
    failed_once = threading.Event()
    go = threading.Event()

    @stack.actor(lock_key="sync:{n}", lock_unique="queued", max_retries=1, min_backoff=100, max_backoff=100)
    def sync(n: int, tag: str) -> None:
        if tag == "first" and not failed_once.is_set():
            started.set()
            go.wait(10)
            failed_once.set()
            raise RuntimeError("fails once")

    first = sync.send(1, "first")
    stack.start()
    assert started.wait(10)
    # The first started: the second is accepted, and stays queued (delayed) while the first's retry runs.
    second = sync.send_with_options(args=(1, "second"), delay=3_000).message_id
    go.set()
    wait_for(lambda: stack.recorder.delays(first.message_id), what="the first's retry")
    assert stack.recorder.wait_settled(first.message_id) == "acked"  # the retry ran and was acknowledged
    assert second not in stack.recorder.acked
    assert accepted(sync, 1, "third") is None  # the second's record survived the first's retry
    assert stack.recorder.wait_settled(second) == "acked"
    assert wait_for(lambda: accepted(sync, 1, "fourth"), timeout=5, what="a send accepted once the second ran")


def test_a_purged_queue_frees_the_key_within_the_unique_ttl(make_stack: MakeStack) -> None:
    stack = make_stack()

    @stack.actor(lock_key="k:{n}", lock_unique="queued", lock_unique_ttl=1_000)
    def job(n: int) -> None:
        pass

    job.send(1)
    assert accepted(job, 1) is None
    stack.broker.flush_all()  # no worker ever saw it
    purged = time.monotonic()
    wait_for(lambda: accepted(job, 1), timeout=5, what="a send accepted after the purge")
    assert time.monotonic() - purged < 1.0 + 1.0


def test_a_send_whose_broker_call_failed_frees_the_key_after_its_grace(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    stack = make_stack()

    @stack.actor(lock_key="k:{n}", lock_unique="queued", lock_unique_ttl=1_000)
    def job(n: int) -> None:
        pass

    def broken(*args: Any, **kwargs: Any) -> None:
        raise redis.ConnectionError("broker down")

    broker: Any = stack.broker  # RedisBroker makes do_enqueue in __init__: unknown to mypy
    real, broker.do_enqueue = broker.do_enqueue, broken
    with pytest.raises(redis.ConnectionError):
        job.send(1)
    broker.do_enqueue = real
    failed = time.monotonic()
    assert accepted(job, 1) is None  # within the grace: held
    wait_for(lambda: accepted(job, 1), timeout=5, what="a send accepted after the failed send's grace")
    assert time.monotonic() - failed < 1.0 + 1.0


def test_a_send_with_redis_unreachable_is_refused_not_sent_unchecked(redis_server: EmbeddedRedis) -> None:
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=redis_server.url(0))  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    broker.add_middleware(
        LeaseMiddleware(redis_url=f"redis://127.0.0.1:{free_port()}/0?socket_timeout=0.5&socket_connect_timeout=0.5")
    )

    @dramatiq.actor(broker=broker, lock_key="k:{n}", lock_unique="queued")
    def job(n: int) -> None:
        pass

    with pytest.raises(LeaseSendUnavailableError) as refused:
        job.send(1)
    assert "'k:1'" in str(refused.value) and "not sent" in str(refused.value)
    assert broker.client.hlen("dramatiq:default.msgs") == 0


def test_bad_lock_unique_is_refused_at_declaration_and_send(make_stack: MakeStack) -> None:
    stack = make_stack()
    with pytest.raises(LeaseOptionError, match=r"actor 'bad'.*lock_unique.*'sometimes'"):

        @stack.actor(actor_name="bad", lock_key="k:{n}", lock_unique="sometimes")
        def bad(n: int) -> None:
            pass

    @stack.actor(lock_key="k:{n}")
    def good(n: int) -> None:
        pass

    with pytest.raises(LeaseOptionError, match=r"actor 'good'.*lock_unique_ttl"):
        good.send_with_options(args=(1,), lock_unique="queued", lock_unique_ttl=5)
    with pytest.raises(LeaseOptionError, match=r"actor 'good'.*lock_unique.*True"):
        good.send_with_options(args=(1,), lock_unique=True)
    assert pending(stack) == 0


def test_a_handed_over_lease_carries_the_record_until_the_worker_adopts_it(make_stack: MakeStack) -> None:
    stack = make_stack()
    go = threading.Event()

    @stack.actor(lock_key="export:{report}", lock_unique="queued")
    def export(report: int) -> None:
        go.wait(10)

    lease = stack.leases.try_acquire("export:5", 30_000)  # a web request's
    assert lease
    handed = export.send_with_options(args=(5,), lease=lease)
    assert accepted(export, 5) is None  # queued with its lease: refused
    stack.start()
    wait_for(lambda: stack.leases.client.hget(stack.leases.lease_name("export:5"), "adopted_ms"), what="the adoption")
    wait_for(lambda: accepted(export, 5), timeout=5, what="a send accepted once the handed message started")
    go.set()
    assert stack.recorder.wait_settled(handed.message_id) == "acked"


def test_a_refused_send_releases_the_lease_it_was_handed(make_stack: MakeStack) -> None:
    stack = make_stack()

    @stack.actor(lock_key="export:{report}", lock_unique="queued")
    def export(report: int) -> None:
        pass

    queued = export.send(6)  # no worker: it stays queued, holding no lease
    lease = stack.leases.try_acquire("export:6", 30_000)
    assert lease
    with pytest.raises(DuplicateMessage) as refused:
        export.send_with_options(args=(6,), lease=lease)
    assert refused.value.message_id == queued.message_id
    assert stack.leases.inspect("export:6") is None  # released, not left to its TTL


def test_with_a_limit_n_messages_may_be_queued_at_once(make_stack: MakeStack) -> None:
    stack = make_stack()

    @stack.actor(lock_key="call:{tenant}", lock_unique="until_done", lock_limit=3)
    def call_vendor(tenant: int, n: int) -> None:
        pass

    sent = [accepted(call_vendor, 1, n) for n in range(5)]
    assert all(sent[:3]) and sent[3:] == [None, None]
    stack.start()
    for message_id in sent[:3]:
        assert message_id is not None and stack.recorder.wait_settled(message_id) == "acked"
    assert wait_for(lambda: accepted(call_vendor, 1, 9), timeout=5, what="a send accepted once they ran")


def test_a_message_re_driven_from_its_dead_letters_takes_its_record_again(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    stack = make_stack()
    failing = threading.Event()
    failing.set()
    go = threading.Event()

    @stack.actor(lock_key="bill:{n}", lock_unique="until_done", max_retries=0)
    def bill(n: int) -> None:
        if failing.is_set():
            raise RuntimeError("vendor down")
        go.wait(10)

    first = bill.send(1)
    stack.start()
    assert stack.recorder.wait_settled(first.message_id) == "nacked"
    [dead] = redis_dead_letters(redis_server)
    failing.clear()
    stack.broker.enqueue(dead)  # an operator re-drives it: the same message, unique again
    wait_for(lambda: stack.leases.inspect("bill:1"), what="the re-driven message running")
    assert accepted(bill, 1) is None
    go.set()
    wait_for(lambda: stack.recorder.acked.count(first.message_id) >= 1, what="the re-driven message acknowledged")
    assert wait_for(lambda: accepted(bill, 1), timeout=5, what="a send accepted once the re-driven one ran")


def test_a_refused_send_is_in_the_keys_history_naming_the_holder(redis_server: EmbeddedRedis) -> None:
    stack = Stack(redis_server.url(0), redis_server.url(1), middleware=LeaseMiddleware(redis_server.url(1), history=20))

    @stack.actor(lock_key="export:{report}", lock_unique="queued")
    def export(report: int) -> None:
        pass

    try:
        first = export.send(8)
        refused = try_send(export, 8)
        assert not refused.sent
        [event] = [e for e in stack.leases.history("export:8") if e.event == "duplicate"]
        assert (event.reason, event.by, event.actor) == ("unique", first.message_id, "export")
    finally:
        stack.stop()


def test_show_names_the_message_holding_a_keys_unique_record(
    make_stack: MakeStack, redis_server: EmbeddedRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    from dramatiq_leases.cli import main

    stack = make_stack()

    @stack.actor(lock_key="export:{report}", lock_unique="until_done")
    def export(report: int) -> None:
        pass

    queued = export.send(9)  # no worker: queued, no lease, no line
    assert main(["--redis-url", redis_server.url(1), "show", "export:9"]) == 0
    text = capsys.readouterr().out
    assert f"message {queued.message_id}" in text and "refused until it is done for good" in text
    assert main(["--redis-url", redis_server.url(1), "show", "export:9", "--json"]) == 0
    [record] = json.loads(capsys.readouterr().out)["unique"]
    assert record["message_id"] == queued.message_id and record["mode"] == "until_done"
    assert 0 < record["ends_in"] <= 3_600


# Attacks on the record: one that outlives its message, one that ends too early ---------------------------


def refused_throughout(actor: Any, *args: Any, seconds: float) -> None:
    """Every send of ``actor(*args)`` for ``seconds`` is refused (polled with a deadline, not slept on)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sent = accepted(actor, *args)
        assert sent is None, f"a send was accepted ({sent}) while the first message was still live"
        time.sleep(0.05)


def test_a_run_longer_than_the_unique_ttl_keeps_its_until_done_record(make_stack: MakeStack) -> None:
    """Promise: "until_done" refuses while the first runs; "a long run outlives no record"."""
    stack = make_stack()
    started, go = threading.Event(), threading.Event()

    @stack.actor(lock_key="report:{n}", lock_unique="until_done", lock_unique_ttl=1_000)
    def report(n: int) -> None:
        started.set()
        go.wait(10)

    first = report.send(1)
    stack.start()
    assert started.wait(10)
    try:
        refused_throughout(report, 1, seconds=2.0)  # twice lock_unique_ttl into the run
    finally:
        go.set()
    assert stack.recorder.wait_settled(first.message_id) == "acked"
    assert wait_for(lambda: accepted(report, 1), timeout=5, what="a send accepted once the long run ended")


def test_a_handed_over_lease_run_longer_than_the_unique_ttl_keeps_its_record(make_stack: MakeStack) -> None:
    """The same with the web handoff (``lease=``): the adopted lease's hash names no waiter."""
    stack = make_stack()
    started, go = threading.Event(), threading.Event()

    @stack.actor(lock_key="report:{n}", lock_unique="until_done", lock_unique_ttl=1_000)
    def report(n: int) -> None:
        started.set()
        go.wait(10)

    lease = stack.leases.try_acquire("report:2", 30_000)
    assert lease
    first = report.send_with_options(args=(2,), lease=lease)
    stack.start()
    assert started.wait(10)
    try:
        refused_throughout(report, 2, seconds=2.0)
    finally:
        go.set()
    assert stack.recorder.wait_settled(first.message_id) == "acked"
    assert wait_for(lambda: accepted(report, 2), timeout=5, what="a send accepted once the run ended")


def test_a_stray_copy_of_the_first_attempt_does_not_end_the_record_of_its_pending_retry(make_stack: MakeStack) -> None:
    """Promise: "A Retries retry keeps the record; a stray copy ... can never end" it. The first attempt fails,
    its retry waits in the delay queue; a stray copy of the first attempt (an enqueue the producer tried
    again after a timeout, a redelivery) is delivered and acknowledged meanwhile."""
    stack = make_stack()
    runs: list[int] = []
    lock = threading.Lock()

    @stack.actor(lock_key="sync:{n}", lock_unique="until_done", max_retries=1, min_backoff=3_000, max_backoff=3_000)
    def sync(n: int) -> None:
        with lock:
            runs.append(n)
            if len(runs) == 1:
                raise RuntimeError("fails once")

    first = sync.send(1)
    stack.start()
    wait_for(lambda: stack.recorder.delays(first.message_id), what="the first attempt's retry, delayed")
    wait_for(lambda: first.message_id in stack.recorder.acked, what="the first attempt acknowledged")
    stack.broker.enqueue(first)  # the stray copy: the message as sent, its retry count 0
    wait_for(lambda: stack.recorder.acked.count(first.message_id) >= 2, what="the stray copy acknowledged")
    # The retry is still in the delay queue: the message is not done for good.
    assert stack.recorder.acked.count(first.message_id) < 3
    assert accepted(sync, 1) is None, "a second message accepted while the first's retry is pending"
    assert stack.recorder.wait_settled(first.message_id) == "acked"


def test_a_retry_the_broker_refused_does_not_leave_the_record_behind(make_stack: MakeStack) -> None:
    """Promise: the record dies with its message on every path (a send accepted within 5 s). The first attempt
    fails; Retries' enqueue of the retry is refused by the broker (an error reply, not an outage): Dramatiq
    logs it and acknowledges the delivery; nothing of the message is left anywhere."""
    stack = make_stack()

    @stack.actor(lock_key="bill:{n}", lock_unique="until_done", max_retries=3, min_backoff=100, max_backoff=100)
    def bill(n: int) -> None:
        raise RuntimeError("vendor down")

    broker: Any = stack.broker  # RedisBroker makes do_enqueue in __init__: unknown to mypy
    real = broker.do_enqueue

    def refusing(queue_name: str, *args: Any) -> Any:
        if queue_name.endswith(".DQ"):
            raise redis.ResponseError("ERR refused by the broker")
        return real(queue_name, *args)

    broker.do_enqueue = refusing
    first = bill.send(1)
    stack.start()
    wait_for(lambda: first.message_id in stack.recorder.acked, what="the failed attempt acknowledged")
    broker.do_enqueue = real
    assert broker.client.hlen("dramatiq:default.msgs") == 0 and broker.client.hlen("dramatiq:default.DQ.msgs") == 0
    assert wait_for(lambda: accepted(bill, 1), timeout=5, what="a send accepted once nothing of the first is left")


def test_every_record_has_a_ttl_along_a_message_s_life(make_stack: MakeStack) -> None:
    """Promise: no record without a TTL (PTTL of ``<prefix>:unique:{...}``), and it is gone once all is done."""
    stack = make_stack()
    started, go = threading.Event(), threading.Event()

    @stack.actor(lock_key="t:{n}", lock_unique="until_done", max_retries=1, min_backoff=200, max_backoff=200)
    def job(n: int, fail: bool) -> None:
        started.set()
        go.wait(10)
        if fail and not getattr(job, "failed", False):
            job.failed = True  # type: ignore[attr-defined]
            raise RuntimeError("once")

    name = unique_name(stack.leases.prefix, "t:1")
    client = stack.leases.client
    first = job.send_with_options(args=(1, True), delay=300)
    assert 0 < client.pttl(name) <= 300 + 3_600_000
    stack.start()
    assert started.wait(10)
    assert client.pttl(name) > 0
    go.set()
    wait_for(lambda: stack.recorder.delays(first.message_id)[1:], what="the retry")
    assert client.pttl(name) > 0
    assert stack.recorder.wait_settled(first.message_id) == "acked"
    wait_for(lambda: not client.exists(name), timeout=5, what="the records gone with the message")


def test_latest_with_a_limit_ends_the_superseded_waiters_record(make_stack: MakeStack) -> None:
    """lock_on_busy="latest", lock_limit=2, "queued": two run, a waiter is superseded by a newer one; the
    superseded one's record ends with it (a new send is accepted), and none is left at the end."""
    stack = make_stack(threads=4)
    go = threading.Event()
    holding = threading.Semaphore(0)

    @stack.actor(lock_key="v:{n}", lock_limit=2)
    def hold(n: int) -> None:
        holding.release()
        go.wait(10)

    ran: list[str] = []

    @stack.actor(lock_key="v:{n}", lock_limit=2, lock_unique="queued", lock_on_busy="latest")
    def call(n: int, tag: str) -> None:
        ran.append(tag)

    hold.send(1)
    hold.send(1)
    stack.start()
    assert holding.acquire(timeout=10) and holding.acquire(timeout=10)
    old = call.send(1, "old")
    line = line_name(stack.leases.prefix, "v:1")
    wait_for(lambda: stack.leases.client.zcard(line) == 1, what="the older waiter in the key's line")
    new = call.send(1, "new")
    wait_for(lambda: old.message_id in stack.recorder.acked, what="the older waiter superseded")
    third = wait_for(lambda: accepted(call, 1, "third"), timeout=5, what="a send accepted in the superseded's place")
    go.set()
    # "new" runs, or is superseded by "third" if that reaches the line first: either way acknowledged.
    assert stack.recorder.wait_settled(new.message_id) == "acked"
    assert third is not None and stack.recorder.wait_settled(third) == "acked"
    assert "old" not in ran and "third" in ran
    name = unique_name(stack.leases.prefix, "v:1")
    wait_for(lambda: not stack.leases.client.exists(name), timeout=10, what="no record left")


def test_a_queued_message_waiting_in_place_keeps_its_record(make_stack: MakeStack) -> None:
    """Promise: "queued" refuses while the first waits in the key's line; a delivery is a sign of life."""
    stack = make_stack(threads=4)

    @stack.actor(lock_key="w:{n}", lock_unique="queued", lock_unique_ttl=1_000)
    def job(n: int) -> None:
        pass

    lease = stack.leases.try_acquire("w:1", 10_000)  # another process holds the key
    assert lease
    first = job.send(1)
    stack.start()
    line = line_name(stack.leases.prefix, "w:1")
    wait_for(lambda: stack.leases.client.zcard(line) == 1, what="the first waiting in the key's line")
    try:
        refused_throughout(job, 1, seconds=1.5)
    finally:
        stack.leases.release(lease)
    assert stack.recorder.wait_settled(first.message_id) == "acked"
