"""Releases sent off the worker thread (dramatiq_leases/middleware/releasing.py), with real workers and Redis."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from dramatiq_leases.core.metrics import LeaseMetrics
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.middleware.releasing import Releaser

from .support.runs import Runs
from .support.stack import MakeStack, Stack
from .support.waiting import wait_for


def held_releases(stack: Stack) -> threading.Event:
    """Make ``stack``'s releaser hold every release until the returned event is set (before the stack starts)."""
    runs = stack.leases_mw.runs
    go = threading.Event()

    def send(item: Any) -> None:
        go.wait(30)
        runs.send_release(item)

    runs.releaser = Releaser(send)
    return go


def test_a_worker_thread_runs_its_next_message_before_its_last_release_is_sent(make_stack: MakeStack) -> None:
    stack = make_stack(threads=1)
    runs = Runs()

    @stack.actor(lock_key="invoice:{n}", max_retries=0)
    def charge(n: int) -> None:
        runs.add(n=n)

    go = held_releases(stack)
    stack.start()
    messages = [charge.send(n) for n in range(3)]
    # One thread: each message started after the one before ended, while every release waited.
    wait_for(lambda: runs.count() == 3, what="the three messages to run with their releases held")
    for m in messages:
        assert stack.recorder.wait_settled(m.message_id) == "acked"
    assert {i.key for i in stack.leases.scan()} == {"invoice:0", "invoice:1", "invoice:2"}
    go.set()
    wait_for(lambda: list(stack.leases.scan()) == [], what="the releases to be sent")


def test_a_worker_stop_sends_every_release_handed_over_before_it_returns(make_stack: MakeStack) -> None:
    stack = make_stack(threads=2)
    runs = Runs()

    @stack.actor(lock_key="export:{n}", lock_ttl=60_000, max_retries=0)
    def export(n: int) -> None:
        runs.add(n=n)

    go = held_releases(stack)
    stack.start()
    for n in range(4):
        export.send(n)
    wait_for(lambda: runs.count() == 4, what="the four messages to run")
    threading.Timer(0.3, go.set).start()  # the stop finds them pending
    stack.stop()
    assert go.is_set()
    assert list(stack.leases.scan()) == [], "a lease handed to the releaser outlived the worker's stop"


def test_a_key_with_a_waiter_is_handed_on_by_the_release_of_the_releaser(make_stack: MakeStack) -> None:
    """The waiter in place is woken by the release, sent by the releaser thread, and runs next."""
    stack = make_stack(threads=2)
    runs = Runs()
    first_running = threading.Event()
    finish_first = threading.Event()

    @stack.actor(lock_key="report:{n}", max_retries=0)
    def report(n: int, i: int) -> None:
        if i == 0:
            first_running.set()
            finish_first.wait(10)
        runs.add(i=i)

    stack.start()
    report.send(1, 0)
    assert first_running.wait(10)
    report.send(1, 1)
    wait_for(lambda: stack.leases.inspect_line("report:1").states.get("in_place") == 1, what="the second to wait")
    finish_first.set()
    wait_for(lambda: [r["i"] for r in runs.items] == [0, 1], what="the waiter to run after the release")


class ReleaseErrors(LeaseMetrics):
    """Counts the failed releases the middleware reports."""

    def __init__(self) -> None:
        self.count = 0

    def redis_error(self, operation: str) -> None:
        if operation == "release":
            self.count += 1


def test_a_failed_release_is_logged_and_counted_on_the_releaser_thread(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    lease_server = EmbeddedRedis().start()
    errors = ReleaseErrors()
    stack = Stack(redis_server.url(0), lease_server.url(0), threads=1, metrics=errors, metrics_endpoint=False)
    runs = Runs()

    @stack.actor(lock_key="vendor:{n}", lock_ttl=2_000, max_retries=0)
    def call_vendor(n: int) -> None:
        runs.add(n=n)

    go = held_releases(stack)
    try:
        stack.start()
        message = call_vendor.send(1)
        assert stack.recorder.wait_settled(message.message_id) == "acked"
        lease_server.stop()
        with caplog.at_level(logging.WARNING, logger="dramatiq_leases.middleware.runs"):
            go.set()
            [line] = wait_for(
                lambda: [r for r in caplog.records if "Could not release lease 'vendor:1'" in r.getMessage()],
                what="the failed release's log line",
            )
        assert line.threadName == "dramatiq-leases-releaser"
        assert errors.count == 1
    finally:
        stack.stop()
        lease_server.close()


def test_a_release_after_the_lease_store_restarted_is_sent_again_not_left_to_its_ttl(
    redis_server: EmbeddedRedis,
) -> None:
    """The releaser's connection went stale with the restart: its first attempt fails, the next one releases."""
    lease_server = EmbeddedRedis(persist=True).start()
    stack = Stack(redis_server.url(0), lease_server.url(0), threads=1, metrics_endpoint=False)
    runs = Runs()

    @stack.actor(lock_key="export:{n}", lock_ttl=60_000, max_retries=0)
    def export(n: int) -> None:
        runs.add(n=n)

    try:
        stack.start()
        export.send(1)
        wait_for(lambda: runs.count(n=1) == 1 and list(stack.leases.scan()) == [], what="the first run and release")
        lease_server.stop()
        lease_server.start()
        export.send(2)
        wait_for(lambda: runs.count(n=2) == 1, what="the second run")
        wait_for(lambda: list(stack.leases.scan()) == [], what="its release, well before its 60 s TTL")
    finally:
        stack.stop()
        lease_server.close()


def test_a_unique_message_is_released_before_its_ack_so_its_record_ends_there(make_stack: MakeStack) -> None:
    """The end of an "until_done" record, at the ack, reads whether the message still holds its lease: a
    unique actor's lease is released by its worker thread, never left pending with the releaser."""
    stack = make_stack(threads=1)
    runs = Runs()

    @stack.actor(lock_key="export:{n}", lock_unique="until_done", max_retries=0)
    def export(n: int) -> None:
        runs.add(n=n)

    go = held_releases(stack)  # nothing handed to the releaser is sent
    try:
        stack.start()
        first = export.send(1)
        assert stack.recorder.wait_settled(first.message_id) == "acked"
        assert list(stack.leases.scan()) == []
        export.send(1)  # accepted: the first one's record ended with its ack
        wait_for(lambda: runs.count(n=1) == 2, what="the second send to run")
    finally:
        go.set()


def test_a_release_handed_over_while_the_releaser_stops_is_still_sent() -> None:
    # Review: an actor outliving Dramatiq's join timeout ends while after_worker_shutdown stops the releaser.
    # Its submit sees the thread alive and puts its release behind _STOP: the thread ends without sending it,
    # and the lease, no longer renewed nor tracked, is held until its TTL (a waiter's 'done' record never
    # written).
    sent: list[str] = []
    first = threading.Event()
    go = threading.Event()

    def send(item: str) -> None:
        if item == "pending":
            first.set()
            go.wait(10)
        sent.append(item)

    releaser: Releaser[str] = Releaser(send)
    releaser.start()
    releaser.submit("pending")  # a release still being sent when the worker stops
    assert first.wait(5)
    stopper = threading.Thread(target=releaser.stop)
    stopper.start()
    wait_for(lambda: releaser.stopping, what="the stop to begin")
    releaser.submit("late")  # the late actor's end(): the releaser thread is still alive
    go.set()
    stopper.join(10)
    assert sorted(sent) == ["late", "pending"]  # the late one sent by its own thread, the pending one by the releaser
