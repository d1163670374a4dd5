"""LeaseMiddleware inside a real Dramatiq Worker, on real Redis (and RabbitMQ) brokers."""

from __future__ import annotations

import ast
import asyncio
import itertools
import logging
import pathlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import AsyncIO
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

from dramatiq_leases import LeaseKeyRenderError, LeaseLost, LeaseOptionError, current_lease
from dramatiq_leases.core import LostReason
from dramatiq_leases.embedded import EmbeddedRedis

from .support.brokers import RABBITMQ_URL, delete_rabbitmq_queues, rabbitmq_up
from .support.runs import Runs
from .support.stack import MakeStack, Stack
from .support.waiting import wait_for

MIDDLEWARE = pathlib.Path(__file__).parents[1] / "dramatiq_leases" / "middleware"


@pytest.fixture
def lease_server() -> Iterator[EmbeddedRedis]:
    """The Redis holding leases, separate from the broker's so it can go down on its own."""
    server = EmbeddedRedis(persist=True).start()
    yield server
    server.close()


@pytest.fixture
def make_stack(redis_server: EmbeddedRedis, lease_server: EmbeddedRedis) -> Iterator[MakeStack]:
    stacks: list[Stack] = []

    def make(**options: Any) -> Stack:
        stack = Stack(redis_server.url(0), lease_server.url(0), **options)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()


# Declaration and send time ----------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"lock_key": "inv:{invoice_id}", "lock_ttl": 0},
            "lock_ttl must be a whole number of milliseconds from 100 to 1000000000000, got 0",
        ),
        (
            {"lock_key": "inv:{invoice_id}", "lock_ttl": -5},
            "lock_ttl must be a whole number of milliseconds from 100 to 1000000000000, got -5",
        ),
        (
            {"lock_key": "inv:{invoice_id}", "lock_ttl": "15s"},
            "lock_ttl must be a whole number of milliseconds from 100 to 1000000000000, got '15s'",
        ),
        ({"lock_key": "inv:{invoice_id}", "lock_ttl": True}, "lock_ttl must be a whole number"),
        (
            {"lock_key": "inv:{invoice_id}", "lock_ttl": 0.5},
            "lock_ttl must be a whole number of milliseconds from 100 to 1000000000000, got 0.5",
        ),
        ({"lock_key": "inv:{invoice_id}", "lock_ttl": 1500.5}, "got 1500.5"),
        ({"lock_key": "inv:{invoice_id}", "lock_ttl": 50}, "lock_ttl must be a whole number of milliseconds from 100"),
        (
            {"lock_key": "inv:{invoice_id}", "lock_max_hold": 2.5},
            "lock_max_hold must be a whole number of milliseconds from 1",
        ),
        ({"lock_key": "inv:{invoice_id}", "lock_max_wait": float("nan")}, "lock_max_wait must be a whole number"),
        ({"lock_key": "inv:{invoice_id}", "lock_min_backoff": 0}, "lock_min_backoff must be a whole number"),
        # A message sent back is a delayed message, and Dramatiq's brokers take delays under 7 days.
        (
            {"lock_key": "inv:{invoice_id}", "lock_max_backoff": 8 * 86_400_000},
            "lock_max_backoff must be a whole number of milliseconds from 1 to 604799999, got 691200000",
        ),
        ({"lock_key": "inv:{invoice_id}", "time_limit": 1500.5}, "time_limit must be a whole number of milliseconds"),
        (
            {"lock_key": "inv:{invoice_id}", "lock_ttl": 3000, "lock_renew_interval": 3000},
            "lock_renew_interval=3000 must be at most half of lock_ttl=3000",
        ),
        (
            {"lock_key": "inv:{invoice_id}", "lock_ttl": 3000, "lock_renew_interval": 5000},
            "lock_renew_interval=5000 must be at most half of lock_ttl=3000",
        ),
        (
            {"lock_key": "inv:{customer}"},
            "names parameter 'customer', which is not among its parameters ['invoice_id']",
        ),
        ({"lock_key": "inv:{0}"}, "must name parameters, not positions"),
        ({"lock_key": "inv:{invoice_id"}, "is not a valid template"),
        ({"lock_key": ""}, "lock_key must be a non-empty string, got ''"),
        ({"lock_key": 42}, "lock_key must be a template string or a callable, got 42"),
        ({"lock_ttl": 3000}, "lock_ttl given without lock_key"),
        ({"lock_key": "inv:{invoice_id}", "lock_give_up": "explode"}, "lock_give_up must be one of"),
        (
            {"lock_key": "inv:{invoice_id}", "lock_min_backoff": 500, "lock_max_backoff": 100},
            "lock_max_backoff=100 is below lock_min_backoff=500",
        ),
    ],
)
def test_bad_options_fail_at_declaration(make_stack: MakeStack, options: dict[str, Any], expected: str) -> None:
    stack = make_stack()
    with pytest.raises(LeaseOptionError) as info:

        @stack.actor(actor_name="send_invoice", **options)
        def send_invoice(invoice_id: int) -> None:
            pass

    assert "actor 'send_invoice'" in str(info.value) and info.value.actor == "send_invoice"
    assert expected in str(info.value)


def test_bad_middleware_defaults_fail_at_construction(lease_server: EmbeddedRedis) -> None:
    from dramatiq_leases import LeaseMiddleware

    with pytest.raises(
        LeaseOptionError, match="lock_ttl must be a whole number of milliseconds from 100 to 1000000000000, got 0"
    ):
        LeaseMiddleware(redis_url=lease_server.url(), lock_ttl=0)


def test_unrenderable_messages_are_refused_at_send_time(make_stack: MakeStack) -> None:
    stack = make_stack()

    @stack.actor(lock_key="inv:{invoice_id}")
    def send_invoice(invoice_id: int, note: str = "") -> None:
        pass

    @stack.actor(lock_key=lambda user: user["tenant"])
    def by_tenant(user: dict[str, str]) -> None:
        pass

    @stack.actor(lock_key="{name}")
    def by_name(name: str) -> None:
        pass

    with pytest.raises(
        LeaseKeyRenderError,
        match=r"actor 'send_invoice': cannot render lock_key .*missing a required argument: 'invoice_id'",
    ):
        send_invoice.send(note="x")  # type: ignore[call-arg]  # the missing argument is the point
    with pytest.raises(LeaseKeyRenderError, match="rendered by lock_key .* must be a non-empty string, got ''"):
        by_name.send("")
    with pytest.raises(LeaseKeyRenderError, match="KeyError: 'tenant'"):
        by_tenant.send({"name": "x"})
    with pytest.raises(
        LeaseOptionError,
        match="actor 'send_invoice': lock_ttl must be a whole number of milliseconds from 100 to 1000000000000, got -1",
    ):
        send_invoice.send_with_options(args=(1,), lock_ttl=-1)
    with pytest.raises(LeaseOptionError, match="actor 'send_invoice': lock_ttl must be .* got 1500.5"):
        send_invoice.send_with_options(args=(1,), lock_ttl=1500.5)
    with pytest.raises(LeaseOptionError, match="actor 'send_invoice': time_limit must be .* got 'soon'"):
        send_invoice.send_with_options(args=(1,), time_limit="soon")
    assert stack.recorder.enqueues == []  # nothing reached the queue


def test_keys_render_from_positional_keyword_and_callable(make_stack: MakeStack) -> None:
    stack = make_stack()
    seen: list[str] = []

    @stack.actor(lock_key="inv:{invoice_id}:{kind}")
    def send_invoice(invoice_id: int, kind: str = "email") -> None:
        seen.append(current_lease().key)

    @stack.actor(lock_key=lambda order, **_: f"order:{order['id']}")
    def ship(order: dict[str, int], fast: bool = False) -> None:
        seen.append(current_lease().key)

    stack.start()
    messages = [send_invoice.send(7), send_invoice.send(invoice_id=8, kind="pdf"), ship.send({"id": 3}, fast=True)]
    for m in messages:
        assert stack.recorder.wait_settled(m.message_id) == "acked"
    assert sorted(seen) == ["inv:7:email", "inv:8:pdf", "order:3"]


# Mutual exclusion and contention ------------------------------------------------


def test_same_key_never_overlaps_different_keys_do(make_stack: MakeStack) -> None:
    stack = make_stack(threads=8, lock_min_backoff=20, lock_max_backoff=200)
    runs = Runs()

    @stack.actor(lock_key="inv:{invoice_id}", lock_ttl=2_000)
    def work(invoice_id: int) -> None:
        start = time.monotonic()
        time.sleep(0.15)
        runs.add(key=invoice_id, start=start, end=time.monotonic(), fence=current_lease().fence)

    stack.start()
    messages = [work.send(i % 2) for i in range(8)]
    for m in messages:
        assert stack.recorder.wait_settled(m.message_id) == "acked"
    for key in (0, 1):
        spans = sorted((r["start"], r["end"], r["fence"]) for r in runs.items if r["key"] == key)
        assert len(spans) == 4
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), f"overlap on key {key}: {spans}"
        assert [f for *_, f in spans] == sorted(f for *_, f in spans)  # fences rise with each grant
    k0 = [(r["start"], r["end"]) for r in runs.items if r["key"] == 0]
    k1 = [(r["start"], r["end"]) for r in runs.items if r["key"] == 1]
    assert any(a0 < b1 and a1 < b0 for a0, b0 in k0 for a1, b1 in k1), "different keys never ran in parallel"


def test_a_busy_message_waits_in_place_and_keeps_its_retries(make_stack: MakeStack) -> None:
    """The head of the line holds a thread and starts the moment the key is released: no polling, no retry."""
    stack = make_stack()
    holder_started = threading.Event()
    release_holder = threading.Event()
    options_seen: list[dict[str, Any]] = []
    started: dict[bool, float] = {}

    @stack.actor(lock_key="report:{n}", max_retries=1)
    def report(n: int, hold: bool) -> None:
        started[hold] = time.monotonic()
        current = dramatiq.middleware.CurrentMessage.get_current_message()
        options_seen.append(dict(current.options) if current else {})
        if hold:
            holder_started.set()
            release_holder.wait(10)

    stack.broker.add_middleware(dramatiq.middleware.CurrentMessage())
    stack.start()
    holder = report.send(1, True)
    assert holder_started.wait(10)
    waiter = report.send(1, False)
    wait_for(lambda: stack.leases.inspect_line("report:1").length == 1, what="the waiter in the line")
    time.sleep(0.3)  # it waits: it must neither run nor go back to the queue meanwhile
    released = time.monotonic()
    release_holder.set()
    assert stack.recorder.wait_settled(waiter.message_id) == "acked"
    assert stack.recorder.wait_settled(holder.message_id) == "acked"

    assert started[False] - released < 0.5  # woken by the release
    assert stack.recorder.delays(waiter.message_id) == []  # never sent back: it waited in place
    waiter_run = options_seen[-1]
    assert waiter_run.get("retries", 0) == 0  # Retries' budget untouched
    # Once it holds its lease, its wait clock is cleared: a retry of it (Retries) starts a new one.
    assert "lease_busy_attempts" not in waiter_run and "lease_first_attempt_ms" not in waiter_run


@pytest.mark.parametrize("give_up", ["fail", "drop"])
def test_wait_budget_gives_up(make_stack: MakeStack, caplog: Any, give_up: str) -> None:
    stack = make_stack(lock_min_backoff=20, lock_max_backoff=50)
    runs = Runs()
    holding = threading.Event()
    done = threading.Event()

    @stack.actor(lock_key="export:{user}", lock_max_wait=300, lock_give_up=give_up)
    def export(user: int, hold: bool) -> None:
        runs.add(hold=hold)
        if hold:
            holding.set()
            done.wait(10)

    stack.start()
    export.send(5, True)
    assert holding.wait(10)
    with caplog.at_level(logging.ERROR, logger="dramatiq_leases.middleware"):
        waiter = export.send(5, False)
        outcome = stack.recorder.wait_settled(waiter.message_id)
    done.set()
    assert outcome == ("nacked" if give_up == "fail" else "acked")
    assert runs.count(hold=False) == 0
    record = next(r for r in caplog.records if "Gave up" in r.getMessage())
    text = record.getMessage()
    assert waiter.message_id in text and "actor 'export'" in text and "'export:5'" in text
    assert "attempts over" in text and "lock_max_wait=300 ms" in text


def test_results_never_see_none_from_a_busy_skip(make_stack: MakeStack, redis_server: EmbeddedRedis) -> None:
    stack = make_stack(lock_min_backoff=20, lock_max_backoff=100)
    backend = RedisBackend(url=redis_server.url(2))
    stack.broker.add_middleware(Results(backend=backend))  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    holding = threading.Event()
    go = threading.Event()

    # A time limit of 8 s bounds a wait in place to 2 s: whichever waiters take the places, each parks after that.
    @stack.actor(lock_key="sum:{a}", store_results=True, time_limit=8_000)
    def add(a: int, b: int, hold: bool = False) -> int:
        if hold:
            holding.set()
            go.wait(10)
        return a + b

    stack.start()
    add.send(1, 100, hold=True)
    assert holding.wait(10)
    # Parked waiters: their first deliveries are skipped.
    waiters = [add.send(1, b) for b in (2, 3, 4)]
    wait_for(lambda: any(stack.recorder.delays(w.message_id) for w in waiters), what="a parked waiter")
    go.set()
    assert [w.get_result(backend=backend, block=True, timeout=20_000) for w in waiters] == [3, 4, 5]


# Loss mid-run ---------------------------------------------------------------------


def test_a_lease_deleted_mid_run_interrupts_the_actor(make_stack: MakeStack) -> None:
    stack = make_stack()
    runs = Runs()
    started = threading.Event()

    @stack.actor(lock_key="call:{n}", lock_ttl=3_000, lock_renew_interval=200, max_retries=0)
    def call_api(n: int) -> None:
        started.set()
        try:
            while True:
                time.sleep(0.01)
        except LeaseLost as e:
            runs.add(lost_at=time.monotonic(), error=str(e), key=e.key, reason=e.reason, fence=e.fence)
            raise

    stack.start()
    message = call_api.send(1)
    assert started.wait(10)
    deleted_at = time.monotonic()
    stack.leases.client.delete(stack.leases.lease_name("call:1"))
    assert stack.recorder.wait_settled(message.message_id) == "nacked"
    [run] = runs.items
    assert run["lost_at"] - deleted_at < 0.2 + 0.5  # within one renewal interval (+ slack)
    assert "'call:1'" in run["error"] and "gone" in run["error"]
    assert (run["key"], run["reason"]) == ("call:1", LostReason.GONE) and run["fence"] > 0


def test_a_late_lease_lost_never_hits_a_finished_actor(make_stack: MakeStack) -> None:
    """Injects the loss at varied instants around the actor's return, many times over."""
    stack = make_stack(threads=4)
    runs = Runs()
    mw = stack.leases_mw

    @stack.actor(lock_key="race:{i}", lock_ttl=5_000, max_retries=0)
    def racer(i: int, spin: int) -> None:
        lease = current_lease()

        def lose() -> None:
            for _ in range(spin):
                pass
            mw.heartbeat.lose(lease, LostReason.STOLEN)

        threading.Thread(target=lose).start()
        for _ in range(spin // 2):
            pass
        runs.add(i=i, completed=True)

    stack.start()
    messages = [racer.send(i, (i * 37) % 400) for i in range(300)]
    outcomes = {m.message_id: stack.recorder.wait_settled(m.message_id) for m in messages}
    completed = {r["i"] for r in runs.items}
    for i, m in enumerate(messages):
        if i in completed:
            assert outcomes[m.message_id] == "acked", f"message {i} completed but was failed by a late LeaseLost"
        else:
            assert outcomes[m.message_id] == "nacked"
    assert runs.count(completed=True) == len(completed)  # nothing ran twice


def test_redis_down_during_renewal_interrupts_before_expiry(make_stack: MakeStack, lease_server: EmbeddedRedis) -> None:
    stack = make_stack()
    runs = Runs()
    started = threading.Event()

    @stack.actor(lock_key="job:{n}", lock_ttl=1_500, max_retries=0)
    def job(n: int) -> None:
        started.set()
        try:
            while True:
                time.sleep(0.01)
        except LeaseLost as e:
            runs.add(at=time.monotonic(), error=str(e))
            raise

    stack.start()
    message = job.send(1)
    assert started.wait(10)
    lease_server.stop()
    stopped = time.monotonic()
    assert stack.recorder.wait_settled(message.message_id) == "nacked"
    [run] = runs.items
    assert "unreachable" in run["error"]
    assert run["at"] - stopped < 1.5  # before the TTL could run out on the server


# Fail closed and release -------------------------------------------------------------


def test_redis_down_at_acquire_means_no_run_until_it_is_back(
    make_stack: MakeStack, lease_server: EmbeddedRedis, caplog: Any
) -> None:
    """Fail closed, with the options table's growing backoff and one WARNING per message, not one per round."""
    stack = make_stack(lock_min_backoff=20, lock_max_backoff=400)
    runs = Runs()

    @stack.actor(lock_key="bill:{n}")
    def bill(n: int) -> None:
        runs.add(n=n)

    stack.start()
    lease_server.stop()
    with caplog.at_level("DEBUG", logger="dramatiq_leases"):
        message = bill.send(1)
        wait_for(lambda: len(stack.recorder.delays(message.message_id)) >= 8, what="eight acquire failures")
    assert runs.count() == 0  # never ran unprotected
    delays = stack.recorder.delays(message.message_id)
    # Attempt n waits in [20, min(400, 20 * 2**n)]: the backoff grows (it stayed at [20, 20] for ever).
    assert max(delays[:8]) > 20, delays
    assert all(d <= min(400, 20 << n) for n, d in enumerate(delays)), delays
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("Could not acquire lease" in w for w in warnings) == 1, warnings
    assert not any("Could not release lease" in w for w in warnings), warnings  # never granted: nothing to say
    assert sum("Line listener lost its connection" in w for w in warnings) <= 1, warnings
    lease_server.start()
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert runs.count(n=1) == 1


def test_release_happens_before_retries_requeue(make_stack: MakeStack) -> None:
    stack = make_stack()
    attempts = Runs()

    @stack.actor(lock_key="flaky:{n}", min_backoff=10, max_backoff=20, max_retries=3)
    def flaky(n: int) -> None:
        attempts.add(n=n)
        if attempts.count(n=n) < 3:
            raise RuntimeError("try again")

    stack.start()
    message = flaky.send(1)
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert attempts.count(n=1) == 3
    # No retry ever found its own previous lease still held.
    assert all(
        d is None or opts.get("lease_busy_attempts", 0) == 0
        for mid, d, opts in stack.recorder.enqueues
        if mid == message.message_id
    )
    wait_for(lambda: list(stack.leases.scan()) == [], what="the last release (sent off the worker thread)")


def test_default_max_hold_is_the_time_limit_and_ends_a_hung_actor(make_stack: MakeStack) -> None:
    stack = make_stack()
    seen: list[int | None] = []
    runs = Runs()

    @stack.actor(lock_key="t:{n}", time_limit=60_000)
    def limited(n: int) -> None:
        seen.append(current_lease().max_hold)

    @stack.actor(lock_key="h:{n}", lock_ttl=600, lock_max_hold=1_000, max_retries=0)
    def hung(n: int) -> None:
        try:
            while True:
                time.sleep(0.01)
        except LeaseLost as e:
            runs.add(error=str(e))
            raise

    stack.start()
    assert stack.recorder.wait_settled(limited.send(1).message_id) == "acked"
    assert seen == [60_000 + 1_000 + 1_000]  # time limit + TimeLimit's check interval + grace: TimeLimit fires first
    assert stack.recorder.wait_settled(hung.send(1).message_id) == "nacked"
    assert "maximum hold" in runs.items[0]["error"] or "max_hold" in runs.items[0]["error"]


def test_a_huge_time_limit_still_grants_the_lease(make_stack: MakeStack) -> None:
    stack = make_stack()
    seen: list[int | None] = []

    @stack.actor(lock_key="t:{n}", time_limit=10**12)
    def patient(n: int) -> None:
        seen.append(current_lease().max_hold)

    stack.start()
    assert stack.recorder.wait_settled(patient.send(1).message_id) == "acked"
    assert seen == [10**12]  # capped at the largest accepted number, not refused


def test_short_time_limits_run_and_end_for_the_real_reason(make_stack: MakeStack) -> None:
    """The lease's safety margin is added on the server's side, never taken from the actor's time."""
    stack = make_stack()
    runs = Runs()

    @stack.actor(lock_key="s:{n}", time_limit=2_000, max_retries=0)  # default lock_ttl: 30 s
    def short(n: int, seconds: float) -> None:
        start = time.monotonic()
        try:
            while time.monotonic() - start < seconds:
                time.sleep(0.01)  # an asynchronous exception lands between two sleeps, not within one
            runs.add(n=n, ran=time.monotonic() - start)
        except BaseException as e:
            runs.add(n=n, error=type(e).__name__, at=time.monotonic() - start)
            raise

    stack.start()
    assert stack.recorder.wait_settled(short.send(1, 1.5).message_id) == "acked"
    assert stack.recorder.wait_settled(short.send(2, 30).message_id, timeout=30) == "nacked"
    [done] = [r for r in runs.items if r["n"] == 1]
    [hung] = [r for r in runs.items if r["n"] == 2]
    assert done["ran"] >= 1.5
    assert hung["error"] == "TimeLimitExceeded" and hung["at"] >= 2.0  # not a LeaseLost, not cut early


# Other parts of Dramatiq ------------------------------------------------------------


def test_async_actors_hold_and_lose_leases(make_stack: MakeStack) -> None:
    stack = make_stack()
    stack.broker.add_middleware(AsyncIO())
    runs = Runs()
    started = threading.Event()

    @stack.actor(lock_key="a:{n}", lock_ttl=3_000, lock_renew_interval=200, max_retries=0)
    async def fetch(n: int, forever: bool) -> None:
        lease = current_lease()
        runs.add(n=n, key=lease.key, fence=lease.fence)
        if forever:
            started.set()
            try:
                while True:
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                runs.add(n=n, cancelled=True)
                raise

    stack.start()
    assert stack.recorder.wait_settled(fetch.send(1, False).message_id) == "acked"
    message = fetch.send(2, True)
    assert started.wait(10)
    stack.leases.client.delete(stack.leases.lease_name("a:2"))
    assert stack.recorder.wait_settled(message.message_id) == "nacked"
    assert runs.count(n=1, key="a:1") == 1 and runs.count(n=2, cancelled=True) == 1


@pytest.mark.skipif(not rabbitmq_up(), reason="RabbitMQ not reachable ($LEASES_TEST_RABBITMQ_URL)")
def test_rabbitmq_broker(lease_server: EmbeddedRedis) -> None:
    queue = f"leases-test-{uuid.uuid4().hex[:8]}"
    broker = RabbitmqBroker(url=RABBITMQ_URL)
    stack = Stack("", lease_server.url(0), broker=broker, lock_min_backoff=20, lock_max_backoff=100)
    runs = Runs()

    @stack.actor(queue_name=queue, lock_key="inv:{n}")
    def work(n: int) -> None:
        start = time.monotonic()
        time.sleep(0.1)
        runs.add(n=n, start=start, end=time.monotonic())

    try:
        stack.start()
        messages = [work.send(1) for _ in range(4)]
        for m in messages:
            assert stack.recorder.wait_settled(m.message_id) == "acked"
        spans = sorted((r["start"], r["end"]) for r in runs.items)
        assert len(spans) == 4 and all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    finally:
        stack.stop()
        delete_rabbitmq_queues(queue)


def test_a_job_lasting_many_ttls_keeps_its_lease(make_stack: MakeStack) -> None:
    stack = make_stack(lock_min_backoff=20, lock_max_backoff=50)
    runs = Runs()
    started = threading.Event()

    @stack.actor(lock_key="long:{n}", lock_ttl=300, max_retries=0)
    def long_job(n: int, seconds: float) -> None:
        started.set()
        begin = time.monotonic()
        time.sleep(seconds)
        runs.add(n=n, start=begin, end=time.monotonic(), fence=current_lease().fence)

    stack.start()
    long_message = long_job.send(1, 1.2)  # four TTLs
    assert started.wait(10)
    rival = long_job.send(1, 0.0)
    assert stack.recorder.wait_settled(long_message.message_id) == "acked"
    assert stack.recorder.wait_settled(rival.message_id) == "acked"
    first, second = sorted(runs.items, key=lambda r: r["start"])
    assert first["end"] <= second["start"], "the rival ran while the long job still held the key"
    # The key stayed held by renewals long past one TTL while the rival waited for it.
    assert first["n"] == 1 and first["end"] - first["start"] >= 1.2 and second["start"] >= first["end"]


@pytest.mark.parametrize(
    "args, options",
    [((1,), {"lock_ttl": "bad"}), ((), {}), ((1,), {"lease_order": "bad"})],
    ids=["bad-option", "unrenderable-key", "forged-order"],
)
def test_a_delayed_message_its_producer_did_not_check_is_dead_lettered_not_a_consumer_crash(
    make_stack: MakeStack,
    redis_server: EmbeddedRedis,
    caplog: pytest.LogCaptureFixture,
    args: tuple[Any, ...],
    options: dict[str, Any],
) -> None:
    """A producer without the middleware (or options written by hand) sends a delayed message the middleware
    would have refused. At the delay's end the worker's consumer thread enqueues it again: the check there must
    not raise (it would crash that consumer thread, and the message, never acknowledged, come back to crash it
    again); its delivery refuses it, dead-lettered with an ERROR."""
    caplog.set_level(logging.ERROR)
    stack = make_stack()
    ran: list[int] = []

    @stack.actor(actor_name="revise", lock_key="doc:{doc}", lock_on_busy="latest", max_retries=0)
    def revise(doc: int) -> None:
        ran.append(doc)

    stack.start()
    producer = RedisBroker(url=redis_server.url(0), middleware=[])  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
    try:
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name="default", actor_name="revise", args=args, kwargs={}, options=options
        )
        producer.enqueue(message, delay=200)
    finally:
        producer.close()
    wait_for(lambda: message.message_id in stack.recorder.nacked, timeout=10, what="the message dead-lettered")
    assert ran == []
    crashes = [r for r in caplog.records if r.levelname == "CRITICAL" and "Consumer" in r.getMessage()]
    assert crashes == [], crashes[0].getMessage()
    assert any(r.levelname == "ERROR" and message.message_id in r.getMessage() for r in caplog.records)


# Structure ---------------------------------------------------------------------------


def middleware_imports(package: pathlib.Path) -> dict[str, set[str]]:
    """Each module of ``package`` (``__init__`` for the package itself) and the modules of it that it imports,
    wherever the import stands: under ``if TYPE_CHECKING:`` and inside functions too."""
    modules = {path.stem for path in package.glob("*.py")}
    qualified = "dramatiq_leases." + package.name
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        edges = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: ``.`` is this package, ``..`` its parent
                    parent = qualified.rsplit(".", node.level - 1)[0] if node.level > 1 else qualified
                    base = f"{parent}.{base}" if base else parent
                # ``from .x import y``: x (y, if a module of x, is not ours); ``from . import y``: y, or the package.
                targets = [base] if base != qualified else [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                name = target.removeprefix(qualified + ".").split(".")[0]
                if target == qualified or (target.startswith(qualified + ".") and name not in modules):
                    edges.add("__init__")
                elif target.startswith(qualified + "."):
                    edges.add(name)
        edges.discard(path.stem)
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (its modules in order, the first repeated at the end), or ``[]``."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        for target in sorted(graph.get(module, ())):
            found = visit(target, [*path, module])
            if found:
                return found
        done.add(module)
        return []

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return []


def test_the_middleware_modules_import_one_another_without_a_cycle() -> None:
    """The parts take a Context, never LeaseMiddleware: no module of middleware/ imports one that imports it
    back, not even under ``if TYPE_CHECKING:``."""
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself
    graph = middleware_imports(MIDDLEWARE)
    assert {"hooks", "acquiring", "context"} <= graph.keys() and "context" in graph["acquiring"]
    cycle = import_cycle(graph)
    assert cycle == [], "import cycle in middleware/: " + " -> ".join(cycle)
