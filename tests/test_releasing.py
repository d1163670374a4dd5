"""Releases sent off the worker thread (dramatiq_leases/middleware/releasing.py), with real workers and Redis."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import Middleware
from dramatiq.middleware.time_limit import TimeLimitExceeded

from dramatiq_leases.core.lease import Lease
from dramatiq_leases.core.metrics import LeaseMetrics
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.middleware import runs as runs_module
from dramatiq_leases.middleware.releasing import Releaser
from dramatiq_leases.middleware.runs import Runs as Runs_

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


def test_a_waiter_whose_release_waits_past_its_ttl_is_still_remembered_as_done(make_stack: MakeStack) -> None:
    """Review: the lease was untracked when handed over, so a release queued (or slow) past the TTL found it
    expired and skipped the waiter's 'done' record: a stray copy of the message then ran again. The lease
    is renewed until the releaser sends its release (for one more TTL at most)."""
    stack = make_stack(threads=1)
    runs = Runs()
    ttl = 1_000

    @stack.actor(lock_key="invoice:{n}", lock_ttl=ttl, max_retries=0)
    def charge(n: int) -> None:
        runs.add(n=n)

    go = held_releases(stack)
    try:
        stack.start()
        holder = stack.leases.try_acquire("invoice:1", ttl=10_000)
        assert isinstance(holder, Lease)
        message = charge.send(1)
        wait_for(lambda: stack.leases.inspect_line("invoice:1").length == 1, what="the message to wait in line")
        assert stack.leases.release(holder)
        assert stack.recorder.wait_settled(message.message_id) == "acked"
        returned = time.monotonic()
        # Its release is held by the releaser past the TTL (a releaser behind others, a slow Redis).
        wait_for(lambda: time.monotonic() > returned + 1.2 * ttl / 1000, what="more than a TTL to pass")
        assert stack.leases.inspect("invoice:1") is not None, "a lease handed to the releaser expired unreleased"
        go.set()
        wait_for(lambda: stack.leases.inspect("invoice:1") is None, what="the release to be sent")
        stack.broker.enqueue(message.copy())  # the copy a crash would have left in the broker
        assert stack.recorder.wait_settled(message.message_id) == "acked"
        assert runs.count() == 1, "a stray copy of a message that waited and ran ran again"
    finally:
        go.set()


def test_a_release_the_releaser_never_sends_leaves_the_key_to_its_ttl_not_renewed_for_ever(
    make_stack: MakeStack, caplog: pytest.LogCaptureFixture
) -> None:
    """A handed-over lease is renewed while its release waits, but not past one more TTL: a releaser that never
    sends it (dead, hung without a socket timeout) does not hold the key until the actor's max hold."""
    stack = make_stack(threads=1)
    ttl = 500

    @stack.actor(lock_key="report:{n}", lock_ttl=ttl, max_retries=0, time_limit=600_000)
    def report(n: int) -> None:
        pass

    go = held_releases(stack)
    try:
        stack.start()
        message = report.send(1)
        assert stack.recorder.wait_settled(message.message_id) == "acked"
        wait_for(
            lambda: stack.leases.inspect("report:1") is None,
            timeout=2 * ttl / 1000 + 1.0,
            what="the unreleased lease to expire within two TTLs of the actor's return",
        )
        assert stack.leases_mw.heartbeat.tracked() == []
        assert not [r for r in caplog.records if " lost: " in r.getMessage()], "an ended hold counted as lost"
    finally:
        go.set()


class TimeLimitInEnd(Middleware):
    """Raises ``TimeLimitExceeded`` at the *n*-th Python function entry or C function return within ``Runs.end``
    after the actor returned, a different *n* for each message: swept over the hand-over, at the points where
    CPython can deliver Dramatiq's asynchronous exceptions."""

    def __init__(self) -> None:
        self.end = Runs_.end.__code__
        self.next_n = 1
        self.calls = 0
        self.target = 0
        self.fired: list[str] = []

    def arm(self) -> None:
        """Called by the actor as it returns."""
        self.calls, self.target = 0, self.next_n
        self.next_n += 1
        sys.setprofile(self._profile)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        # A Python function's entry, or a C function's return (a C lock's __exit__ has released it by then).
        if event not in ("call", "c_return"):
            return
        outer = frame
        while outer is not None and outer.f_code is not self.end:
            outer = outer.f_back
        if outer is None:
            return
        self.calls += 1
        if self.calls == self.target:
            sys.setprofile(None)
            self.fired.append(frame.f_code.co_name if event == "call" else getattr(arg, "__name__", "?"))
            raise TimeLimitExceeded

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        sys.setprofile(None)


def test_an_interruption_anywhere_in_the_hand_over_sends_one_release_counted_once(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: an interruption landing in ``Releaser.submit`` after its put (its ``time.sleep(0)`` is where a
    pending one is delivered) left the run not marked released; the retried end handed the release over again,
    and a release that failed was then counted (and logged) twice."""
    monkeypatch.setattr(runs_module, "RELEASE_PAUSE_S", 0.001)
    lease_server = EmbeddedRedis().start()
    errors = ReleaseErrors()
    stack = Stack(redis_server.url(0), lease_server.url(0), threads=1, metrics=errors, metrics_endpoint=False)
    injector = TimeLimitInEnd()
    stack.broker.add_middleware(injector)
    returned: list[int] = []

    @stack.actor(lock_key="sweep:{n}", lock_ttl=60_000, max_retries=0)
    def sweep(n: int) -> int:
        returned.append(n)
        injector.arm()
        return n

    inline: list[str] = []
    go = threading.Event()
    send = stack.leases_mw.runs.send_release

    def held_send(item: Any) -> None:
        if threading.current_thread().name != "dramatiq-leases-releaser":
            inline.append(injector.fired[-1])
        else:
            go.wait(30)
        send(item)

    stack.leases_mw.runs.releaser = Releaser(held_send)
    try:
        stack.start()
        messages = [sweep.send(n) for n in range(25)]
        outcomes = [stack.recorder.wait_settled(m.message_id) for m in messages]
        assert outcomes == ["acked"] * len(messages), "an actor that returned was failed by an interruption"
        # Every call of the hand-over was hit, the last messages' targets lay past its end.
        assert 8 <= len(injector.fired) < len(messages), f"the sweep missed the hand-over: {injector.fired}"
        # Thread.is_alive() interrupted (CPython before 3.13) can release a live thread's state lock: the releaser
        # then looked dead for good, every release was sent inline, and the stop no longer waited for any.
        assert inline == [], f"a release was sent by its worker thread after an interruption in {inline[0]}"
        assert runs_module.RELEASE_TRIES > 1
        lease_server.stop()  # every release now fails: each must be counted once
        go.set()
        assert stack.leases_mw.runs.releaser.stop()
        failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Could not release lease")]
        twice = sorted({m.split("'")[1] for m in failed if failed.count(m) > 1})
        assert twice == [], f"a failed release logged twice (interrupted at {injector.fired})"
        assert len(failed) == len(messages)
        assert errors.count == len(messages), f"a failed release counted twice (interrupted at {injector.fired})"
    finally:
        go.set()
        stack.stop()
        lease_server.close()


def test_a_release_submitted_in_a_forked_child_is_sent_there() -> None:
    """The releaser thread does not survive a fork(): in the child, a release is sent by the thread submitting
    it, not put on a queue no thread reads (nor stuck behind a lock held at the fork)."""
    sent: list[str] = []
    releaser: Releaser[str] = Releaser(sent.append)
    releaser.start()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it sent, and leave without pytest's teardown
        code = 1
        try:
            releaser.submit("child")
            os.write(write, ",".join(sent).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as pipe:
            reported = pipe.read().decode()
        _, status = os.waitpid(pid, 0)
    finally:
        releaser.stop()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert reported == "child", "a release submitted in a forked child was never sent"
