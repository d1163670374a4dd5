"""N holders per key (``limit``), at the core: slots, fences, expiry, renewal, stale releases, mixed limits, the
per-slot records of the fence counter, and arguments refused before Redis is asked.

The line serving N holders, ``latest`` waiters in it, and replies lost after the command ran (never more than N
holders, whatever a client sends again). Real Redis, real scripts; lost replies come from a TCP proxy that
forwards each command and closes the connection instead of returning its reply (tests/support/lossy.py).
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from dramatiq_leases.core import (
    Busy,
    Heartbeat,
    Lease,
    LeaseConfigError,
    Leases,
    LeaseUnavailableError,
    Renewal,
    scripts,
)
from dramatiq_leases.core.info import text
from dramatiq_leases.core.keys import epoch_name, fence_name, lease_name
from dramatiq_leases.core.lease import new_token
from dramatiq_leases.core.protocol import Turn, Wait
from dramatiq_leases.embedded import EmbeddedRedis

from .support.lossy import LossyProxy, scripts_at_random
from .support.scriptcalls import grant_call
from .support.stack import MakeLeases
from .support.waiting import wait_for

TTL = 10_000
#: The slot's epoch record (the failover grace's), kept for ever by design: the one key the TTL checks leave out.
EPOCH = epoch_name("t", "k").encode()
T = TypeVar("T")


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


# The line serving N ------------------------------------------------------------------------------------


def turn(reply: Lease | Busy) -> Turn:
    assert isinstance(reply, Turn), reply
    return reply


def granted(reply: Lease | Busy) -> Lease:
    assert isinstance(reply, Lease), reply
    return reply


def join(leases: Leases, waiter: str, first_ms: int, *, key: str = "k", **options: Any) -> Lease | Turn:
    options.setdefault("may_wait", True)
    if options.get("latest"):
        options.setdefault("order", first_ms)  # sent in the order of their first attempts, unless told otherwise
    return leases.line.join(key, TTL, waiter=waiter, first_ms=first_ms, **options)


class Waits:
    """Waiters blocking on their wake lists (``Line.wait_turn``) in threads: which were woken, and when."""

    def __init__(self, leases: Leases, key: str = "k") -> None:
        self.leases, self.key = leases, key
        self.woken: dict[str, float] = {}
        self.done: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, waiter: str, block_ms: int) -> None:
        def run() -> None:
            woke = self.leases.line.wait_turn(self.key, waiter, block_ms)
            with self._lock:
                if woke:
                    self.woken[waiter] = time.monotonic()
                self.done.add(waiter)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(15)


def test_the_line_grants_up_to_limit_at_once_in_first_attempt_order(leases: Leases) -> None:
    holders = [granted(leases.try_acquire("k", TTL, limit=3)) for _ in range(3)]
    order = [("w3", 400), ("w0", 100), ("w5", 600), ("w2", 300), ("w1", 200), ("w4", 500)]
    for w, first_ms in order:
        turn(join(leases, w, first_ms, limit=3, may_wait=False))
    assert [turn(join(leases, f"w{i}", 100 * (i + 1), limit=3, may_wait=False)).place for i in range(6)] == list(
        range(6)
    )
    for lease in holders:
        assert leases.release(lease)
    # Three slots free: the first three of the line, in any order among them, and nobody else.
    refused(leases.try_acquire("k", TTL, limit=3))
    turn(join(leases, "w3", 400, limit=3))
    turn(join(leases, "late", 1_000, limit=3))
    third = granted(join(leases, "w2", 300, limit=3))
    first = granted(join(leases, "w0", 100, limit=3))
    turn(join(leases, "w3", 400, limit=3))  # one slot left: still w1's
    second = granted(join(leases, "w1", 200, limit=3))
    assert sorted([first.slot, second.slot, third.slot]) == [0, 1, 2]
    turn(join(leases, "w3", 400, limit=3))  # full
    # A released slot goes to the front: w3, then w4, then the late one.
    assert leases.line.release("k", second.token, waiter="w1", slot=second.slot)
    turn(join(leases, "w4", 500, limit=3))
    refused(leases.try_acquire("k", TTL, limit=3))
    assert granted(join(leases, "w3", 400, limit=3)).slot == second.slot
    assert leases.line.release("k", first.token, waiter="w0")  # slot found by token
    assert granted(join(leases, "w4", 500, limit=3)).slot == first.slot


def test_releases_wake_as_many_waiters_in_place_as_slots_are_free(leases: Leases) -> None:
    holders = [granted(leases.try_acquire("k", 60_000, limit=3)) for _ in range(3)]
    # ready + limit - 1 = 4 may wait in place; the fifth parks.
    answers = [turn(join(leases, f"w{i}", i + 1, limit=3, ready=2)) for i in range(5)]
    assert [a.wait for a in answers] == [Wait.IN_PLACE] * 4 + [Wait.PARK]
    waits = Waits(leases)
    for i in range(4):
        waits.start(f"w{i}", 1_500)
    time.sleep(0.1)  # let them block (a wake-up before the block waits in the list anyway)
    released = time.monotonic()
    assert leases.release(holders[0])
    assert leases.release(holders[1])
    wait_for(lambda: len(waits.woken) == 2, timeout=1, what="two waiters woken")
    assert set(waits.woken) == {"w0", "w1"}
    assert all(t - released < 0.5 for t in waits.woken.values())
    waits.join()
    assert set(waits.woken) == {"w0", "w1"}  # w2 and w3 blocked to the end of their block
    a, b = granted(join(leases, "w1", 2, limit=3)), granted(join(leases, "w0", 1, limit=3))
    assert {a.slot, b.slot} == {holders[0].slot, holders[1].slot}
    turn(join(leases, "w2", 3, limit=3))
    # One more release: one more waiter woken, the next of the line.
    waits = Waits(leases)
    waits.start("w2", 1_500)
    waits.start("w3", 1_500)
    time.sleep(0.1)
    assert leases.line.release("k", a.token, waiter="w1", slot=a.slot)
    wait_for(lambda: "w2" in waits.woken, timeout=1, what="w2 woken")
    waits.join()
    assert set(waits.woken) == {"w2"}


# latest waiters in the line ----------------------------------------------------------------------------


def test_a_newer_latest_waiter_supersedes_the_older_and_wakes_it(leases: Leases) -> None:
    holder = granted(leases.try_acquire("k", TTL))
    old = turn(join(leases, "old", 100, latest=True))
    assert old.wait is Wait.IN_PLACE
    waits = Waits(leases)
    waits.start("old", 5_000)
    time.sleep(0.1)
    joined = time.monotonic()
    new = turn(join(leases, "new", 200, latest=True))
    assert new.wait is Wait.IN_PLACE and new.place == 0 and new.line == 1
    wait_for(lambda: "old" in waits.woken, timeout=2, what="the superseded waiter to be woken")
    assert waits.woken["old"] - joined < 1
    assert turn(join(leases, "old", 100, latest=True)).wait is Wait.SUPERSEDED
    assert leases.line.hold("k", ["old", "new"], "chan:x") == ["s", "r"]
    assert leases.release(holder)
    assert granted(join(leases, "new", 200, latest=True))
    assert turn(join(leases, "old", 100, latest=True)).wait is Wait.SUPERSEDED  # still, after the grant


def test_an_older_latest_waiter_arriving_after_a_newer_is_superseded_itself(leases: Leases) -> None:
    holder = granted(leases.try_acquire("k", TTL, limit=2))
    granted(leases.try_acquire("k", TTL, limit=2))
    turn(join(leases, "new", 200, latest=True, limit=2))
    assert turn(join(leases, "old", 100, latest=True, limit=2)).wait is Wait.SUPERSEDED
    assert turn(join(leases, "new", 200, latest=True, limit=2)).place == 0  # untouched
    assert leases.line.hold("k", ["old"], "chan:x") == ["s"]
    assert leases.release(holder)
    assert granted(join(leases, "new", 200, latest=True, limit=2)).slot == holder.slot


def test_a_superseded_parked_waiter_is_told_on_its_holders_channel(leases: Leases, redis_client: redis.Redis) -> None:
    granted(leases.try_acquire("k", TTL))
    # ready=0: nobody waits in place; both park.
    assert turn(join(leases, "old", 100, latest=True, may_wait=False, ready=0)).wait is Wait.PARK
    assert leases.line.hold("k", ["old"], "chan:x", ready=0) == ["p"]
    pubsub = redis_client.pubsub()
    try:
        pubsub.subscribe("chan:x")
        wait_for(lambda: pubsub.get_message(timeout=0.1) is not None, what="the subscription")
        turn(join(leases, "new", 200, latest=True, may_wait=False, ready=0))
        message: Any = wait_for(lambda: pubsub.get_message(timeout=0.1), timeout=2, what="the PUBLISH")
        assert message["channel"] == b"chan:x" and message["data"] == b"old"
    finally:
        pubsub.close()
    assert leases.line.hold("k", ["old"], "chan:x", ready=0) == ["s"]


def test_waiters_that_are_not_latest_are_never_superseded(leases: Leases) -> None:
    holder = granted(leases.try_acquire("k", TTL))
    turn(join(leases, "a", 100, ready=4))
    turn(join(leases, "b", 200, latest=True, ready=4))
    turn(join(leases, "c", 300, ready=4))
    turn(join(leases, "d", 400, latest=True, ready=4))  # supersedes b only
    assert leases.line.hold("k", ["a", "b", "c", "d"], "chan:x", ready=4) == ["r", "s", "r", "r"]
    assert leases.release(holder)
    assert granted(join(leases, "a", 100))


def test_a_grant_outside_the_line_keeps_the_latest_pointer(leases: Leases) -> None:
    a = granted(leases.try_acquire("k", TTL, limit=2))
    b = granted(leases.try_acquire("k", TTL, limit=2))
    turn(join(leases, "old", 100, latest=True, limit=2))
    assert leases.release(a) and leases.release(b)  # two free slots, one waiter at the front
    outsider = granted(leases.try_acquire("k", TTL, limit=2))  # takes the slot the front leaves
    assert leases.release(outsider)
    granted(join(leases, "new", 200, latest=True, limit=2))  # the newest runs
    assert turn(join(leases, "old", 100, latest=True, limit=2)).wait is Wait.SUPERSEDED  # and the older must not


def test_a_latest_waiter_is_as_new_as_its_order_not_its_first_attempt(leases: Leases) -> None:
    """The newest is the one sent last (its order), whenever each reached the key: one sent before the key's
    latest waiter supersedes itself on arrival, naming it; one sent after it supersedes it."""
    granted(leases.try_acquire("k", TTL))
    assert turn(join(leases, "a:0", 0, latest=True, order=200)).wait is Wait.IN_PLACE  # placed at the server's now
    stale = turn(join(leases, "b:0", 0, latest=True, order=100))  # sent before a, arrives after it
    assert (stale.wait, stale.newer) == (Wait.SUPERSEDED, "a")
    assert turn(join(leases, "a:0", 0, latest=True, order=200)).wait is Wait.IN_PLACE  # untouched, asks again
    assert leases.line.hold("k", ["a:0", "b:0"], "chan:x") == ["r", "s"]
    newer = turn(join(leases, "c:0", 1, latest=True, order=300))  # sent after a: its first attempt is older
    assert newer.wait is Wait.IN_PLACE and newer.place == 0
    again = turn(join(leases, "a:0", 0, latest=True, order=200))
    assert (again.wait, again.newer) == (Wait.SUPERSEDED, "c")


def test_inspect_line_does_not_count_the_latest_pointer(leases: Leases) -> None:
    granted(leases.try_acquire("k", TTL))
    turn(join(leases, "w", 100, latest=True, meta={"actor": "sync"}))
    line = leases.inspect_line("k")
    assert line.length == 1
    assert line.states == {"in_place": 1}
    assert line.actors == {"sync": 1}


# The fence counter holds the width -----------------------------------------------------------------------


def test_a_lower_limit_counts_high_slots_past_the_retention(redis_client: redis.Redis) -> None:
    """The counter's width outlives the holders of a wide key, whatever the retention: a lower limit still
    counts the high slots (a grant of a wide key keeps the counter as long as its lease, renewals too)."""
    leases = Leases(redis_client, prefix="t", fence_retention=200)
    held = [granted(leases.try_acquire("k", TTL, limit=4)) for _ in range(4)]
    assert leases.release(held[0]) and leases.release(held[1])  # slots 2 and 3 hold on
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started > 0.4, timeout=2, what="twice the retention to pass")
    assert leases.renew_many(held[2:]) == [Renewal.OK, Renewal.OK]
    counter = fence_name("t", "k")
    assert redis_client.pttl(counter) >= min(redis_client.pttl(f"t:lease:{{k}}:{s}") for s in (2, 3)) - 50
    assert len(held_now := held_slots(redis_client, upto=12)) == 2, held_now
    refused(leases.try_acquire("k", TTL, limit=2))  # two hold: a limit of 2 is met


def test_release_token_finds_a_high_slot_past_the_retention(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t", fence_retention=200)
    held = [granted(leases.try_acquire("k", TTL, limit=3)) for _ in range(3)]
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started > 0.4, timeout=2, what="twice the retention to pass")
    assert redis_client.exists(fence_name("t", "k")), "the counter of a wide key expired under its holders"
    assert leases.release_token("k", held[2].token)
    assert held[2].slot not in held_slots(redis_client, upto=12)


def test_the_last_single_holders_expiry_is_recorded_when_a_key_becomes_wide(
    leases: Leases, redis_client: redis.Redis
) -> None:
    single = granted(leases.try_acquire("k", 300))
    wait_for(lambda: not redis_client.exists(lease_name("t", "k")), timeout=2, what="the lease to expire")
    granted(leases.try_acquire("k", TTL, limit=2))  # a deploy raised lock_limit
    record = redis_client.hgetall(fence_name("t", "k"))
    assert str(single.fence).encode() in (record.get(b"expired"), record.get(b"e:0"))


# Lost replies -------------------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as s:
        yield s


def answered(call: Callable[[], T], tries: int = 200) -> tuple[T, int]:
    """``call``'s answer, calling it again (same arguments, so the same token) after each lost reply; and how
    many replies were lost on the way."""
    for lost in range(tries):
        try:
            return call(), lost
        except LeaseUnavailableError:
            continue
    pytest.fail(f"no answer after {tries} lost replies")


def lossy_leases(proxy: LossyProxy, *, retries: int = 0, **options: Any) -> Leases:
    """A store whose client talks through ``proxy``; redis-py retries ``retries`` times itself (0: only ours)."""
    client = redis.Redis(port=proxy.port, socket_timeout=2, retry=Retry(NoBackoff(), retries))
    leases = Leases(client, prefix="t", **options)
    for source in (scripts.ACQUIRE, scripts.RELEASE):
        client.script_load(source)  # a lost NOSCRIPT reply would be a command that did not run
    return leases


class Holders:
    """What the test believes is held, and the most Redis was seen holding at once (sampled atomically)."""

    def __init__(self, direct: redis.Redis, limit: int) -> None:
        self.direct, self.limit = direct, limit
        self.believed: dict[str, int] = {}  # token -> slot: granted, and no release sent yet
        self.lock = threading.Lock()
        self.most = 0
        self._stop = threading.Event()
        self._names = [lease_name("t", "k", s) for s in range(limit + 4)]
        self._monitor = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, int(self.direct.exists(*self._names)))
            with self.lock:
                self.most = max(self.most, len(self.believed))
            time.sleep(0.002)

    def __enter__(self) -> Holders:
        self._monitor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._monitor.join(5)

    def in_redis(self) -> dict[str, int]:
        return {token: slot for slot, token in held_slots(self.direct, upto=self.limit + 4).items()}


def run_rounds(leases: Leases, holders: Holders, rounds: int, seed: int, *, keep_last: bool) -> list[str]:
    """One thread's rounds: acquire (retrying lost replies with the same token), check, release (likewise).
    Returns the problems seen; the last grant is kept if ``keep_last``."""
    rng = random.Random(seed)
    problems: list[str] = []
    for i in range(rounds):
        token = new_token()
        reply, _ = answered(functools.partial(leases.try_acquire, "k", 20_000, token=token, limit=holders.limit))
        if not isinstance(reply, Lease):
            continue
        lease = reply
        with holders.lock:
            if token in holders.believed or lease.slot in holders.believed.values():
                problems.append(f"slot {lease.slot} granted twice")
            holders.believed[token] = lease.slot
        if holders.direct.hget(lease_name("t", "k", lease.slot), "token") != token.encode():
            problems.append(f"granted slot {lease.slot} is not held by its token")
        if keep_last and i == rounds - 1:
            break
        if rng.random() < 0.3:
            time.sleep(0.001)
        with holders.lock:
            del holders.believed[token]  # before the release is sent: another may take the slot at once
        if rng.random() < 0.5:
            released, lost = answered(functools.partial(leases.release, lease))
        else:
            released, lost = answered(functools.partial(leases.release_token, "k", token))  # slot found by token
        if not released and not lost:
            problems.append(f"release of slot {lease.slot} refused though no reply was lost")
    return problems


@pytest.mark.parametrize("thread_connections", [False, True])
def test_lost_replies_retried_with_the_same_token_never_exceed_the_limit(
    server: EmbeddedRedis, thread_connections: bool
) -> None:
    limit, threads, rounds = 3, 6, 400
    direct = redis.Redis(port=server.port)
    with LossyProxy(server.port, scripts_at_random(0.2, seed=21)) as proxy, Holders(direct, limit) as holders:
        leases = lossy_leases(proxy, thread_connections=thread_connections)
        results: list[list[str]] = [[] for _ in range(threads)]

        def worker(n: int) -> None:
            results[n] = run_rounds(leases, holders, rounds, seed=n, keep_last=True)

        pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(120)
        assert [p for r in results for p in r] == []
        assert proxy.lost > 200  # the run did lose replies (about a fifth of some 3 000 script calls)
        # Afterwards Redis holds exactly what the test believes, never more than the limit at any instant.
        assert holders.in_redis() == holders.believed
        assert 0 < len(holders.believed) <= limit
        assert holders.most <= limit
        # And all of it can be released (lost replies and all).
        for token in list(holders.believed):
            answered(functools.partial(leases.release_token, "k", token))
        assert holders.in_redis() == {}
        plain = Leases(direct, prefix="t")
        assert sorted(granted(plain.try_acquire("k", 1_000, limit=limit)).slot for _ in range(limit)) == [0, 1, 2]


def test_redis_pys_own_retries_after_lost_replies_never_exceed_the_limit(server: EmbeddedRedis) -> None:
    """redis-py (8.x) resends a command whose connection closed by itself: the same script, the same token."""
    limit, threads = 3, 6
    direct = redis.Redis(port=server.port)
    with LossyProxy(server.port, scripts_at_random(0.2, seed=7)) as proxy, Holders(direct, limit) as holders:
        leases = lossy_leases(proxy, retries=20)
        kept: list[Lease] = []

        def worker(n: int) -> None:
            for i in range(150):
                lease = leases.try_acquire("k", 20_000, limit=limit)  # its token chosen before the first send
                if isinstance(lease, Lease):
                    with holders.lock:
                        holders.believed[lease.token] = lease.slot
                        if i == 149:
                            kept.append(lease)
                            break
                        del holders.believed[lease.token]
                    leases.release(lease)  # answers False when its first reply was lost: see below

        pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(120)
        assert proxy.lost > 100
        assert holders.in_redis() == holders.believed == {lease.token: lease.slot for lease in kept}
        assert holders.most <= limit


def test_a_release_whose_reply_was_lost_is_a_no_op_when_sent_again(server: EmbeddedRedis) -> None:
    direct = redis.Redis(port=server.port)
    lose_next = threading.Event()

    def lose(commands: Sequence[list[bytes]]) -> bool:
        if lose_next.is_set() and any(c[0].upper() == b"EVALSHA" for c in commands):
            lose_next.clear()
            return True
        return False

    with LossyProxy(server.port, lose) as proxy:
        leases = lossy_leases(proxy)
        a, b, c = (granted(leases.try_acquire("k", TTL, limit=3)) for _ in range(3))
        lose_next.set()
        with pytest.raises(LeaseUnavailableError):
            leases.release(b)
        assert proxy.lost == 1
        counter_after = direct.hgetall(fence_name("t", "k"))
        assert counter_after[f"r:{b.slot}".encode()] == str(b.fence).encode()  # it ran
        assert leases.release(b) is False
        assert leases.release_token("k", b.token) is False
        assert direct.hgetall(fence_name("t", "k")) == counter_after
        assert held_slots(direct, upto=12) == {a.slot: a.token, c.slot: c.token}
        d = granted(leases.try_acquire("k", TTL, limit=3))
        assert d.slot == b.slot
        assert leases.release(b) is False  # and later still, with d in its slot
        assert held_slots(direct, upto=12)[b.slot] == d.token


def test_grants_whose_replies_were_abandoned_expire_within_their_ttl(server: EmbeddedRedis) -> None:
    """A client that gives up after a lost reply (no retry) leaves at most a grant that ends by its TTL."""
    direct = redis.Redis(port=server.port)
    with LossyProxy(server.port, scripts_at_random(0.5, seed=3)) as proxy:
        leases = lossy_leases(proxy)
        for _ in range(200):
            try:
                lease = leases.try_acquire("k", 300, limit=3)
            except LeaseUnavailableError:
                continue  # abandoned: perhaps granted, perhaps not
            if isinstance(lease, Lease):
                with contextlib.suppress(LeaseUnavailableError):
                    leases.release(lease)
        assert proxy.lost > 50
        abandoned_at = time.monotonic()
    wait_for(lambda: held_slots(direct, upto=12) == {}, timeout=2, what="abandoned grants to expire")
    assert time.monotonic() - abandoned_at < 0.3 + 1.0  # their TTL, and slack for a loaded machine
    leases = Leases(direct, prefix="t")
    assert sorted(granted(leases.try_acquire("k", 1_000, limit=3)).slot for _ in range(3)) == [0, 1, 2]


def lose_once(sha: str) -> tuple[Callable[[Sequence[list[bytes]]], bool], threading.Event]:
    """A loser of the next reply of the script ``sha``, once armed."""
    armed = threading.Event()

    def lose(commands: Sequence[list[bytes]]) -> bool:
        if armed.is_set() and any(c[0].upper() == b"EVALSHA" and c[1] == sha.encode() for c in commands):
            armed.clear()
            return True
        return False

    return lose, armed


def test_a_line_grant_asked_again_after_a_lost_reply_still_says_it_came_from_the_line(server: EmbeddedRedis) -> None:
    with LossyProxy(server.port) as proxy:
        leases = lossy_leases(proxy)
        holder = granted(leases.try_acquire("k", TTL, limit=2))
        granted(leases.try_acquire("k", TTL, limit=2))
        turn(leases.line.join("k", TTL, waiter="w", first_ms=1, limit=2))
        assert leases.release(holder)
        proxy.lose, armed = lose_once(leases.runner.register(scripts.ACQUIRE).sha)
        armed.set()
        token = new_token()
        with pytest.raises(LeaseUnavailableError):
            leases.line.join("k", TTL, waiter="w", first_ms=1, limit=2, token=token)
        again = granted(leases.line.join("k", TTL, waiter="w", first_ms=1, limit=2, token=token))
        assert again.slot == holder.slot
        assert again.from_line


@pytest.mark.parametrize("plain", [True, False])
def test_a_with_block_whose_release_reply_was_lost_does_not_claim_an_overlap(
    server: EmbeddedRedis, plain: bool
) -> None:
    """The release answered again says released earlier, by the plain script as by the general one."""
    with LossyProxy(server.port) as proxy:
        leases = lossy_leases(proxy, retries=3)
        leases.grants.plain = plain
        script = scripts.RELEASE_PLAIN if plain else scripts.RELEASE
        proxy.lose, armed = lose_once(leases.runner.register(script).sha)
        with leases.lease("k", TTL):
            armed.set()
        assert proxy.lost == 1


def test_a_width_written_by_hand_past_the_maximum_does_not_wedge_the_key(
    leases: Leases, redis_client: redis.Redis
) -> None:
    granted(leases.try_acquire("k", TTL, limit=2))
    redis_client.hset(fence_name("t", "k"), "width", "100000")
    assert granted(leases.try_acquire("k", TTL, limit=2)).slot == 1
