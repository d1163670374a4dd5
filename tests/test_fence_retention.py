"""Bounded memory: with a fence retention, idle fence counters expire and fences still only rise.

Every key ever leased keeps a fence counter; a fleet leasing per-user or per-invoice keys would grow its
store without bound. With ``fence_retention_ms`` a counter nobody acquires or releases for that long
expires, and each fence is at least the server's clock in microseconds at its grant, so a counter made
again starts above every fence handed out before. Real Redis, real expiry.
"""

from __future__ import annotations

from typing import cast

import pytest
import redis

from dramatiq_leases import Lease, LeaseConfigError, LeaseMiddleware, Leases
from dramatiq_leases.core.keys import epoch_name
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.exporter.observer import Ending, grant_ending

from .support.stack import MakeLeases
from .support.waiting import wait_for

RETENTION_MS = 300


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """Every store of these tests has the retention."""
    return make_leases(fence_retention=RETENTION_MS)


def grant(leases: Leases, key: str, ttl: int = 5_000) -> Lease:
    lease = leases.try_acquire(key, ttl=ttl)
    assert isinstance(lease, Lease), lease
    return lease


def server_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def test_fences_rise_across_the_expiry_of_their_counter(leases: Leases, redis_client: redis.Redis) -> None:
    fences = []
    for _ in range(3):
        lease = grant(leases, "invoice:1")
        fences.append(lease.fence)
        assert leases.release(lease)
    counter = leases.fence_name("invoice:1")
    assert 0 < redis_client.pttl(counter) <= RETENTION_MS, "an idle counter expires"
    wait_for(lambda: not redis_client.exists(counter), what="the idle fence counter to expire")
    after = grant(leases, "invoice:1")
    fences.append(after.fence)
    assert fences == sorted(set(fences)), fences
    # Each fence is the grant's server time in µs: it says when, and a new counter starts above the old.
    assert fences[-1] <= server_us(redis_client)


def test_fences_are_exact_at_sixteen_digits(leases: Leases, redis_client: redis.Redis) -> None:
    """Lua prints numbers with 14 significant digits: a fence written as a number would be rounded."""
    first = grant(leases, "k")
    assert first.fence > 10**15
    assert int(cast(bytes, redis_client.hget(leases.lease_name("k"), "fence"))) == first.fence
    assert leases.release(first)
    assert leases.fence_state("k")["released"] == first.fence
    second = grant(leases, "k")
    assert second.fence > first.fence
    assert leases.inspect("k").fence == second.fence  # type: ignore[union-attr]


def test_an_expired_grant_is_still_told_from_a_released_one(leases: Leases, redis_client: redis.Redis) -> None:
    released = grant(leases, "k")
    assert leases.release(released)
    expiring = grant(leases, "k", ttl=50)
    after = wait_for(lambda: leases.try_acquire("k", ttl=5_000) or None, what="the 50 ms lease to expire")
    assert isinstance(after, Lease)  # for mypy: wait_for returns only a truthy value, and a Busy is falsy
    assert leases.fence_state("k") == {"fence": after.fence, "released": released.fence, "expired": expiring.fence}


def test_every_write_to_a_counter_keeps_it_bounded(leases: Leases, redis_client: redis.Redis) -> None:
    """Grant, release, release --if-dead: none leaves a counter without its retention."""
    counter = leases.fence_name("k")
    lease = grant(leases, "k")
    assert 0 < redis_client.pttl(counter) <= RETENTION_MS
    # The counter expires under a long hold; the release writes it again, with a TTL.
    wait_for(lambda: not redis_client.exists(counter), what="the counter to expire during the hold")
    assert leases.release(lease)
    assert 0 < redis_client.pttl(counter) <= RETENTION_MS
    # A leak released by hand: the lease hash had its TTL removed (its holder's deadline passes first).
    leaked = grant(leases, "k", ttl=200)
    redis_client.persist(leases.lease_name("k"))
    wait_for(lambda: not redis_client.exists(counter), what="the counter to expire again")
    released, _, fence = leases.release_if_dead("k")
    assert released is True and fence == leaked.fence
    assert 0 < redis_client.pttl(counter) <= RETENTION_MS


def test_many_keys_leave_nothing_behind(leases: Leases, redis_client: redis.Redis) -> None:
    for n in range(500):
        assert leases.release(grant(leases, f"user:{n}"))
    # What is left is counters, each expiring (the first may be gone already: 500 cycles outlast the retention),
    # and the epoch records of the slots granted in: at most one per Cluster slot whatever the keys, kept for ever.
    left = list(redis_client.scan_iter(match="dramatiq-leases:fence:*", count=1000))
    ttls = [redis_client.pttl(name) for name in left]
    assert left and all(ttl != -1 and ttl <= RETENTION_MS for ttl in ttls), ttls  # -2: expired meanwhile
    epochs = {name for name in redis_client.scan_iter(count=1000) if b":fence:" not in name}
    assert epochs == {epoch_name(leases.prefix, f"user:{n}").encode() for n in range(500)}
    assert len(epochs) <= 500
    wait_for(lambda: redis_client.dbsize() == len(epochs), timeout=10, what="every idle counter to expire")


def test_without_a_retention_counters_are_kept_and_fences_are_the_server_clock(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client)
    fences = []
    for _ in range(3):
        before = server_us(redis_client)
        lease = grant(leases, "k")
        fences.append(lease.fence)
        assert before <= lease.fence <= server_us(redis_client), "the grant's server time in µs"
        assert leases.release(lease)
    assert fences == sorted(set(fences))
    assert redis_client.pttl(leases.fence_name("k")) == -1


def test_a_process_without_the_retention_keeps_counting_up(leases: Leases, redis_client: redis.Redis) -> None:
    """Mixed settings on one live counter, and a counter of small fences an older version wrote: every grant's
    fence is larger than the last, never a step back (fences are the server's clock in µs, or the last + 1)."""
    redis_client.hset(leases.fence_name("old"), mapping={"fence": 6, "released": 6})  # as an older version left it
    counting = Leases(redis_client)
    fences = []
    for store, key in [(counting, "old"), (leases, "k"), (counting, "k"), (leases, "k"), (counting, "old")]:
        lease = grant(store, key)
        assert store.release(lease)
        fences.append((key, lease.fence))
    for key in ("old", "k"):
        mine = [f for k, f in fences if k == key]
        assert mine == sorted(set(mine)) and mine[0] > 6, fences
    assert all(f > 10**15 for _, f in fences), "from the server's clock, with or without a retention"


@pytest.mark.parametrize("value", [0, -1, 1.5, "1000", True, 10**13])
def test_a_bad_retention_is_refused_naming_it(redis_client: redis.Redis, value: object) -> None:
    with pytest.raises(LeaseConfigError, match=r"Leases: fence_retention must be a whole number"):
        Leases(redis_client, fence_retention=value)  # type: ignore[arg-type]


def test_the_middleware_passes_its_retention_on(redis_server: EmbeddedRedis) -> None:
    middleware = LeaseMiddleware(redis_server.url(0), fence_retention=86_400_000)
    assert middleware.leases.fence_retention == 86_400_000
    with pytest.raises(LeaseConfigError, match="fence_retention"):
        LeaseMiddleware(redis_server.url(0), fence_retention=0)


def test_a_retention_of_a_day_costs_one_more_command_per_grant(redis_client: redis.Redis) -> None:
    """The price, counted: a PEXPIRE more on each grant (the counter is read and written either way), and
    one on each release."""

    def commands(leases: Leases) -> int:
        before = sum(int(v["calls"]) for k, v in redis_client.info("commandstats").items() if k != "cmdstat_info")
        for _ in range(10):
            assert leases.release(grant(leases, "cost"))
        after = sum(int(v["calls"]) for k, v in redis_client.info("commandstats").items() if k != "cmdstat_info")
        return after - before

    assert Leases(redis_client).release(grant(Leases(redis_client), "warm-up"))  # scripts loaded once
    plain = commands(Leases(redis_client, prefix="plain"))
    kept = commands(Leases(redis_client, prefix="kept", fence_retention=86_400_000))
    assert kept - plain == 10 * 2, (plain, kept)


@pytest.mark.parametrize("waited", [False, True], ids=["uncontended", "after-a-line"])
def test_a_release_by_a_caller_without_the_retention_leaves_no_counter_without_ttl(
    leases: Leases, redis_client: redis.Redis, waited: bool
) -> None:
    """The CLI's ``release --owner`` knows no retention: a counter the fleet's retention expired during a long
    hold is made again to record the release, but with a TTL, never kept for ever."""
    without = Leases(redis_client)
    lease = grant(leases, "invoice:9", ttl=60_000)
    if waited:
        assert not isinstance(leases.line.join("invoice:9", ttl=5_000, waiter="m:0", may_wait=False), Lease)
    counter = f"{leases.prefix}:fence:{{invoice:9}}"
    wait_for(lambda: redis_client.exists(counter) == 0, what="the idle counter to expire during the hold")
    assert without.release(lease)
    assert redis_client.pttl(counter) > 0, "the counter was made again without a TTL"
    kept = [k for k in redis_client.scan_iter(f"{leases.prefix}:*") if redis_client.pttl(k) == -1]
    assert kept == [epoch_name(leases.prefix, "invoice:9").encode()]  # the slot's epoch record only, kept for ever


def test_a_release_recorded_in_a_counter_made_again_outlives_the_next_grant(
    leases: Leases, redis_client: redis.Redis
) -> None:
    """The retention expires a counter during a long hold; the release makes it again to record itself. The
    next grant must keep that record: a release asked again (its first reply lost, as a Runs retry after a
    Redis error) is still answered "released earlier", not "not held", and the exporter still tells the
    grant was released."""
    first = grant(leases, "k", ttl=60_000)
    counter = leases.fence_name("k")
    wait_for(lambda: not redis_client.exists(counter), what="the counter to expire during the hold")
    assert leases.line.release("k", first.token, fence=first.fence, slot=0)
    assert leases.fence_state("k") == {"released": first.fence}
    second = grant(leases, "k")
    assert second.fence > first.fence
    assert grant_ending(first.fence, leases.fence_state("k")) is Ending.RELEASED, leases.fence_state("k")
    # The same release again, as a retry whose first reply was lost: it was released, by this token.
    assert leases.line.release("k", first.token, fence=first.fence, slot=0), "told 'not held' for its own release"
