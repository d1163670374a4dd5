"""The renew and line scripts refuse a bad argument before their first write (Lua is not a transaction: a
script failing halfway keeps its first writes). Real Redis, the scripts called as the store calls them."""

from __future__ import annotations

import pytest
import redis

from dramatiq_leases.core import Busy, Lease, Leases, scripts
from dramatiq_leases.core.keys import waiters_name


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
    busy = leases.try_acquire("k", 60_000, waiter="w1", first_ms=1, ready=0, meta={"actor": "send_invoice"})
    assert isinstance(busy, Busy)
    entry = redis_client.hget(waiters_name("t", "k"), "w1")
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid holder"):
        redis_client.eval(scripts.LINE, 1, leases.lease_name("k"), "hold", holder, "1000", "2", "1000", "w1")
    assert redis_client.hget(waiters_name("t", "k"), "w1") == entry
    assert leases.hold("k", ["w1"], "channel", park_ms=1_000, ready=0) == ["p"]
