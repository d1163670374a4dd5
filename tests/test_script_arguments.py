"""The renew and line scripts refuse a bad argument before their first write (Lua is not a transaction: a
script failing halfway keeps its first writes), and each number the Lua uses is the one Python declares
(``scripts.LUA_CONSTANTS``), seen from the server. Real Redis, the scripts called as the store calls them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from dramatiq_leases.core import Busy, Lease, Leases, scripts
from dramatiq_leases.core.errors import LeaseUnavailableError
from dramatiq_leases.core.keys import fence_name, history_name, lease_name, line_name, wake_name

from .support.scriptcalls import acquire, line_call, release_call, renew_call
from .support.stack import MakeLeases


def sibling(kind: str, key: str) -> str:
    """A key of the line the scripts derive from the lease's name (``waiters``, ``done``), as they do."""
    return lease_name("t", key).replace(":lease:{", f":{kind}:{{", 1)


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """Keys under the prefix ``t`` (the tests read them by name)."""
    return make_leases(prefix="t")


def test_renew_refuses_an_empty_token_before_renewing_any_key(leases: Leases, redis_client: redis.Redis) -> None:
    lease = leases.try_acquire("a", 1_000)
    assert isinstance(lease, Lease)
    stray = leases.lease_name("b")
    redis_client.hset(stray, "token", "")  # a hash written by hand, with an empty token and no TTL
    names = [leases.lease_name("a"), stray]
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid token"):
        redis_client.eval(*renew_call(names, "60000", lease.token, ""))
    assert redis_client.pttl(names[0]) <= 1_000  # the first key was not renewed either
    assert redis_client.pttl(stray) == -1 and not redis_client.hexists(stray, "renewed_ms")


@pytest.mark.parametrize("holder", ["chan nel", "chan\tnel", "channel\n"])
def test_the_line_refuses_a_holder_that_would_split_a_waiters_entry(
    leases: Leases, redis_client: redis.Redis, holder: str
) -> None:
    """Each entry is "state deadline holder actor": a space in the holder would shift the actor into it, and
    the promotion be published on a channel nobody listens to."""
    assert isinstance(leases.try_acquire("k", 60_000), Lease)
    busy = leases.line.join("k", 60_000, waiter="w1", first_ms=1, ready=0, meta={"actor": "send_invoice"})
    assert isinstance(busy, Busy)
    entry = redis_client.hget(sibling("waiters", "k"), "w1")
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid holder"):
        redis_client.eval(*line_call("hold", holder, "1000", "2", "1000", "w1"))
    assert redis_client.hget(sibling("waiters", "k"), "w1") == entry
    assert leases.line.hold("k", ["w1"], "channel", park_ms=1_000, ready=0) == ["p"]


def no_ttl(redis_client: redis.Redis, prefix: str = "t") -> list[bytes]:
    """Keys of the prefix without a TTL, but the fence counters (kept for ever without a retention) and the
    slots' epoch records (kept for ever, one per Cluster slot at most)."""
    return [
        k
        for k in redis_client.scan_iter(f"{prefix}:*")
        if redis_client.pttl(k) == -1 and b":fence:" not in k and b":epoch:" not in k
    ]


def test_acquire_refuses_a_line_key_of_another_type_before_its_first_write(
    leases: Leases, redis_client: redis.Redis
) -> None:
    """A hand-written waiters key failed the script after it had added the waiter to a new line: a line
    key without TTL for ever, and the key's messages failing on every attempt."""
    assert isinstance(leases.try_acquire("k", 60_000), Lease)
    redis_client.set(sibling("waiters", "k"), "written by hand")
    with pytest.raises(LeaseUnavailableError, match="invalid waiters"):
        leases.line.join("k", 60_000, waiter="w1", first_ms=1)
    assert no_ttl(redis_client) == [sibling("waiters", "k").encode()]  # only the hand-written key


def test_a_wake_list_of_another_type_does_not_stop_the_release_waking_its_waiter(
    leases: Leases, redis_client: redis.Redis
) -> None:
    holder = leases.try_acquire("k", 60_000)
    assert isinstance(holder, Lease)
    busy = leases.line.join("k", 60_000, waiter="w1", first_ms=1, may_wait=True)
    assert isinstance(busy, Busy)
    wake_list = wake_name("t", "k", "w1")
    redis_client.set(wake_list, "written by hand")
    assert leases.release(holder)
    assert redis_client.type(wake_list) == b"list" and redis_client.pttl(wake_list) > 0
    assert leases.line.wait_turn("k", "w1", 100)  # woken
    assert no_ttl(redis_client) == []


@pytest.mark.parametrize("kind", ["done", "waiters"])
def test_release_with_a_line_key_of_another_type_still_releases_and_wakes(
    leases: Leases, redis_client: redis.Redis, kind: str
) -> None:
    """A hand-written done or waiters key failed the release after the lease was deleted: its caller was told
    it failed, and the head of the line was not woken."""
    holder = leases.try_acquire("k", 60_000)
    assert isinstance(holder, Lease)
    assert isinstance(leases.line.join("k", 60_000, waiter="w1", first_ms=1, may_wait=True), Busy)
    name = f"t:{kind}:{{k}}"
    if kind == "waiters":
        redis_client.delete(name)
    redis_client.set(name, "written by hand")
    assert leases.line.release("k", holder.token, waiter="m:0")
    assert not redis_client.exists(leases.lease_name("k"))
    if kind == "done":
        assert leases.line.wait_turn("k", "w1", 100)  # the head was woken
    assert no_ttl(redis_client) == [name.encode()]  # only the hand-written key


# Each constant the Lua uses, seen from the server -------------------------------------------------------------


def ttls_set(client: redis.Redis, call: Callable[[], Any], *names: str) -> tuple[list[int], int]:
    """The PTTLs ``call`` left on ``names``, and how many ms they can have lost since they were set (measured
    around the call and the reads): a TTL of C set during the call reads between C minus that and C."""
    started = time.monotonic()
    call()
    pttls = [client.pttl(name) for name in names]
    return pttls, int((time.monotonic() - started) * 1000) + 1


@pytest.mark.parametrize(
    ("good", "bad", "refused"),
    [
        ({"ttl_ms": scripts.MAX_MS}, {"ttl_ms": scripts.MAX_MS + 1}, "ttl_ms"),
        ({"first_ms": scripts.MAX_TIMESTAMP_MS}, {"first_ms": scripts.MAX_TIMESTAMP_MS + 1}, "first_ms"),
        ({"ready": scripts.MAX_READY}, {"ready": scripts.MAX_READY + 1}, "ready"),
        ({"limit": scripts.MAX_LIMIT}, {"limit": scripts.MAX_LIMIT + 1}, "limit"),
        (
            {"waiter": "w" * scripts.MAX_ID_LENGTH, "mode": 1},
            {"waiter": "w" * (scripts.MAX_ID_LENGTH + 1), "mode": 1},
            "waiter",
        ),
    ],
    ids=["MAX_MS", "MAX_TIMESTAMP_MS", "MAX_READY", "MAX_LIMIT", "MAX_ID_LENGTH"],
)
def test_acquire_takes_each_bound_python_declares_and_refuses_one_past_it(
    redis_client: redis.Redis, good: dict[str, Any], bad: dict[str, Any], refused: str
) -> None:
    """Python checks a number against the same bound before asking (``numbers.whole_ms``): a value Python lets
    through is one the script takes."""
    with pytest.raises(redis.ResponseError, match=f"dramatiq-leases: invalid {refused}"):
        acquire(redis_client, "k", **bad)
    assert redis_client.keys("*") == []  # refused before the first write
    assert acquire(redis_client, "k", **good)[0] == 1


def test_release_and_the_line_take_the_same_bounds(redis_client: redis.Redis) -> None:
    name = lease_name("t", "k")
    bounds: dict[str, Any] = {
        "waiter": "w" * scripts.MAX_ID_LENGTH,
        "ready": scripts.MAX_READY,
        "promote_ms": scripts.MAX_MS,
    }
    assert redis_client.eval(*release_call(token="nobody", **bounds)) == 0
    wrong: list[tuple[dict[str, Any], str]] = [
        ({"ready": scripts.MAX_READY + 1}, "ready"),
        ({"promote_ms": scripts.MAX_MS + 1}, "promote_ms"),
        ({"retention_ms": scripts.MAX_MS + 1}, "retention_ms"),
        ({"waiter": "w" * (scripts.MAX_ID_LENGTH + 1)}, "waiter"),
        ({"by": "b" * (scripts.MAX_ID_LENGTH + 1)}, "by"),
        ({"grant": "x"}, "grant"),
    ]
    for named, refused in wrong:
        with pytest.raises(redis.ResponseError, match=f"invalid {refused}"):
            redis_client.eval(*release_call(token="nobody", **named))
    hold = line_call(
        "hold", "h" * scripts.MAX_ID_LENGTH, scripts.MAX_MS, scripts.MAX_READY, 1, "w" * scripts.MAX_ID_LENGTH
    )
    assert redis_client.eval(*hold) == [[b"x"], []]
    with pytest.raises(redis.ResponseError, match="invalid holder"):
        redis_client.eval(scripts.LINE, 1, name, "hold", "h" * (scripts.MAX_ID_LENGTH + 1), 1, 0, 1, "w")
    with pytest.raises(redis.ResponseError, match="invalid park_ms"):
        redis_client.eval(scripts.LINE, 1, name, "hold", "h", scripts.MAX_MS + 1, 0, 1, "w")
    assert redis_client.keys("*") == []


def test_a_waiter_in_place_blocks_by_the_block_constants(redis_client: redis.Redis) -> None:
    """MAX_BLOCK_MS (a key without TTL), BLOCK_SLACK_MS (past the holder's TTL) and READY_SLACK_MS (the place
    kept past the block), read from the reply and the waiter's entry: exact, whatever the machine's speed."""
    assert acquire(redis_client, "k", token="holder")[0] == 1
    reply = acquire(redis_client, "k", token="t1", waiter="w1", first_ms=1, mode=2, ready=2)
    pttl, now, action, block = int(reply[1]), int(reply[3]), int(reply[4]), int(reply[7])
    assert action == 1 and block == min(scripts.MAX_BLOCK_MS, pttl + scripts.BLOCK_SLACK_MS)
    entry = redis_client.hget(sibling("waiters", "k"), "w1")
    assert isinstance(entry, bytes)
    state, deadline = entry.split()[:2]
    assert state == b"r" and int(deadline) == now + block + scripts.READY_SLACK_MS
    redis_client.persist(lease_name("t", "k"))  # a key without TTL: no expiry to wait for
    reply = acquire(redis_client, "k", token="t2", waiter="w2", first_ms=2, mode=2, ready=2)
    assert int(reply[4]) == 1 and int(reply[7]) == scripts.MAX_BLOCK_MS


def test_the_line_keys_live_as_long_as_the_constants_say(redis_client: redis.Redis) -> None:
    """LINE_TTL_MS (the line and its waiters), WAKE_TTL_MS (a wake-up), DONE_MS (a waiter that ran)."""
    assert acquire(redis_client, "k", token="holder")[0] == 1
    pttls, lost = ttls_set(
        redis_client,
        lambda: acquire(redis_client, "k", token="t1", waiter="w1", first_ms=1, mode=2, ready=2),
        line_name("t", "k"),
        sibling("waiters", "k"),
    )
    assert all(scripts.LINE_TTL_MS - lost <= pttl <= scripts.LINE_TTL_MS for pttl in pttls), pttls
    release = release_call(token="holder", waiter="w0", ready=2)

    def release_and_wake() -> None:
        assert redis_client.eval(*release) == [scripts.RELEASED, b"w1"]  # the release names whom to wake
        redis_client.eval(scripts.WAKE, 1, wake_name("t", "k", "w1"))

    (wake, done), lost = ttls_set(redis_client, release_and_wake, wake_name("t", "k", "w1"), sibling("done", "k"))
    assert scripts.WAKE_TTL_MS - lost <= wake <= scripts.WAKE_TTL_MS  # the head, waiting in place, woken
    assert scripts.DONE_MS - lost <= done <= scripts.DONE_MS  # w0, which ran


@pytest.mark.parametrize("script", ["release", "release_plain", "release_if_dead"])
def test_a_counter_made_again_by_a_release_keeps_record_ms(redis_client: redis.Redis, script: str) -> None:
    """RECORD_MS: the counter a release writes again after it expired, for a caller that knows no retention."""
    names = [lease_name("t", "k"), fence_name("t", "k")]
    granted = acquire(redis_client, "k")
    assert granted[0] == 1
    redis_client.delete(names[1])  # expired during the hold
    call = release_call()
    if script == "release_plain":
        call = [scripts.RELEASE_PLAIN, 3, *names, line_name("t", "k"), "tok", "", 0]
    if script == "release_if_dead":
        call = [scripts.RELEASE_IF_DEAD, 3, *names, history_name("t", "k"), 0]
        redis_client.persist(names[0])
        redis_client.hset(names[0], "renewed_ms", 1)  # its holder's deadline long past
    (pttl,), lost = ttls_set(redis_client, lambda: redis_client.eval(*call), names[1])
    assert redis_client.hget(names[1], "released") == str(granted[1]).encode()
    assert scripts.RECORD_MS - lost <= pttl <= scripts.RECORD_MS


def test_one_call_drops_at_most_head_drops_max_vanished_waiters(redis_client: redis.Redis) -> None:
    """HEAD_DROPS_MAX bounds the work of one call on a line of waiters that all vanished."""
    vanished = [f"w{i:02}" for i in range(scripts.HEAD_DROPS_MAX + 3)]
    redis_client.zadd(line_name("t", "k"), {w: i + 1 for i, w in enumerate(vanished)})
    redis_client.hset(sibling("waiters", "k"), mapping={w: "p 1 h a" for w in vanished})  # deadlines long past
    redis_client.eval(*line_call("leave", "", 1, 2, 1000, "someone"))
    assert redis_client.zcard(line_name("t", "k")) == 3
