"""Attacks on ``lock_unique``'s promises: a record that outlives its message, one that ends too early, a send
accepted without a record. Real Redis, a real broker and worker in process (``make_stack``).

Each test states the promise it attacks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from dramatiq_leases import DuplicateMessage
from dramatiq_leases.core.keys import line_name, unique_name

from .support.stack import Stack
from .support.waiting import wait_for

MakeStack = Callable[..., Stack]


def accepted(actor: Any, *args: Any, **options: Any) -> str | None:
    """The id of a new message of ``actor`` if its send is accepted, else ``None`` (refused as a duplicate)."""
    try:
        return str(actor.send_with_options(args=args, **options).message_id)
    except DuplicateMessage:
        return None


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
