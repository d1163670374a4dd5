"""``lock_on_busy="latest"`` orders a key's messages by their send (issue 27 item 4), and only latest pays for it.

The send order (``lua/order.lua``, ``Line.send_order``), the acquire's latest build (``scripts.ACQUIRE_LATEST``:
its arguments, its order record), the plain build's cost (none of it: the same Redis commands as before), and
the middleware's option (``lease_order``): stamped at send, checked at send and at the worker. Real Redis, real
scripts, a real Worker. The same across worker processes with prefetch and a SIGKILL:
tests/test_limit_policies_workers.py (``test_latest_*``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker

from dramatiq_leases import LeaseOptionError, web
from dramatiq_leases.core import Lease, Leases, scripts
from dramatiq_leases.core.client import RedisClient
from dramatiq_leases.core.errors import LeaseConfigError
from dramatiq_leases.core.keys import DEFAULT_PREFIX, fence_name, lease_name, order_name
from dramatiq_leases.core.protocol import Turn, Wait
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.middleware.options import ORDER_OPTION

from .support.scriptcalls import grant_call
from .support.stack import MakeLeases, MakeStack, Stack
from .support.waiting import wait_for

TTL = 10_000


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """Keys under the prefix ``t`` (the tests read them by name)."""
    return make_leases(prefix="t")


def server_us(client: RedisClient) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def join(leases: Leases, waiter: str, order: int, **options: Any) -> Lease | Turn:
    return leases.line.join("k", TTL, waiter=waiter, latest=True, order=order, may_wait=True, **options)


def refused(reply: Lease | Turn) -> Turn:
    assert isinstance(reply, Turn), reply
    return reply


# The send order ----------------------------------------------------------------------------------------------


def test_send_orders_follow_the_servers_clock_and_only_grow(leases: Leases, redis_client: redis.Redis) -> None:
    """Two sends in one microsecond still differ; an order that reached the lease (any producer's clock, up to
    ORDER_AHEAD_MS ahead) is below every order handed out after it; the record lives ORDER_MS."""
    before = server_us(redis_client)
    orders = [leases.line.send_order("k") for _ in range(50)]
    assert orders == sorted(set(orders)) and orders[0] >= before
    ahead = server_us(redis_client) + 30_000_000  # a producer's clock half a minute ahead, reaching the lease
    assert isinstance(join(leases, "fast:0", ahead), Lease)
    assert leases.line.send_order("k") > ahead  # sent after it: newer, whatever the clocks say
    assert leases.line.send_order("other") < ahead  # another key has its own
    pttl = redis_client.pttl(order_name("t", "k"))
    assert scripts.ORDER_MS - 5_000 < pttl <= scripts.ORDER_MS


def test_an_order_far_ahead_counts_as_order_ahead_ms_ahead(leases: Leases, redis_client: redis.Redis) -> None:
    before = server_us(redis_client)
    assert isinstance(join(leases, "future:0", scripts.MAX_ORDER), Lease)
    seen = int(redis_client.hget(order_name("t", "k"), "seen") or 0)
    assert before + scripts.ORDER_AHEAD_MS * 1000 <= seen <= server_us(redis_client) + scripts.ORDER_AHEAD_MS * 1000
    assert leases.line.send_order("k") == seen + 1


def test_an_order_record_of_another_type_is_replaced_with_a_ttl(leases: Leases, redis_client: redis.Redis) -> None:
    record = order_name("t", "k")
    redis_client.set(record, "written by hand")
    assert leases.line.send_order("k") > 0
    assert redis_client.type(record) == b"hash" and redis_client.pttl(record) > 0
    redis_client.delete(record)
    redis_client.set(record, "written by hand")
    assert isinstance(join(leases, "m:0", 5), Lease)  # read as no record, then written over
    assert redis_client.hget(record, "seen") == b"5" and redis_client.pttl(record) > 0


# The latest build of acquire ---------------------------------------------------------------------------------


def test_an_older_message_supersedes_itself_wherever_it_meets_the_key(leases: Leases) -> None:
    """Free, held or lined: a message sent before the newest that reached the lease never runs after it. A copy
    of a message whose own grant still holds is told to ask again, not superseded (it is not older than itself);
    a retry of the newest is the newest still."""
    first = join(leases, "new:0", 200)
    assert isinstance(first, Lease)
    stale = refused(join(leases, "old:0", 100))  # held by a newer one
    assert (stale.wait, stale.newer) == (Wait.SUPERSEDED, "new")
    assert refused(join(leases, "new:0", 200, token="copy")).wait is Wait.COPY_HOLDS  # its own copy: ask again
    assert leases.release(first)
    again = refused(join(leases, "old:1", 100))  # free, and a retry of old: still older
    assert (again.wait, again.newer) == (Wait.SUPERSEDED, "new")
    assert isinstance(join(leases, "new:1", 200), Lease)  # the newest's retry runs
    assert leases.line.hold("k", ["old:0", "old:1"], "chan:x") == ["s", "s"]
    tie = refused(join(leases, "a:0", 200))  # the same order, another message: the smaller id is the older
    assert tie.wait is Wait.SUPERSEDED


def test_a_store_that_forgets_the_order_record_lets_an_older_message_run(
    leases: Leases, redis_client: redis.Redis
) -> None:
    """The limit (docs/guarantees.md): the newest order that reached a key lives in Redis only. A store that
    forgets it (a restart without persistence, as FLUSHALL leaves it; a failover to a replica that missed it; a
    week without a message of the key) no longer knows a newer message ran: an older one then runs after it."""
    newest = join(leases, "new:0", 200)
    assert isinstance(newest, Lease) and leases.release(newest)
    assert refused(join(leases, "old:0", 100)).wait is Wait.SUPERSEDED
    redis_client.flushall()
    assert isinstance(join(leases, "old:1", 100), Lease)  # the older revision runs after the newer one


def test_the_latest_build_checks_each_argument_before_writing(redis_client: redis.Redis) -> None:
    latest: dict[str, Any] = {"waiter": "m:0", "mode": 2, "policy": 1}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"order": 0}, "order"),
        ({"order": scripts.MAX_ORDER + 1}, "order"),
        ({"mode": 0}, "policy"),  # latest never refuses without joining
    ]
    for named, refused_as in cases:
        with pytest.raises(redis.ResponseError, match=f"invalid {refused_as}"):
            redis_client.eval(*grant_call(**{**latest, **named}))
    with pytest.raises(redis.ResponseError, match="invalid key count 4"):
        redis_client.eval(*grant_call(**latest, keys=[lease_name("t", "k"), fence_name("t", "k"), "l", "d"]))
    assert redis_client.keys("*") == []  # refused before the first write
    assert redis_client.eval(*grant_call(**latest, order=scripts.MAX_ORDER))[0] == 1


def test_the_plain_build_carries_nothing_of_latest_and_refuses_it(redis_client: redis.Redis) -> None:
    """Pay only for what you use: the acquire every other actor runs has no line of the order record's, and
    a plain acquire and release run the Redis commands they ran before latest was ordered by send."""
    plain, latest = (re.sub(r"--[^\n]*", "", s) for s in (scripts.ACQUIRE, scripts.ACQUIRE_LATEST))  # the code
    for marker in ("KEYS[6]", "ORDER_", "note_order", "supersede", "newest_by"):
        assert marker not in plain and marker in latest, marker
    with pytest.raises(redis.ResponseError, match="invalid policy"):
        redis_client.eval(*grant_call(waiter="w", mode=2, order=1, policy=1, script=scripts.ACQUIRE))
    leases = Leases(redis_client, prefix="t", failover_grace=0)  # its commands: tests/test_protocol.py
    for i in range(3):  # warm: the scripts loaded
        warm = leases.try_acquire(f"w{i}", TTL)
        assert isinstance(warm, Lease) and leases.release(warm)
    redis_client.config_resetstat()
    for i in range(10):
        lease = leases.try_acquire(f"k{i}", TTL)
        assert isinstance(lease, Lease) and leases.release(lease)
    calls = {
        name.removeprefix("cmdstat_"): stat["calls"] / 10
        for name, stat in redis_client.info("commandstats").items()
        if name not in ("cmdstat_config|resetstat", "cmdstat_config", "cmdstat_info")
    }
    # The plain path (issue 28): one acquire, one release (tests/test_protocol.py has each option's).
    expected = {"evalsha": 2, "time": 1, "hmget": 2, "exists": 2, "hset": 3, "pexpire": 1, "del": 1}
    assert calls == expected
    assert redis_client.keys("t:order:*") == []


def test_the_loader_refuses_an_unmatched_variant_block() -> None:
    sections = {"args": "local function whole() end\n"}
    assert scripts._build("-- KEYS:\n--#if a\nx()\n--#else\ny()\n--#end\n", sections, frozenset("a")).endswith("x()\n")
    assert scripts._build("-- KEYS:\n--#if a\nx()\n--#else\ny()\n--#end\n", sections).endswith("y()\n")
    for body in ("--#if a\nx()\n", "--#if a\n--#if b\n--#end\n--#end\n", "--#else\n"):
        with pytest.raises(ValueError, match="unmatched"):
            scripts._build("-- KEYS:\n" + body, sections)


def test_store_refuses_a_latest_waiter_without_a_whole_order(leases: Leases, redis_client: redis.Redis) -> None:
    for order in (None, 0, -1, scripts.MAX_ORDER + 1, 1.5, True, "12"):
        with pytest.raises(LeaseConfigError, match="needs an order"):
            leases.line.join("k", TTL, waiter="m:0", latest=True, order=order)  # type: ignore[arg-type]
    assert redis_client.keys("*") == []


# The middleware's option --------------------------------------------------------------------------------------


def latest_actor(stack: Stack, ran: list[int]) -> Any:
    @stack.actor(actor_name="reindex", lock_key="doc:{doc}", lock_on_busy="latest", max_retries=0)
    def reindex(doc: int, n: int) -> None:
        ran.append(n)

    return reindex


def test_a_latest_send_takes_an_order_from_redis_and_others_none(make_stack: MakeStack) -> None:
    stack = make_stack()
    reindex = latest_actor(stack, [])

    @stack.actor(actor_name="plain", lock_key="doc:{doc}")
    def plain(doc: int) -> None:
        pass

    before = server_us(stack.leases.client)
    orders = [reindex.send(1, n).options[ORDER_OPTION] for n in range(20)]
    assert orders == sorted(set(orders)) and orders[0] >= before  # strictly growing, one millisecond or not
    assert ORDER_OPTION not in plain.send(1).options
    assert ORDER_OPTION not in reindex.send_with_options(args=(1, 9), lock_on_busy="wait").options
    assert stack.leases.client.keys("*:order:*") == [order_name(DEFAULT_PREFIX, "doc:1").encode()]  # the only one


@pytest.mark.parametrize("value", [0, -5, scripts.MAX_ORDER + 1, "1700000000000000", 1.5, True, [1]])
def test_a_bad_order_is_refused_at_send_and_at_the_worker(
    make_stack: MakeStack, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture, value: Any
) -> None:
    """Input from whoever writes to the broker: refused, naming actor, option and value; never run."""
    stack = make_stack()
    ran: list[int] = []
    reindex = latest_actor(stack, ran)
    said = re.escape(f"actor 'reindex': message option {ORDER_OPTION}={value!r} is not an order")
    with pytest.raises(LeaseOptionError, match=said):
        reindex.send_with_options(args=(1, 0), **{ORDER_OPTION: value})
    assert stack.recorder.enqueues == []
    stack.start()
    caplog.set_level(logging.ERROR, logger="dramatiq_leases")
    producer = RedisBroker(url=redis_server.url(0), middleware=[])  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
    try:
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name="default", actor_name="reindex", args=(1, 0), kwargs={}, options={ORDER_OPTION: value}
        )
        producer.enqueue(message)
        assert stack.recorder.wait_settled(message.message_id) == "nacked"  # dead-lettered, not run
    finally:
        producer.close()
    assert ran == []
    assert any(
        r.levelname == "ERROR" and message.message_id in r.getMessage() and re.search(said, r.getMessage())
        for r in caplog.records
    ), "no ERROR line names the refused message, its actor, option and value"


def test_a_message_sent_without_an_order_is_ordered_by_its_timestamp(
    make_stack: MakeStack, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis away at send: the send goes on (a WARNING), ordered by its producer's clock; a producer without the
    middleware, likewise: one whose timestamp is older than the newest message that reached the key supersedes
    itself, one sent after it runs."""
    caplog.set_level(logging.INFO, logger="dramatiq_leases")
    offline = Stack(redis_server.url(0), f"redis://127.0.0.1:{free_port()}/0")
    try:
        unordered = latest_actor(offline, []).send(7, 100)
    finally:
        offline.broker.close()
    assert ORDER_OPTION not in unordered.options
    assert any(r.levelname == "WARNING" and unordered.message_id in r.getMessage() for r in caplog.records)
    stack = make_stack()
    ran: list[int] = []
    reindex = latest_actor(stack, ran)
    stack.start()
    wait_for(lambda: ran == [100], timeout=10, what="the message sent without an order to run")
    first = reindex.send(1, 0)
    assert stack.recorder.wait_settled(first.message_id) == "acked" and ran == [100, 0]
    producer = RedisBroker(url=redis_server.url(0), middleware=[])  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
    now_ms = server_us(stack.leases.client) // 1000
    try:
        for n, timestamp in ((1, now_ms - 60_000), (2, now_ms + 1_000)):  # a minute behind; a second ahead
            message: dramatiq.Message[Any] = dramatiq.Message(
                queue_name="default",
                actor_name="reindex",
                args=(1, n),
                kwargs={},
                options={},
                message_timestamp=timestamp,
            )
            producer.enqueue(message)
            # Enqueued by a producer this stack does not record: settled once acknowledged.
            wait_for(lambda: message.message_id in stack.recorder.acked, timeout=10, what=f"revision {n} acked")  # noqa: B023
            if n == 1:
                stale = message.message_id
    finally:
        producer.close()
    assert ran == [100, 0, 2]
    assert any(
        stale in r.getMessage() and "(superseded)" in r.getMessage() and f"message {first.message_id}" in r.getMessage()
        for r in caplog.records
    )


def test_a_delayed_message_sent_without_an_order_keeps_its_send_time_at_the_delays_end(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    """A message sent with a delay and no order (a producer without the middleware; Redis away at send) is
    ordered by its send, not by the end of its delay: the worker moving it out of its delay queue gives it no
    order of its own, which would make it newer than a revision sent during its delay."""
    stack = make_stack()
    ran: list[int] = []
    reindex = latest_actor(stack, ran)
    stack.start()
    producer = RedisBroker(url=redis_server.url(0), middleware=[])  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
    try:
        delayed: dramatiq.Message[Any] = dramatiq.Message(
            queue_name="default", actor_name="reindex", args=(1, 1), kwargs={}, options={}
        )
        producer.enqueue(delayed, delay=1_500)
    finally:
        producer.close()
    newer = reindex.send(1, 2)  # sent during the delay: the newer revision
    assert stack.recorder.wait_settled(newer.message_id) == "acked" and ran == [2]
    wait_for(lambda: delayed.message_id in stack.recorder.acked, timeout=15, what="the delayed revision acked")
    assert ran == [2], "the revision sent first ran after the one sent during its delay"
    moved = [options for mid, _, options in stack.recorder.enqueues if mid == delayed.message_id]
    assert moved and all(ORDER_OPTION not in options for options in moved)


def test_a_lease_handed_over_cannot_let_an_older_message_run_after_its_own(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    """A web request's lease (``lease=``) is adopted by its message without the key's order: had it been
    accepted for a ``"latest"`` actor, a revision sent before it, waiting in the key's line behind the handed
    lease, would run after it. Refused at send, naming actor and option; at the worker, dead-lettered."""
    stack = make_stack()
    ran: list[int] = []
    reindex = latest_actor(stack, ran)
    older = reindex.send(1, 1)
    lease = web.try_acquire(stack.leases, "doc:1", TTL)
    assert isinstance(lease, Lease)
    with pytest.raises(LeaseOptionError, match=r"actor 'reindex'.*lease=.*lock_on_busy='latest'"):
        reindex.send_with_options(args=(1, 2), lease=lease)
    stack.start()
    producer = RedisBroker(url=redis_server.url(0), middleware=[])  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
    try:  # a producer without the middleware: refused at the worker, and the lease handed over released
        handed: dramatiq.Message[Any] = dramatiq.Message(
            queue_name="default",
            actor_name="reindex",
            args=(1, 3),
            kwargs={},
            options={"lease": {"key": lease.key, "token": lease.token}, ORDER_OPTION: server_us(stack.leases.client)},
        )
        producer.enqueue(handed)
    finally:
        producer.close()
    wait_for(lambda: handed.message_id in stack.recorder.nacked, timeout=10, what="the handed message dead-lettered")

    def handed_released() -> bool:
        info = stack.leases.inspect("doc:1")  # read once: the releaser thread may release it between two reads
        return info is None or info.token != lease.token

    wait_for(handed_released, timeout=10, what="the lease handed over released")
    assert stack.recorder.wait_settled(older.message_id) == "acked" and ran == [1]
