"""LeaseMiddleware inside a real Dramatiq Worker, on real Redis (and RabbitMQ) brokers.

Options checked at declaration and send time (a message-level ``lock_key`` costs no more than its size), mutual
exclusion and the wait line (the wait clock of retries, stray and spare copies, a re-driven dead letter), a loss
mid-run, a lease handed over by a producer (adopted once), failing closed and releasing, a worker's stop (no
message run twice, none lost, a still-running actor's lease kept), and Dramatiq's other parts (Results, AsyncIO).
"""

from __future__ import annotations

import ast
import asyncio
import itertools
import logging
import pathlib
import queue
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import AsyncIO, Middleware
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

from dramatiq_leases import (
    Busy,
    LeaseKeyRenderError,
    LeaseLost,
    LeaseMetrics,
    LeaseMiddleware,
    LeaseOptionError,
    Leases,
    current_lease,
)
from dramatiq_leases.core import Lease, LostReason
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.middleware.declarations import MESSAGE_TEMPLATE_CACHE
from dramatiq_leases.middleware.options import FIRST_ATTEMPT_OPTION
from dramatiq_leases.middleware.waiting import Waiting

from .support.brokers import RABBITMQ_URL, delete_rabbitmq_queues, pending, rabbitmq_up, redis_dead_letters
from .support.runs import Runs
from .support.stack import MakeStack, Stack, taking_over_broker
from .support.waiting import busy_for, wait_for

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


def test_lease_options_on_an_actor_without_lock_key_are_refused_at_send_time(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    stack = make_stack()

    @stack.actor(actor_name="plain")
    def plain(n: int) -> None:
        pass

    lease = stack.leases.try_acquire("plain:1", ttl=5_000)
    assert not isinstance(lease, Busy)
    options: dict[str, Any] = {
        "lock_key": "x",
        "lock_ttl": 1_000,
        "lock_renew_interval": 100,
        "lock_max_hold": 1_000,
        "lock_min_backoff": 10,
        "lock_max_backoff": 100,
        "lock_max_wait": 1_000,
        "lock_give_up": "drop",
        "lease": lease,
    }
    for name, value in options.items():
        with pytest.raises(LeaseOptionError) as info:
            plain.send_with_options(args=(1,), **{name: value})
        assert "actor 'plain'" in str(info.value), info.value
        shown = "lease=Lease(key='plain:1'" if name == "lease" else f"{name}={value!r}"
        assert shown in str(info.value), info.value
    assert stack.recorder.enqueues == []
    broker = redis.Redis.from_url(redis_server.url(0))
    assert broker.llen("dramatiq:default") == 0 and broker.hlen("dramatiq:default.msgs") == 0


def test_a_message_level_lock_key_is_honoured_or_refused_at_send_time(make_stack: MakeStack) -> None:
    stack = make_stack(lock_min_backoff=20, lock_max_backoff=60)
    runs = Runs()

    @stack.actor(actor_name="keyed", lock_key="inv:{n}", max_retries=0)
    def keyed(n: int) -> None:
        runs.add(key=current_lease().key)

    for template in ("other:{missing}", "other:{n"):
        with pytest.raises((LeaseOptionError, LeaseKeyRenderError)) as info:
            keyed.send_with_options(args=(5,), lock_key=template)
        assert "actor 'keyed'" in str(info.value) and template in str(info.value), info.value
    with pytest.raises((LeaseOptionError, LeaseKeyRenderError), match="actor 'keyed'"):
        keyed.send_with_options(args=(5,), lock_key="other:{n.real.missing}")
    assert stack.recorder.enqueues == []

    stack.start()
    holder = stack.leases.try_acquire("other:5", ttl=10_000)  # someone holds the message's own key
    assert not isinstance(holder, Busy)
    message = keyed.send_with_options(args=(5,), lock_key="other:{n}")
    wait_for(lambda: stack.leases.inspect_line("other:5").length == 1, what="the message to wait for other:5")
    assert runs.items == [], "ran while its message-level key was held"
    assert stack.leases.release(holder)
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert runs.items == [{"key": "other:5"}]


@pytest.mark.parametrize("template", ["{n:>300000000}", "{n!r}", "{n.__class__}", "{n[0]}", "x" * 1025, "{n:{n}}"])
def test_a_message_level_lock_key_may_hold_only_plain_fields(make_stack: MakeStack, template: str) -> None:
    stack = make_stack()

    @stack.actor(actor_name="charge", lock_key="invoice:{n}")
    def charge(n: int) -> None:
        pass

    with pytest.raises(LeaseOptionError, match="actor 'charge': a message's lock_key") as info:
        charge.send_with_options(args=(1,), lock_key=template)
    assert template[:64] in str(info.value)
    assert stack.recorder.enqueues == []


@pytest.mark.parametrize(
    ("template", "argument"),
    [("{n:>300000000}", 1), ("{n}" * 341, "x" * 1_000_000)],
    ids=["format-spec", "repeated-field"],
)
def test_a_message_level_lock_key_costs_a_worker_no_more_than_its_size(
    make_stack: MakeStack, redis_server: EmbeddedRedis, caplog: Any, template: str, argument: Any
) -> None:
    """23 bytes asked a worker for 300 MB (and a 1 MB argument repeated by a 1 023-character template, for
    341 MB): a producer without the middleware (or anyone who can write to the broker) could OOM-kill every
    worker in turn with one message."""
    stack = make_stack()
    ran: list[int] = []

    @stack.actor(actor_name="charge", lock_key="invoice:{n}", max_retries=0)
    def charge(n: int) -> None:
        ran.append(n)

    stack.start()
    producer = RedisBroker(url=redis_server.url(0), middleware=[])  # type: ignore[no-untyped-call]
    bomb: dramatiq.Message[Any] = dramatiq.Message(
        queue_name="default", actor_name="charge", args=(argument,), kwargs={}, options={"lock_key": template}
    )
    tracemalloc.start()
    try:
        producer.enqueue(bomb)
        assert stack.recorder.wait_settled(bomb.message_id) == "nacked"  # dead-lettered, not run
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        producer.close()
    assert peak < 50 * 2**20, f"the worker allocated {peak / 2**20:.0f} MB for one message"
    assert ran == []
    assert any(
        r.levelname == "ERROR" and bomb.message_id in r.getMessage() and "lock_key" in r.getMessage()
        for r in caplog.records
    ), "no ERROR line names the refused message"


def test_message_level_templates_are_cached_within_bounds(make_stack: MakeStack) -> None:
    stack = make_stack()

    @stack.actor(actor_name="charge", lock_key="invoice:{n}")
    def charge(n: int) -> None:
        pass

    declarations = stack.leases_mw.declarations
    for i in range(5 * MESSAGE_TEMPLATE_CACHE):
        template = declarations.template("charge", {"lock_key": f"invoice:{i}:{{n}}"})
        assert template is not None and template.render((7,), {}) == f"invoice:{i}:7"
    assert len(declarations._message_templates) <= MESSAGE_TEMPLATE_CACHE


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


def test_retries_do_not_inherit_the_wait_clock(make_stack: MakeStack) -> None:
    waits: list[float] = []

    class Waits(LeaseMetrics):
        def wait(self, meta: Any, seconds: float) -> None:
            waits.append(seconds)

    stack = make_stack(lock_min_backoff=20, lock_max_backoff=60, metrics=Waits())
    runs = Runs()
    running = threading.Event()

    @stack.actor(
        actor_name="flaky", lock_key="r:{n}", lock_max_wait=300, max_retries=1, min_backoff=200, max_backoff=400
    )
    def flaky(n: int) -> None:
        runs.add(at=time.monotonic())
        if len(runs.items) == 1:
            running.set()
            time.sleep(0.7)  # work, longer than the wait budget
            raise RuntimeError("try again")

    stack.start()
    holder = stack.leases.try_acquire("r:1", ttl=10_000)
    assert not isinstance(holder, Busy)
    message = flaky.send(1)
    wait_for(lambda: stack.leases.inspect_line("r:1").length == 1, what="the first delivery to wait in line")
    assert stack.leases.release(holder)
    assert running.wait(10)
    # The moment the failed run releases, another holder takes the key (Retries waits >= 200 ms).
    rival = wait_for(
        lambda: stack.leases.try_acquire("r:1", ttl=10_000) or None, interval=0.005, what="the failed run to release"
    )
    assert isinstance(rival, Lease)  # for mypy: wait_for returns only a truthy value, and a Busy is falsy
    # The Retries copy is a new waiter, with a wait clock of its own: on its first delivery's clock it
    # would be given up at once (over 300 ms have passed).
    wait_for(
        lambda: (
            stack.leases.inspect_line("r:1").head == f"{message.message_id}:1"
            or message.message_id in stack.recorder.nacked
        ),
        what="the Retries copy to meet the busy key",
    )
    assert stack.leases.release(rival)
    assert stack.recorder.wait_settled(message.message_id) == "acked", "the retry was given up on its first clock"
    assert len(runs.items) == 2

    # What dramatiq_lease_wait_duration_seconds observes: both deliveries waited, neither for the 0.7 s run.
    assert len(waits) == 2 and all(w >= 0 for w in waits) and sum(waits) > 0, waits
    assert max(waits) < 0.5, f"a wait of over 0.5 s was observed (the 0.7 s run counted as waiting?): {waits}"


def test_waiting_in_place_stays_within_a_quarter_of_the_time_limit(make_stack: MakeStack) -> None:
    """TimeLimit counts the wait in the hook: past a quarter of the limit the message parks, never times out."""
    stack = make_stack()
    runs = Runs()

    @stack.actor(lock_key="report:{n}", time_limit=2_000, max_retries=0)
    def report(n: int) -> None:
        runs.add(n=n)

    stack.start()
    holder = stack.leases.try_acquire("report:1", ttl=30_000)
    assert isinstance(holder, Lease)
    message = report.send(1)
    wait_for(lambda: stack.leases.inspect_line("report:1").states.get("in_place") == 1, what="it waits in place")
    started = time.monotonic()
    wait_for(lambda: stack.recorder.delays(message.message_id), timeout=5, what="it to park")
    assert time.monotonic() - started < 1.5  # a quarter of 2 s, plus a round trip
    assert stack.leases.release(holder)
    # Never failed (max_retries=0: a TimeLimit in the hook would have dead-lettered it), run once.
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert runs.items == [{"n": 1}]


def test_the_front_of_a_line_never_takes_the_last_free_thread(make_stack: MakeStack) -> None:
    """The front of a line with no place here may wait in place past half the threads, but not in the last free
    one: with 3 threads, one running the key's holder and one waiting in place, it parks, and a message of
    another key that the worker took meanwhile runs at once instead of waiting behind them."""
    stack = make_stack(threads=3)
    holding, release = threading.Event(), threading.Event()
    runs = Runs()

    @stack.actor(lock_key="doc:{n}", max_retries=0)
    def edit(n: int, hold: bool) -> None:
        runs.add(n=n, hold=hold)
        if hold:
            holding.set()
            release.wait(30)

    stack.start()
    try:
        edit.send(1, True)
        assert holding.wait(10)
        behind = edit.send(1, False)
        wait_for(lambda: stack.leases.inspect_line("doc:1").states.get("in_place") == 1, what="a waiter in place")
        # First sent before the one in place (a copy sent back keeps its first attempt): the front of the line.
        front = edit.message(1, False).copy(options={FIRST_ATTEMPT_OPTION: int(time.time() * 1000) - 1_000})
        stack.broker.enqueue(front)
        wait_for(lambda: stack.recorder.delays(front.message_id), what="the front to park")
        edit.send(2, False)
        wait_for(lambda: {"n": 2, "hold": False} in runs.items, what="the other key's message to run meanwhile")
        assert {"n": 1, "hold": False} not in runs.items, "a waiter ran while the key was held"
    finally:
        release.set()
    for message in (behind, front):
        assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert sorted(r["n"] for r in runs.items) == [1, 1, 1, 2]


class Lane:
    """A live thread that runs what it is given, in turn: a thread id of its own, as each worker thread has."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self.results: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.results.put(job())

    def do(self, job: Callable[[], Any]) -> Any:
        self.jobs.put(job)
        return self.results.get(timeout=10)

    def end(self) -> None:
        self.jobs.put(None)
        self.thread.join(10)


def test_a_front_place_past_half_the_threads_needs_a_thread_left_free(leases: Leases) -> None:
    """Up to half a process's threads, the front of a line waits in place as any waiter does, however many threads
    run actors; past half, only while a thread is left neither running an actor nor waiting in place."""
    waiting = Waiting(leases)
    waiting.boot(StubBroker(), worker_threads=4)  # half: 2
    lanes = {name: Lane() for name in ("r1", "r2", "r3", "b", "c", "d", "e")}

    def reserve(name: str, *, front: bool = True) -> bool:
        return bool(lanes[name].do(lambda: waiting.reserve("k", name, front=front)))

    try:
        for name in ("r1", "r2", "r3"):
            lanes[name].do(waiting.running)
        assert reserve("b"), "a front waiter within half the threads was refused"
        assert reserve("c"), "a front waiter within half the threads was refused"
        assert not reserve("d"), "a front waiter past half took a place with no thread left free"
        for name in ("r1", "r2", "r3"):
            lanes[name].do(waiting.done_with_message)
        assert reserve("d"), "a front waiter past half was refused with a thread left free"
        assert not reserve("e", front=False), "a waiter not at the front took a place past half"
    finally:
        for lane in lanes.values():
            lane.end()
        waiting.shutdown()


def test_a_stray_copy_of_a_message_that_waited_and_ran_never_runs(make_stack: MakeStack) -> None:
    """A worker killed between parking a message and acknowledging it leaves two copies: one runs."""
    stack = make_stack()
    runs = Runs()

    @stack.actor(lock_key="invoice:{n}", max_retries=0)
    def charge(n: int) -> None:
        runs.add(n=n, fence=current_lease().fence)

    stack.start()
    holder = stack.leases.try_acquire("invoice:1", ttl=10_000)
    assert isinstance(holder, Lease)
    message = charge.send(1)
    wait_for(lambda: stack.leases.inspect_line("invoice:1").length == 1, what="the message to wait in line")
    assert stack.leases.release(holder)
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert len(runs.items) == 1
    # The copy a crash would have left in the broker (same id, same retry count): acknowledged, not run.
    stack.broker.enqueue(message.copy())
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert len(runs.items) == 1, "a stray copy of a message that ran ran again"
    # A retry (Retries: a new retry count) is a new waiter, and runs.
    stack.broker.enqueue(message.copy(options={"retries": 1}))
    wait_for(lambda: len(runs.items) == 2, what="the retry to run")


def test_a_spare_parked_copy_of_a_message_that_ran_is_dropped_without_being_sent_on(make_stack: MakeStack) -> None:
    stack = make_stack()
    runs = Runs()

    @stack.actor(lock_key="invoice:{n}", max_retries=0)
    def charge(n: int) -> None:
        runs.add(n=n)

    stack.start()
    holder = stack.leases.try_acquire("invoice:7", ttl=10_000)
    assert isinstance(holder, Lease)
    message = charge.send(7)
    wait_for(lambda: stack.leases.inspect_line("invoice:7").states.get("in_place") == 1, what="it to wait in place")
    # A spare copy, parked (as a worker killed between parking and acknowledging would leave it).
    stack.broker.enqueue(message.copy(options={"lease_line": "invoice:7"}), delay=300_000)
    waiting = stack.leases_mw.waiting
    wait_for(lambda: waiting.parked == 1, what="the spare copy to be registered by this process")
    assert stack.leases.release(holder)
    wait_for(lambda: len(runs.items) == 1, what="the message to run")
    # Released: the release remembers its waiter as having run (the run itself comes first, and a check in
    # between may rightly send the spare on, to be dropped at its delivery).
    wait_for(lambda: not stack.leases.holders("invoice:7"), what="the message's release")
    sent = len(stack.recorder.enqueues)
    waiting.tend()  # what the periodic check does: the spare's waiter ran, so it is dropped here
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert len(stack.recorder.enqueues) == sent, "the spare was sent on instead of dropped"
    assert len(runs.items) == 1


def test_a_failed_message_redriven_from_the_dead_letter_queue_runs_again(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    stack = make_stack()
    attempts = Runs()

    @stack.actor(lock_key="invoice:{n}", max_retries=0)
    def charge(n: int) -> None:
        attempts.add(n=n)
        if attempts.count() == 1:
            raise RuntimeError("the billing API is down")

    stack.start()
    holder = stack.leases.try_acquire("invoice:1", ttl=10_000)
    assert isinstance(holder, Lease)
    message = charge.send(1)
    wait_for(lambda: stack.leases.inspect_line("invoice:1").length == 1, what="the message to wait in line")
    assert stack.leases.release(holder)
    assert stack.recorder.wait_settled(message.message_id) == "nacked"
    [dead] = redis_dead_letters(redis_server)
    assert (dead.message_id, dead.options.get("retries", 0)) == (message.message_id, 0)

    # The operator fixes the cause and moves the dead letter back to its queue: same id, same retry count.
    stack.broker.enqueue(dead)
    wait_for(lambda: attempts.count() == 2, what="the re-driven message to run")


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


# A lease handed over by a producer ---------------------------------------------------


def test_a_handed_over_lease_is_adopted_once(make_stack: MakeStack) -> None:
    stack = make_stack(lock_min_backoff=20, lock_max_backoff=60)
    runs = Runs()
    started, go = threading.Event(), threading.Event()

    @stack.actor(lock_key="export:{user_id}", lock_ttl=2_000, max_retries=0)
    def export(user_id: int) -> None:
        begin = time.monotonic()
        fence = current_lease().fence
        runs.add(started=begin)
        started.set()
        go.wait(10)
        runs.add(start=begin, end=time.monotonic(), fence=fence)

    stack.start()
    lease = stack.leases.try_acquire("export:7", ttl=10_000)  # the web request
    assert not isinstance(lease, Busy)
    message = export.message_with_options(args=(7,), lease=lease)
    stack.broker.enqueue(message)  # the producer sends the same message twice
    stack.broker.enqueue(message)
    assert started.wait(10)
    # The worker adopted it: the producer's token no longer owns the key, and cannot end the run's hold.
    assert stack.leases.release(lease) is False
    info = stack.leases.inspect("export:7")
    assert info is not None and info.token != lease.token and info.fence == lease.fence
    # The second delivery waits in the key's line like any message, not polling with backoff for the whole hold.
    wait_for(lambda: stack.leases.inspect_line("export:7").length == 1, what="the second delivery to join the line")
    assert sum("started" in r for r in runs.items) == 1, "the second delivery ran while the first held the lease"
    go.set()
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert len(stack.recorder.delays(message.message_id)) <= 3, "a waiting message cost more than 3 enqueues"
    spans = sorted((r["start"], r["end"], r["fence"]) for r in runs.items if "end" in r)
    assert len(spans) == 2, spans
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), (
        f"two runs of one handed-over lease overlapped: {spans}"
    )
    assert spans[0][2] == lease.fence < spans[1][2]  # the first adopted the grant; the second was granted anew
    wait_for(lambda: list(stack.leases.scan()) == [], what="the last release (sent off the worker thread)")


def test_an_adopted_lease_honours_lock_max_hold(make_stack: MakeStack) -> None:
    stack = make_stack()
    runs = Runs()

    @stack.actor(lock_key="hung:{n}", lock_ttl=600, lock_max_hold=1_000, max_retries=0)
    def hung(n: int) -> None:
        begin, fence = time.monotonic(), current_lease().fence
        try:
            while time.monotonic() - begin < 8:  # hung, but bounded so that a failure ends
                time.sleep(0.01)
        except LeaseLost as e:
            runs.add(after=time.monotonic() - begin, error=str(e), fence=fence)
            raise
        runs.add(after=time.monotonic() - begin, error=None, fence=fence)

    stack.start()
    lease = stack.leases.try_acquire("hung:1", ttl=5_000)  # no max hold of its own
    assert not isinstance(lease, Busy)
    message = hung.send_with_options(args=(1,), lease=lease)
    assert stack.recorder.wait_settled(message.message_id, timeout=15) == "nacked"
    [run] = runs.items
    assert run["fence"] == lease.fence, "the handed-over lease was not adopted"
    assert run["error"] is not None and "max_hold" in run["error"], f"renewed past lock_max_hold: {run}"
    assert 0.8 <= run["after"] < 1.8, run
    wait_for(lambda: stack.leases.inspect("hung:1") is None, timeout=2, what="the adopted lease to end")


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


@pytest.mark.parametrize("error", [redis.exceptions.RedisClusterException("slot not covered"), RuntimeError("boom")])
def test_nothing_after_a_completed_actor_fails_it(
    make_stack: MakeStack, redis_server: EmbeddedRedis, error: Exception
) -> None:
    stack = make_stack()
    backend = RedisBackend(url=redis_server.url(2))
    stack.broker.add_middleware(Results(backend=backend))  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    runs = Runs()
    calls: list[str] = []

    def failing_release(key: str, token: str, **_: Any) -> bool:
        calls.append(key)
        raise error

    stack.leases_mw.leases.release_token = failing_release  # type: ignore[method-assign]

    @stack.actor(lock_key="done:{n}", store_results=True, max_retries=3, min_backoff=10, max_backoff=20)
    def done(n: int) -> int:
        runs.add(n=n)
        return n * 6

    stack.start()
    message = done.send(7)
    assert message.get_result(backend=backend, block=True, timeout=10_000) == 42
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    # Sent by the releaser thread, which may come to it after the ack.
    wait_for(lambda: calls, what="the release to be attempted")
    assert len(runs.items) == 1
    assert [mid for mid, _, _ in stack.recorder.enqueues if mid == message.message_id] == [message.message_id]


# A worker's stop ---------------------------------------------------------------------


def test_shutdown_keeps_the_lease_of_an_actor_still_running(make_stack: MakeStack) -> None:
    stack = make_stack(threads=2)
    runs = Runs()
    started, go = threading.Event(), threading.Event()

    @stack.actor(lock_key="quick:{n}")
    def quick(n: int) -> None:
        runs.add(kind="quick")

    @stack.actor(lock_key="stuck:{n}", lock_ttl=900, max_retries=0)
    def stuck(n: int) -> None:
        started.set()
        begin = time.monotonic()
        while not go.is_set() and time.monotonic() - begin < 15:
            time.sleep(0.01)
        runs.add(kind="stuck-done")

    stack.start()
    assert stack.recorder.wait_settled(quick.send(1).message_id) == "acked"
    stuck.send(1)
    assert started.wait(10)
    worker, stack.worker = stack.worker, None
    assert worker is not None
    worker.stop(timeout=500)
    try:
        assert not runs.where(kind="stuck-done"), "the actor was expected to outlive the stop timeout"
        assert [i.key for i in stack.leases.scan()] == ["stuck:1"]  # the finished actor's lease is gone
        # Held, and renewed, for three TTLs after shutdown returned: nobody else may run stuck:1.
        assert busy_for(stack.leases, "stuck:1", 2.7), "the lease of a still-running actor was released at shutdown"
        assert not runs.where(kind="stuck-done")
    finally:
        go.set()
    wait_for(lambda: runs.where(kind="stuck-done"), what="the actor to finish")
    wait_for(lambda: list(stack.leases.scan()) == [], timeout=5, what="its lease to be released")


def test_shutdown_wakes_the_threads_waiting_in_place_and_loses_no_message(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    first = make_stack()
    runs = Runs()

    def declare(stack: Stack) -> Any:
        @stack.actor(actor_name="export", lock_key="export:{n}", max_retries=0)
        def export(n: int, i: int) -> None:
            runs.add(i=i)

        return export

    export = declare(first)
    first.start()
    holder = first.leases.try_acquire("export:1", ttl=30_000)
    assert isinstance(holder, Lease)
    messages = [export.send(1, i) for i in range(2)]
    wait_for(
        lambda: first.leases.inspect_line("export:1").states.get("in_place") == 2, what="two threads waiting in place"
    )
    started = time.monotonic()
    first.stop()
    assert time.monotonic() - started < 5, "the shutdown waited for the threads waiting in place"
    assert all(first.recorder.delays(m.message_id) for m in messages), "each waiter was parked on the way out"

    # Another worker on the same broker and lease store: they run once the key is free, once each.
    second = make_stack(broker=taking_over_broker(redis_server.url(0)))
    declare(second)
    second.start()
    assert second.leases.release(holder)
    wait_for(lambda: sorted(r["i"] for r in runs.items) == [0, 1], timeout=20, what="both messages to run")
    assert len(runs.items) == 2


class SlowReplies(Middleware):
    """A broker slow to answer: a delayed copy (a parked or sent-back message) is in the broker, and the
    worker thread that sent it still waits for the reply, for ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.waiting = 0

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        if delay is None:
            return
        with self.lock:
            self.waiting += 1
        try:
            end = time.monotonic() + self.seconds
            while time.monotonic() < end:  # the reply's wait; an interruption lands here, as in a socket read
                time.sleep(0.005)
        finally:
            with self.lock:
                self.waiting -= 1


def test_a_worker_stop_while_copies_are_sent_back_runs_each_message_once(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    runs = Runs()

    def declare(stack: Stack) -> Any:
        @stack.actor(actor_name="invoice", lock_key="invoice:{n}", notify_shutdown=True, max_retries=3)
        def invoice(n: int, i: int) -> None:
            runs.add(i=i, fence=current_lease().fence)

        return invoice

    first = make_stack(threads=8)
    slow = SlowReplies(1.5)
    first.broker.add_middleware(slow)
    invoice = declare(first)
    first.start()
    holder = first.leases.try_acquire("invoice:1", ttl=60_000)
    assert isinstance(holder, Lease)
    for i in range(8):
        invoice.send(1, i)
    # Two wait in place; the others are parked, each thread waiting for the broker's reply to its copy.
    wait_for(lambda: slow.waiting >= 4, what="threads waiting for the broker's reply to a parked copy")
    first.stop()  # Dramatiq raises Shutdown into every thread running a notify_shutdown message
    assert runs.items == []

    second = make_stack(threads=8, broker=taking_over_broker(redis_server.url(0)))
    declare(second)
    second.start()
    assert second.leases.release(holder)
    wait_for(lambda: len({r["i"] for r in runs.items}) == 8, timeout=30, what="every message to run")
    # Settled: every copy left in the broker was delivered (and acknowledged), none left to run late.
    wait_for(lambda: pending(redis_server) == 0, timeout=30, what="the broker to hold no copy")
    ran = sorted(r["i"] for r in runs.items)
    assert ran == list(range(8)), f"a message ran twice: {ran}"
    assert redis_dead_letters(redis_server) == [], "a message was dead-lettered by the stop"
    retried = [o for mid, _, o in first.recorder.enqueues if o.get("retries")]
    assert retried == [], "an interruption before the actor reached Retries: a retry with a new place"


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
@pytest.mark.parametrize("confirm_delivery", [True, False])
def test_rabbitmq_broker(lease_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture, confirm_delivery: bool) -> None:
    """Leased runs one at a time on RabbitMQ; a broker without publisher confirms, which can lose the copies the
    middleware sends on, is named at the worker's boot."""
    queue = f"leases-test-{uuid.uuid4().hex[:8]}"
    broker = RabbitmqBroker(url=RABBITMQ_URL, confirm_delivery=confirm_delivery)
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
    warned = [r for r in caplog.records if "without confirm_delivery=True" in r.getMessage()]
    assert [r.levelno for r in warned] == ([] if confirm_delivery else [logging.WARNING])


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


def test_an_async_actor_that_outlives_its_cancellation_keeps_its_lease(make_stack: MakeStack) -> None:
    """Dramatiq stops waiting for a coroutine 1 s after cancelling it; the coroutine may run on.

    Its lease must stay held (and renewed) until the coroutine really ends, then be released.
    """
    stack = make_stack()
    stack.broker.add_middleware(AsyncIO())
    runs = Runs()

    @stack.actor(lock_key="async:{n}", lock_ttl=600, lock_max_hold=20_000, time_limit=500, max_retries=0)
    async def stubborn(n: int) -> None:
        begin = time.monotonic()
        while time.monotonic() - begin < 3.0:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                runs.add(kind="cancelled", at=time.monotonic())  # ignored: it goes on working
        runs.add(kind="ended", at=time.monotonic())

    stack.start()
    message = stubborn.send(1)
    wait_for(lambda: runs.where(kind="cancelled"), what="the time limit to cancel the coroutine", timeout=5)
    assert stack.recorder.wait_settled(message.message_id) == "nacked"  # the worker gave up waiting
    assert not runs.where(kind="ended")
    # The coroutine still runs: its key stays busy past several TTLs, until it ends.
    deadline = time.monotonic() + 10
    while not runs.where(kind="ended"):
        assert isinstance(stack.leases.try_acquire("async:1", ttl=1_000), Busy), "a second holder while it ran"
        assert time.monotonic() < deadline, "the coroutine never ended"
        time.sleep(0.05)  # a rival tries every 50 ms
    wait_for(lambda: stack.leases.inspect("async:1") is None, what="the lease to be released as it ended")


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
