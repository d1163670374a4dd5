"""N holders per key (``limit``), at the core: slots, fences, expiry, renewal, stale releases, mixed limits, the
per-slot records of the fence counter, and arguments refused before Redis is asked.

Real Redis, real scripts. The line serving N holders and ``latest`` are in test_limit_hostile.py, with lost
replies and the defects found.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from dramatiq_leases.core import Busy, Heartbeat, Lease, LeaseConfigError, Leases, Renewal, scripts
from dramatiq_leases.core.info import text
from dramatiq_leases.core.keys import epoch_name, fence_name, lease_name

from .support.scriptcalls import grant_call
from .support.stack import MakeLeases
from .support.waiting import wait_for

TTL = 10_000
#: The slot's epoch record (the failover grace's), kept for ever by design: the one key the TTL checks leave out.
EPOCH = epoch_name("t", "k").encode()


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """Keys under the prefix ``t`` (the tests read them by name)."""
    return make_leases(prefix="t")


def grant(leases: Leases, key: str = "k", ttl: int = TTL, limit: int = 3, **options: Any) -> Lease:
    lease = leases.try_acquire(key, ttl, limit=limit, **options)
    assert isinstance(lease, Lease), lease
    return lease


def refused(reply: Lease | Busy) -> Busy:
    assert isinstance(reply, Busy), reply
    return reply


def held_slots(client: redis.Redis, key: str = "k", upto: int = 8) -> dict[int, str]:
    """The token holding each held slot of ``key`` (slots 0 .. upto - 1), read from Redis."""
    out = {}
    for s in range(upto):
        token = client.hget(lease_name("t", key, s), "token")
        if token is not None:
            out[s] = text(token)
    return out


def counter(client: redis.Redis, key: str = "k") -> dict[str, str]:
    return {text(k): text(v) for k, v in client.hgetall(fence_name("t", key)).items()}


def test_at_most_limit_hold_at_once_each_in_its_own_slot_with_its_own_token_and_fence(
    leases: Leases, redis_client: redis.Redis
) -> None:
    held = [grant(leases) for _ in range(3)]
    assert sorted(lease.slot for lease in held) == [0, 1, 2]
    assert len({lease.token for lease in held}) == 3
    fences = [lease.fence for lease in held]
    assert fences == sorted(set(fences))
    busy = refused(leases.try_acquire("k", TTL, limit=3))
    assert busy.fence == fences[-1]  # the newest holder's
    assert 0 < busy.ttl_left <= TTL
    assert held_slots(redis_client) == {lease.slot: lease.token for lease in held}
    for lease in held:  # each hash names its slot and the limit it was granted under
        info = redis_client.hgetall(lease_name("t", "k", lease.slot))
        assert (info[b"slot"], info[b"limit"], info[b"fence"]) == (
            str(lease.slot).encode(),
            b"3",
            str(lease.fence).encode(),
        )
    # The reader sees three holders, each with its slot.
    assert sorted((i.slot, i.limit, i.fence) for i in leases.scan("k")) == sorted((le.slot, 3, le.fence) for le in held)


def test_a_release_frees_exactly_its_slot_and_the_next_grant_takes_it_with_a_higher_fence(
    leases: Leases, redis_client: redis.Redis
) -> None:
    a, b, c = (grant(leases) for _ in range(3))
    before = {s: redis_client.pttl(lease_name("t", "k", s)) for s in (a.slot, c.slot)}
    assert leases.release(b)
    assert held_slots(redis_client) == {a.slot: a.token, c.slot: c.token}
    for s, pttl in before.items():  # the others untouched
        assert 0 < pttl - redis_client.pttl(lease_name("t", "k", s)) < 1_000
    d = grant(leases)
    assert d.slot == b.slot and d.fence > c.fence
    refused(leases.try_acquire("k", TTL, limit=3))
    assert leases.release(b) is False  # its slot is d's now: nothing touched
    assert held_slots(redis_client) == {a.slot: a.token, b.slot: d.token, c.slot: c.token}


def test_fences_strictly_increase_across_all_holders_whatever_the_order_of_releases(leases: Leases) -> None:
    fences: list[int] = []
    held: list[Lease] = []
    for i in range(40):
        if len(held) == 4 or (held and i % 3 == 0):
            assert leases.release(held.pop(i % len(held)))
        lease = grant(leases, limit=4)
        assert lease.slot not in {h.slot for h in held}
        held.append(lease)
        fences.append(lease.fence)
    assert fences == sorted(set(fences))


def test_a_holder_that_expires_frees_its_slot_only_within_its_ttl(leases: Leases, redis_client: redis.Redis) -> None:
    long_a = grant(leases)
    short = grant(leases, ttl=400)
    long_b = grant(leases)
    granted_at = time.monotonic()
    refused(leases.try_acquire("k", TTL, limit=3))
    after = wait_for(
        lambda: leases.try_acquire("k", TTL, limit=3) or None, timeout=3, what="the short holder to expire"
    )
    assert isinstance(after, Lease)
    assert time.monotonic() - granted_at < 0.4 + 1.0  # within its TTL (and slack for a loaded machine)
    assert after.slot == short.slot
    assert held_slots(redis_client) == {long_a.slot: long_a.token, short.slot: after.token, long_b.slot: long_b.token}
    # The re-grant found the slot's last grant unreleased: recorded as that slot's expiry.
    assert counter(redis_client)[f"e:{short.slot}"] == str(short.fence)


def test_renew_many_renews_every_slot_and_a_heartbeat_keeps_all_holders_alive(
    leases: Leases, redis_client: redis.Redis
) -> None:
    held = [grant(leases, ttl=600, limit=3) for _ in range(3)]
    for s in range(3):
        redis_client.pexpire(lease_name("t", "k", s), 100)
    assert leases.renew_many(held) == [Renewal.OK] * 3
    assert all(redis_client.pttl(lease_name("t", "k", s)) > 400 for s in range(3))
    heartbeat = Heartbeat(leases)
    lost: list[Lease] = []
    try:
        for lease in held:
            heartbeat.track(lease, lambda lease, reason: lost.append(lease))
        end = time.monotonic() + 1.5  # several TTLs
        while time.monotonic() < end:
            assert len(held_slots(redis_client)) == 3
            refused(leases.try_acquire("k", 600, limit=3))
            time.sleep(0.05)
        assert lost == []
    finally:
        heartbeat.stop()
    # Untracked, they end by their TTLs, and the three slots are free again.
    wait_for(lambda: not held_slots(redis_client), timeout=3, what="the untracked holders to expire")
    assert sorted(grant(leases).slot for _ in range(3)) == [0, 1, 2]


def test_a_stale_holder_released_late_frees_nothing_of_the_newer_holder(
    leases: Leases, redis_client: redis.Redis
) -> None:
    stale = grant(leases, ttl=300, limit=2)
    other = grant(leases, limit=2)
    newer = wait_for(lambda: leases.try_acquire("k", TTL, limit=2) or None, timeout=3, what="the stale slot")
    assert isinstance(newer, Lease) and newer.slot == stale.slot
    assert leases.release(stale) is False
    assert leases.release_token("k", stale.token) is False  # slot=None: looked for in every slot
    assert leases.release_token("k", stale.token, slot=stale.slot) is False
    assert leases.line.release("k", stale.token, waiter="") is False
    assert held_slots(redis_client) == {other.slot: other.token, newer.slot: newer.token}
    refused(leases.try_acquire("k", TTL, limit=2))
    assert f"r:{stale.slot}" not in counter(redis_client)  # nothing recorded as released either


def test_release_token_without_a_slot_finds_the_token_in_any_slot(leases: Leases, redis_client: redis.Redis) -> None:
    held = [grant(leases, limit=5) for _ in range(5)]
    for lease in (held[4], held[0], held[2]):
        assert leases.release_token("k", lease.token)
        assert lease.slot not in held_slots(redis_client)
    assert held_slots(redis_client) == {held[1].slot: held[1].token, held[3].slot: held[3].token}
    assert leases.release_token("k", held[4].token) is False  # released once


def test_a_lower_limit_counts_every_holder_and_is_refused_until_fewer_hold(
    leases: Leases, redis_client: redis.Redis
) -> None:
    held = [grant(leases, limit=4) for _ in range(4)]
    for lease in held[:2]:
        refused(leases.try_acquire("k", TTL, limit=2))
        assert leases.release(lease)
    refused(leases.try_acquire("k", TTL, limit=2))  # two hold (slots 2 and 3): the limit is met
    assert leases.release(held[2])
    low = grant(leases, limit=2)  # one holds: granted, in a free slot below its limit
    assert low.slot in (0, 1)
    refused(leases.try_acquire("k", TTL, limit=2))
    assert set(held_slots(redis_client)) == {low.slot, 3}
    # The width still covers slot 3 while it is held: a limit-1 caller counts it too.
    assert int(counter(redis_client)["width"]) == 4
    refused(leases.try_acquire("k", TTL, limit=1))


def test_a_higher_limit_is_granted_while_fewer_than_it_hold(leases: Leases, redis_client: redis.Redis) -> None:
    held = [grant(leases, limit=4) for _ in range(4)]
    refused(leases.try_acquire("k", TTL, limit=4))
    more = [grant(leases, limit=6) for _ in range(2)]
    assert sorted(lease.slot for lease in more) == [4, 5]
    refused(leases.try_acquire("k", TTL, limit=6))
    refused(leases.try_acquire("k", TTL, limit=4))  # six hold: above a limit of 4 as well
    assert int(counter(redis_client)["width"]) == 6
    assert len(held_slots(redis_client)) == 6
    for lease in held + more:
        assert leases.release(lease)
    # Drained, a limit-2 grant shrinks the width back.
    grant(leases, limit=2)
    assert int(counter(redis_client)["width"]) == 2


def test_the_fence_counter_keeps_per_slot_records_once_several_held(leases: Leases, redis_client: redis.Redis) -> None:
    a = grant(leases, limit=2)
    b = grant(leases, ttl=300, limit=2)
    rec = counter(redis_client)
    assert rec["width"] == "2" and rec[f"g:{a.slot}"] == str(a.fence) and rec[f"g:{b.slot}"] == str(b.fence)
    assert rec["fence"] == str(b.fence)
    assert leases.release(a)
    assert counter(redis_client)[f"r:{a.slot}"] == str(a.fence)
    wait_for(lambda: redis_client.exists(lease_name("t", "k", b.slot)) == 0, timeout=3, what="b to expire")
    c = grant(leases, limit=2)  # slot 0, released before: no expiry
    d = grant(leases, limit=2)  # slot 1, whose last grant ended by TTL
    assert (c.slot, d.slot) == (a.slot, b.slot)
    rec = counter(redis_client)
    assert rec[f"e:{b.slot}"] == str(b.fence) and f"e:{a.slot}" not in rec
    assert rec[f"g:{c.slot}"] == str(c.fence) and rec[f"g:{d.slot}"] == str(d.fence)
    # A wide key no longer writes the legacy records.
    assert "expired" not in rec and "released" not in rec


def test_a_key_only_ever_held_by_one_keeps_its_legacy_records(leases: Leases, redis_client: redis.Redis) -> None:
    first = grant(leases, limit=1)
    assert leases.release(first)
    short = grant(leases, ttl=300, limit=1)
    after = wait_for(lambda: leases.try_acquire("k", TTL) or None, timeout=3, what="the short lease to expire")
    assert isinstance(after, Lease) and after.slot == 0
    rec = counter(redis_client)
    assert set(rec) == {"fence", "released", "expired"}
    assert (rec["released"], rec["expired"], rec["fence"]) == (str(first.fence), str(short.fence), str(after.fence))
    assert {b"slot", b"limit"}.isdisjoint(redis_client.hkeys(lease_name("t", "k")))
    assert leases.inspect("k") is not None and leases.inspect("k").limit == 1  # type: ignore[union-attr]


def commandstats(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in client.info("commandstats").items()}


@pytest.mark.parametrize("limit", [0, -1, 1001, True, False, 1.5, 2.0, "2", None, 10**20])
def test_a_bad_limit_is_refused_before_redis_is_asked(leases: Leases, redis_client: redis.Redis, limit: Any) -> None:
    leases.try_acquire("warm", TTL)  # scripts loaded, connection open: what follows would be EVALSHA calls
    before = commandstats(redis_client)
    with pytest.raises(LeaseConfigError, match="limit"):
        leases.try_acquire("k", TTL, limit=limit)
    with pytest.raises(LeaseConfigError, match="limit"):
        leases.line.join("k", TTL, waiter="w", limit=limit)
    after = commandstats(redis_client)
    assert {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)} == {"info": 1}
    written = [epoch_name("t", "warm"), fence_name("t", "warm"), lease_name("t", "warm")]
    assert sorted(redis_client.keys("*")) == [name.encode() for name in written]


def test_the_limit_bounds_are_the_documented_ones(leases: Leases) -> None:
    assert scripts.MAX_LIMIT == 1000
    top = grant(leases, limit=1000)
    assert top.slot == 0
    assert grant(leases, limit=1000).slot == 1
    assert grant(leases, "one", limit=1).slot == 0


@pytest.mark.parametrize("bad", ["0", "-1", "1001", "1.5", "x"])
def test_the_acquire_script_refuses_a_bad_limit_itself_before_writing(
    leases: Leases, redis_client: redis.Redis, bad: str
) -> None:
    """Another client of the scripts (an older package, a hand call) is refused by the script too."""
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid limit"):
        redis_client.eval(*grant_call(limit=bad))
    assert redis_client.keys("*") == []


def test_a_slot_key_of_another_type_counts_as_held_and_no_key_is_left_without_ttl(
    leases: Leases, redis_client: redis.Redis
) -> None:
    redis_client.set(lease_name("t", "k", 1), "x")  # written by hand
    a = grant(leases, limit=3)
    b = grant(leases, limit=3)
    assert {a.slot, b.slot} == {0, 2}
    busy = refused(leases.try_acquire("k", TTL, limit=3))
    assert 0 < busy.ttl_left <= TTL  # the soonest TTL end of the holders that have one
    # Joining the line of the full key works too, and leaves TTLs on everything it wrote.
    refused(leases.line.join("k", TTL, waiter="w", first_ms=1, may_wait=True, limit=3))
    assert leases.release_token("k", a.token) and leases.release_token("k", b.token)  # found past the odd slot
    # The line's head takes a freed slot, not the odd one.
    w = leases.line.join("k", TTL, waiter="w", first_ms=1, may_wait=True, limit=3)
    assert isinstance(w, Lease) and w.slot in (0, 2)
    assert redis_client.get(lease_name("t", "k", 1)) == b"x"  # left alone
    for name in redis_client.scan_iter("t:*"):
        if name not in (lease_name("t", "k", 1).encode(), fence_name("t", "k").encode(), EPOCH):
            assert redis_client.pttl(name) > 0, name


def test_a_slot_key_of_another_type_at_slot_0_blocks_it_and_the_other_slots_serve(
    leases: Leases, redis_client: redis.Redis
) -> None:
    redis_client.rpush(lease_name("t", "k"), "x")
    a = grant(leases, limit=2)
    assert a.slot == 1
    refused(leases.try_acquire("k", TTL, limit=2))
    refused(leases.try_acquire("k", TTL, limit=1))
    assert leases.renew(a) is Renewal.OK
    assert leases.release_token("k", a.token)
    assert redis_client.type(lease_name("t", "k")) == b"list"


def test_with_a_fence_retention_every_key_written_has_a_ttl(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t", fence_retention=60_000)
    redis_client.set(lease_name("t", "k", 2), "x")
    held = [grant(leases, limit=4) for _ in range(3)]
    refused(leases.line.join("k", TTL, waiter="w", first_ms=1, may_wait=True, limit=4))
    assert leases.release(held[0])
    for name in redis_client.scan_iter("t:*"):
        if name not in (lease_name("t", "k", 2).encode(), EPOCH):
            assert redis_client.pttl(name) > 0, name


@pytest.mark.parametrize("waiter", ["", "m:0"], ids=["plain-release", "line-release"])
def test_the_release_of_a_holder_from_before_the_key_was_wide_keeps_its_counter_for_the_others(
    redis_client: redis.Redis, waiter: str
) -> None:
    """A holder granted while the key had one holder (its hash names no slot) releases after a limit-3 grant took
    slot 1: the counter, whose width counts slot 1, must outlive that holder (retention 300 ms, its lease 60 s),
    so that a limit-1 request is refused while slot 1 is held, not granted beside it."""
    leases = Leases(redis_client, prefix="t", fence_retention=300)
    narrow = leases.line.join("k", TTL, waiter=waiter) if waiter else leases.try_acquire("k", TTL)
    assert isinstance(narrow, Lease) and narrow.slot == 0
    wide = grant(leases)
    assert wide.slot == 1
    if waiter:
        assert leases.line.release("k", narrow.token, waiter=waiter, fence=narrow.fence, slot=0)
    else:
        assert leases.release(narrow)
    assert redis_client.pttl(fence_name("t", "k")) > 1_000, "the release shortened the counter below its holder"
    time.sleep(0.5)  # past the retention: a counter cut to it would be gone now
    refused(leases.try_acquire("k", TTL))
    assert leases.release(wide)


def test_a_lease_in_a_higher_slot_is_handed_over_and_adopted_in_its_slot(
    leases: Leases, redis_client: redis.Redis
) -> None:
    first = grant(leases)
    handed = grant(leases)  # a web request's grant, handed to a worker with its token and slot
    adopted = leases.adopt("k", handed.token, TTL, slot=handed.slot)
    assert isinstance(adopted, Lease) and adopted.slot == handed.slot and adopted.fence == handed.fence
    assert held_slots(redis_client) == {first.slot: first.token, handed.slot: adopted.token}
    assert isinstance(leases.adopt("k", handed.token, TTL, slot=handed.slot), Busy)  # adopted once
    assert leases.adopt("k", handed.token, TTL, slot=5) is None  # nothing in that slot
    assert leases.renew(adopted) is Renewal.OK
    assert leases.release(adopted)
    assert held_slots(redis_client) == {first.slot: first.token}


def snapshot(client: redis.Redis) -> dict[Any, Any]:
    """Every key of the store and its value (a DUMP), to show that a call wrote nothing."""
    return {name: client.dump(name) for name in sorted(client.keys("t:*"))}


def test_a_caller_declaring_fewer_holder_slots_than_the_key_has_is_asked_for_them_before_any_write(
    leases: Leases, redis_client: redis.Redis
) -> None:
    """Every script is given the names of the slots it reads (it builds none): one that finds the key wider
    than its caller declared answers NEED_SLOTS with the width, having written nothing, and the store asks
    again with them. The key was widened to 3 by another process; here, a limit of 1."""
    holders = [grant(leases) for _ in range(3)]
    fresh = Leases(redis_client, prefix="t")
    # The script, called as a limit-1 caller calls it: asked for the three slots, nothing written.
    before = snapshot(redis_client)
    assert redis_client.eval(*grant_call(waiter="w1", mode=1, first_ms=1)) == [scripts.NEED_SLOTS, 3]
    assert snapshot(redis_client) == before
    # The store asks again with them: a holder of any slot counts, and the waiter takes its place in the line.
    turn = fresh.line.join("k", TTL, waiter="w1", first_ms=1)
    assert isinstance(turn, Busy) and turn.line == 1
    # Releases, each by a process that never saw the key wide: the line's front is called forward.
    assert Leases(redis_client, prefix="t").release(holders[0])
    assert held_slots(redis_client) == {1: holders[1].token, 2: holders[2].token}
    assert Leases(redis_client, prefix="t").release_token("k", holders[2].token)  # looked for in every slot
    assert held_slots(redis_client) == {1: holders[1].token}
