"""Promises a third hostile review found broken, each kept by a test on real Redis and a real Dramatiq Worker.

1. A worker stop never runs a message twice, nor runs it and dead-letters it: an interruption while a busy
   message's copy is being sent back (the copy already in the broker, the reply not yet read) ends with
   one copy, and a thread waiting for its lease goes back with its place, not as a Retries retry.
2. A failed message re-driven from the dead-letter queue runs again (it is not taken for a copy of one
   that ran).
3. A message-level ``lock_key`` costs no more than its own size: format specs, conversions and
   attribute or index access are refused, before any work, at send time and in the worker.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware

from dramatiq_leases import LeaseOptionError, current_lease
from dramatiq_leases.core import Lease
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.middleware.declarations import MESSAGE_TEMPLATE_CACHE

from .support.brokers import pending, redis_dead_letters
from .support.runs import Runs
from .support.stack import MakeStack, Stack, taking_over_broker
from .support.waiting import wait_for

# 1. A worker stop --------------------------------------------------------------------------------------------


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


# 2. Re-driving a dead letter -------------------------------------------------------------------------------


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


# 3. Message-level keys -------------------------------------------------------------------------------------


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
