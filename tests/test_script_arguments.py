"""The renew and line scripts refuse a bad argument before their first write (Lua is not a transaction: a
script failing halfway keeps its first writes). Real Redis, the scripts called as the store calls them."""

from __future__ import annotations

import pytest
import redis

from dramatiq_leases.core import Busy, Lease, Leases, scripts
from dramatiq_leases.core.errors import LeaseUnavailableError
from dramatiq_leases.core.keys import waiters_name, wake_name


@pytest.fixture
def leases(redis_client: redis.Redis) -> Leases:
    return Leases(redis_client, prefix="t")


def test_renew_refuses_an_empty_token_before_renewing_any_key(leases: Leases, redis_client: redis.Redis) -> None:
    lease = leases.try_acquire("a", 1_000)
    assert isinstance(lease, Lease)
    stray = leases.lease_name("b")
    redis_client.hset(stray, "token", "")  # a hash written by hand, with an empty token and no TTL
    names = [leases.lease_name("a"), stray]
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid token"):
        redis_client.eval(scripts.RENEW_MANY, 2, *names, "60000", lease.token, "")
    assert redis_client.pttl(names[0]) <= 1_000  # the first key was not renewed either
    assert redis_client.pttl(stray) == -1 and not redis_client.hexists(stray, "renewed_ms")


@pytest.mark.parametrize("holder", ["chan nel", "chan\tnel", "channel\n"])
def test_the_line_refuses_a_holder_that_would_split_a_waiters_entry(
    leases: Leases, redis_client: redis.Redis, holder: str
) -> None:
    """Each entry is "state deadline holder actor": a space in the holder would shift the actor into it, and
    the promotion be published on a channel nobody listens to."""
    assert isinstance(leases.try_acquire("k", 60_000), Lease)
    busy = leases._line.join("k", 60_000, waiter="w1", first_ms=1, ready=0, meta={"actor": "send_invoice"})
    assert isinstance(busy, Busy)
    entry = redis_client.hget(waiters_name("t", "k"), "w1")
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid holder"):
        redis_client.eval(scripts.LINE, 1, leases.lease_name("k"), "hold", holder, "1000", "2", "1000", "w1")
    assert redis_client.hget(waiters_name("t", "k"), "w1") == entry
    assert leases._line.hold("k", ["w1"], "channel", park_ms=1_000, ready=0) == ["p"]


def no_ttl(redis_client: redis.Redis, prefix: str = "t") -> list[bytes]:
    """Keys of the prefix without a TTL, but the fence counters (kept for ever without a retention)."""
    return [k for k in redis_client.scan_iter(f"{prefix}:*") if redis_client.pttl(k) == -1 and b":fence:" not in k]


def test_acquire_refuses_a_line_key_of_another_type_before_its_first_write(
    leases: Leases, redis_client: redis.Redis
) -> None:
    """A hand-written waiters key failed the script after it had added the waiter to a new line: a line
    key without TTL for ever, and the key's messages failing on every attempt."""
    assert isinstance(leases.try_acquire("k", 60_000), Lease)
    redis_client.set(waiters_name("t", "k"), "written by hand")
    with pytest.raises(LeaseUnavailableError, match="invalid waiters"):
        leases._line.join("k", 60_000, waiter="w1", first_ms=1)
    assert no_ttl(redis_client) == [waiters_name("t", "k").encode()]  # only the hand-written key


def test_a_wake_list_of_another_type_does_not_stop_the_release_waking_its_waiter(
    leases: Leases, redis_client: redis.Redis
) -> None:
    holder = leases.try_acquire("k", 60_000)
    assert isinstance(holder, Lease)
    busy = leases._line.join("k", 60_000, waiter="w1", first_ms=1, may_wait=True)
    assert isinstance(busy, Busy)
    wake_list = wake_name("t", "k", "w1")
    redis_client.set(wake_list, "written by hand")
    assert leases.release(holder)
    assert redis_client.type(wake_list) == b"list" and redis_client.pttl(wake_list) > 0
    assert leases._line.wait_turn("k", "w1", 100)  # woken
    assert no_ttl(redis_client) == []


@pytest.mark.parametrize("kind", ["done", "waiters"])
def test_release_with_a_line_key_of_another_type_still_releases_and_wakes(
    leases: Leases, redis_client: redis.Redis, kind: str
) -> None:
    """A hand-written done or waiters key failed the release after the lease was deleted: its caller was told
    it failed, and the head of the line was not woken."""
    holder = leases.try_acquire("k", 60_000)
    assert isinstance(holder, Lease)
    assert isinstance(leases._line.join("k", 60_000, waiter="w1", first_ms=1, may_wait=True), Busy)
    name = f"t:{kind}:{{k}}"
    if kind == "waiters":
        redis_client.delete(name)
    redis_client.set(name, "written by hand")
    assert leases._line.release("k", holder.token, waiter="m:0")
    assert not redis_client.exists(leases.lease_name("k"))
    if kind == "done":
        assert leases._line.wait_turn("k", "w1", 100)  # the head was woken
    assert no_ttl(redis_client) == [name.encode()]  # only the hand-written key
