"""The line of a busy key, at the core: order, wake-ups, promotions, strays and vanished waiters.

Real Redis, real scripts; the middleware's use of them is tested in test_wait_line.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from dramatiq_leases.core import Busy, Lease, Leases
from dramatiq_leases.core.protocol import Turn, Wait

from .support.scriptcalls import grant_call
from .support.stack import MakeLeases
from .support.waiting import wait_for

TTL = 10_000


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """Keys under the prefix ``t`` (the tests read them by name)."""
    return make_leases(prefix="t")


def join(
    leases: Leases,
    key: str,
    waiter: str,
    first_ms: int,
    *,
    may_wait: bool = False,
    ready: int = 2,
    promote_ms: int = 10_000,
) -> Lease | Turn:
    return leases.line.join(
        key, TTL, waiter=waiter, first_ms=first_ms, may_wait=may_wait, ready=ready, promote_ms=promote_ms
    )


def busy(reply: Lease | Turn) -> Turn:
    assert isinstance(reply, Turn), reply
    return reply


def test_a_free_key_goes_to_the_head_of_its_line_in_first_attempt_order(leases: Leases) -> None:
    holder = leases.try_acquire("k", TTL)
    assert isinstance(holder, Lease)
    # Joined out of order; the line orders them by first attempt.
    for waiter, first in [("c", 300), ("a", 100), ("b", 200)]:
        busy(join(leases, "k", waiter, first))
    assert [busy(join(leases, "k", w, f)).place for w, f in [("a", 100), ("b", 200), ("c", 300)]] == [0, 1, 2]
    assert leases.release(holder)
    # Nobody but the head may take the free key: not a newcomer, not a caller outside the line, not the second.
    assert busy(join(leases, "k", "d", 50_000)).place == 3
    assert type(leases.try_acquire("k", TTL)) is Busy  # busy, outside the line
    assert isinstance(join(leases, "k", "b", 200), Turn)
    order = []
    for waiter, first in [("a", 100), ("b", 200), ("c", 300), ("d", 50_000)]:
        lease = join(leases, "k", waiter, first)
        assert isinstance(lease, Lease), waiter
        order.append(waiter)
        assert lease.handoff is not None and lease.handoff >= 0
        leases.line.release("k", lease.token, waiter=waiter)
    assert order == ["a", "b", "c", "d"]
    assert leases.try_acquire("k", TTL)  # the line is empty again: anyone may take it


def test_release_wakes_the_head_waiting_in_place(leases: Leases) -> None:
    holder = leases.try_acquire("k", TTL)
    assert isinstance(holder, Lease)
    answer = busy(join(leases, "k", "w", 1, may_wait=True))
    assert answer.wait is Wait.IN_PLACE and 0 < answer.block_ms <= 10_000
    woken: list[float] = []
    waiter = threading.Thread(
        target=lambda: woken.append(time.monotonic()) if leases.line.wait_turn("k", "w", answer.block_ms) else None
    )
    waiter.start()
    time.sleep(0.05)  # let it block: a wake-up before the block is kept in the list anyway
    released = time.monotonic()
    assert leases.release(holder)
    waiter.join(5)
    assert woken and woken[0] - released < 0.5
    assert isinstance(join(leases, "k", "w", 1, may_wait=True), Lease)


def test_only_the_first_ready_waiters_wait_in_place(leases: Leases) -> None:
    assert leases.try_acquire("k", TTL)
    waits = [busy(join(leases, "k", f"w{i}", i + 1, may_wait=True, ready=2)).wait for i in range(4)]
    assert waits == [Wait.IN_PLACE, Wait.IN_PLACE, Wait.PARK, Wait.PARK]
    # Near the head but not allowed to block: asked to come again soon.
    assert busy(join(leases, "k", "w0", 1, may_wait=False, ready=2)).wait is Wait.SOON


def test_a_parked_waiter_is_promoted_on_its_holders_channel_when_its_turn_nears(
    leases: Leases, redis_client: redis.Redis
) -> None:
    holder = leases.try_acquire("k", TTL)
    assert isinstance(holder, Lease)
    for i in range(3):
        assert busy(join(leases, "k", f"w{i}", i + 1, ready=1)).wait in (Wait.PARK, Wait.SOON)
    assert leases.line.hold("k", ["w1", "w2"], "chan:x", park_ms=60_000, ready=1) == ["p", "p"]
    pubsub = redis_client.pubsub()
    pubsub.subscribe("chan:x")
    wait_for(lambda: pubsub.get_message(timeout=0.1) is not None, what="the subscription")
    # w0 (head, asked to come soon) takes the key: w1 is next, and told so.
    lease = join(leases, "k", "w0", 1, ready=1)
    assert isinstance(lease, Turn)  # still held by holder
    assert leases.release(holder)
    lease = join(leases, "k", "w0", 1, ready=1)
    assert isinstance(lease, Lease)
    message: Any = wait_for(lambda: pubsub.get_message(timeout=0.1), what="a promotion")
    assert message["data"] == b"w1"
    assert leases.line.hold("k", ["w1", "w2"], "chan:x", park_ms=60_000, ready=1) == ["m", "p"]
    pubsub.close()


def test_a_grant_says_whether_it_came_from_the_line(leases: Leases) -> None:
    """A copy that finds its waiter at the head (say a redelivery of a message that parked) must be told."""
    direct = leases.line.join("k", TTL, waiter="a", may_wait=True)
    assert isinstance(direct, Lease) and not direct.from_line
    busy(join(leases, "k", "b", 1))
    leases.release_token("k", direct.token)
    lead = join(leases, "k", "b", 0)  # no first attempt of its own, as a redelivered original carries none
    assert isinstance(lead, Lease) and lead.from_line


def test_a_waiter_in_place_past_its_deadline_is_not_waiting_any_more(leases: Leases) -> None:
    """Its parked copy (a shutdown parked it) must not be kept as a spare for five minutes."""
    assert leases.try_acquire("k", 60_000)  # held throughout
    answer = busy(join(leases, "k", "w", 1, may_wait=True))
    assert answer.wait is Wait.IN_PLACE
    assert leases.line.hold("k", ["w"], "chan:x", park_ms=60_000, ready=2) == ["r"]
    wait_for(
        lambda: leases.line.hold("k", ["w"], "chan:x", park_ms=60_000, ready=2) != ["r"],
        timeout=answer.block_ms / 1000 + 5,
        what="the waiter in place to pass its deadline",
    )
    assert leases.line.hold("k", ["w"], "chan:x", park_ms=60_000, ready=2) == ["p"]


def test_a_waiter_that_ran_never_runs_again(leases: Leases) -> None:
    holder = leases.try_acquire("k", TTL)
    assert isinstance(holder, Lease)
    busy(join(leases, "k", "w", 1))
    assert leases.release(holder)
    lease = join(leases, "k", "w", 1)
    assert isinstance(lease, Lease)
    leases.line.release("k", lease.token, waiter="w")
    # A stray copy of the same message (a duplicate delivery, a parked copy left behind).
    assert busy(join(leases, "k", "w", 1)).wait is Wait.DUPLICATE
    assert leases.line.hold("k", ["w"], "chan:x", park_ms=60_000, ready=1) == ["d"]


def test_a_vanished_waiter_loses_its_place_after_its_deadline(leases: Leases) -> None:
    holder = leases.try_acquire("k", TTL)
    assert isinstance(holder, Lease)
    busy(join(leases, "k", "gone", 1, ready=1, promote_ms=300))  # near the head, never comes back
    busy(join(leases, "k", "next", 2, ready=1, promote_ms=300))
    assert leases.line.release("k", holder.token, promote_ms=300)
    assert isinstance(join(leases, "k", "next", 2, ready=1, promote_ms=300), Turn)  # "gone" still has its turn
    lease = wait_for(
        lambda: join(leases, "k", "next", 2, ready=1, promote_ms=300) or None,
        timeout=3,
        what="the vanished head to lose its place",
    )
    assert isinstance(lease, Lease)
    # Back later, it takes its place again by its first attempt: first in line.
    assert busy(join(leases, "k", "gone", 1, ready=1)).place == 0


def test_a_waiter_who_gives_up_leaves_and_the_next_is_woken(leases: Leases) -> None:
    assert leases.try_acquire("k", TTL)
    busy(join(leases, "k", "a", 1))
    busy(join(leases, "k", "b", 2))
    assert leases.line.leave("k", ["a", "nobody"], ready=2) == 1
    assert busy(join(leases, "k", "b", 2)).place == 0


def test_hold_reports_waiters_without_a_place(leases: Leases, redis_client: redis.Redis) -> None:
    assert leases.try_acquire("k", TTL)
    busy(join(leases, "k", "a", 1))
    redis_client.flushdb()  # the lease store lost everything, say a restart without persistence
    assert leases.line.hold("k", ["a"], "chan:x", park_ms=60_000, ready=2) == ["x"]


def test_no_line_key_is_left_without_ttl(leases: Leases, redis_client: redis.Redis) -> None:
    holder = leases.try_acquire("k", TTL)
    assert isinstance(holder, Lease)
    busy(join(leases, "k", "a", 1, may_wait=True))
    busy(join(leases, "k", "b", 2))
    leases.line.hold("k", ["b"], "chan:x", park_ms=60_000, ready=2)
    leases.release(holder)
    lease = join(leases, "k", "a", 1)
    assert isinstance(lease, Lease)
    leases.line.release("k", lease.token, waiter="a")
    for name in redis_client.scan_iter("t:*"):
        if not name.startswith((b"t:fence:", b"t:epoch:")):  # kept for ever by design
            assert redis_client.pttl(name) > 0, name


@pytest.mark.parametrize(
    "named",
    [
        {"mode": "1"},  # joining without a waiter id
        {"waiter": "w", "first_ms": "-1"},
        {"waiter": "w", "mode": "3"},
        {"waiter": "w", "park_ms": "0"},
        {"waiter": "w", "promote_ms": "0"},
        {"waiter": "w", "ready": "x"},
        {"waiter": "w", "retention_ms": "-1"},
        {"waiter": "w", "retention_ms": "10000000000000"},
        {"waiter": "w", "first_ms": "1.5"},
        {"waiter": "w", "policy": "3"},
    ],
)
def test_the_acquire_script_checks_its_line_arguments_before_writing(
    redis_client: redis.Redis, named: dict[str, Any]
) -> None:
    """Every argument is checked before the first write, those only a busy key's answer reads too."""
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid"):
        redis_client.eval(*grant_call(**named))
    assert redis_client.keys("*") == []


class Interrupted(BaseException):
    """Stands for Dramatiq's asynchronous exceptions (a ``BaseException``), landing just after a send."""


class InterruptAfterBlpop(redis.Connection):
    """A real connection that is interrupted between sending ``BLPOP`` and reading its reply, once armed."""

    armed = False

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        super().send_command(*args, **kwargs)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        if args and args[0] == "BLPOP" and InterruptAfterBlpop.armed:
            InterruptAfterBlpop.armed = False
            raise Interrupted


def test_a_wait_interrupted_before_its_reply_leaves_no_reply_for_the_next_caller(redis_server: Any) -> None:
    """Without a thread's own connection (a Cluster's client, thread_connections=False), the wait in place uses
    a pooled connection: interrupted between the command and its reply, that connection must not go back to
    the pool with the BLPOP reply unread, for the next caller to take as its own."""
    pool = redis.ConnectionPool(connection_class=InterruptAfterBlpop, port=redis_server.port, socket_timeout=5)
    client = redis.Redis(connection_pool=pool)
    try:
        leases = Leases(client)
        client.set("answer", "42")
        InterruptAfterBlpop.armed = True
        with pytest.raises(Interrupted):
            leases.line.wait_turn("k", "w1", 200)
        assert client.get("answer") == b"42", "the next caller read the interrupted BLPOP's reply"
    finally:
        client.close()
        pool.disconnect()
