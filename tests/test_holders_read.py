"""Reading a key with several holders (``limit``), on a real Redis: every holder by slot, scans that find each
slot's hash, per-slot fence records, a line whose latest-waiter pointer is no waiter, and ``release_if_dead``
of one holder named by its fence."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from dramatiq_leases.core import Busy, Lease, LeaseConfigError, LeaseInfo, Leases, LeaseStateError, State, recovery

from .support.waiting import wait_for

META = {"actor": "export_report", "queue": "default", "host": "web-7", "pid": "4242"}


@pytest.fixture
def leases(redis_client: redis.Redis) -> Leases:
    return Leases(redis_client)


def grant(leases: Leases, key: str, *, limit: int = 3, ttl: int = 30_000, **kwargs: Any) -> Lease:
    kwargs.setdefault("interval", 10_000)  # as a worker's heartbeat would declare
    meta = {**META, **kwargs.pop("meta", {})}
    got = leases.try_acquire(key, ttl, limit=limit, meta=meta, **kwargs)
    assert isinstance(got, Lease), got
    return got


def dead(leases: Leases, client: redis.Redis, key: str, *, limit: int = 3) -> Lease:
    """A holder of ``key`` whose deadline has passed while its hash is still there: a 1 s TTL (its holder stops
    trusting it 0.9 s after the grant), the hash's TTL then extended by hand."""
    lease = grant(leases, key, limit=limit, ttl=1_000, interval=300)
    client.pexpire(leases._keys(key, lease.slot)[0], 60_000)
    wait_for(
        lambda: (i := leases.inspect(key, slot=lease.slot)) is not None and i.state is State.HOLDER_DEAD,
        timeout=5,
        what="the holder's deadline to pass",
    )
    return lease


def test_holders_are_every_slot_of_a_key_by_slot_each_with_its_own_fence(leases: Leases) -> None:
    granted = [grant(leases, "report:7", meta={"message_id": f"m{n}"}) for n in range(3)]
    assert isinstance(leases.try_acquire("report:7", 30_000, limit=3), Busy), "three of three"
    found = leases.holders("report:7")
    assert [(i.slot, i.fence, i.token, i.meta["message_id"]) for i in found] == [
        (lease.slot, lease.fence, lease.token, f"m{n}") for n, lease in enumerate(granted)
    ]
    assert [i.slot for i in found] == [0, 1, 2]
    assert all(i.key == "report:7" and i.limit == 3 and i.per_slot for i in found)
    one = leases.inspect("report:7", slot=1)
    assert one is not None and (one.slot, one.token) == (1, granted[1].token)

    # A holder in the middle leaves: the others stay, by slot.
    assert leases.release(granted[1])
    assert [(i.slot, i.fence) for i in leases.holders("report:7")] == [(0, granted[0].fence), (2, granted[2].fence)]
    assert leases.inspect("report:7", slot=1) is None


def test_a_key_of_one_holder_has_one_and_a_free_key_none(leases: Leases) -> None:
    lease = grant(leases, "invoice:1", limit=1)
    (info,) = leases.holders("invoice:1")
    assert (info.slot, info.fence, info.limit, info.per_slot) == (0, lease.fence, 1, False)
    assert leases.holders("invoice:2") == []
    assert leases.release(lease) and leases.holders("invoice:1") == []


def test_holders_are_found_when_the_fence_counter_is_gone(leases: Leases, redis_client: redis.Redis) -> None:
    # A fleet's fence_retention shorter than a hold expires the counter that says how many slots there are:
    # the holders' own limit says it then.
    granted = [grant(leases, "report:8") for _ in range(3)]
    redis_client.delete(leases.fence_name("report:8"))
    assert [i.fence for i in leases.holders("report:8")] == [lease.fence for lease in granted]


def test_scan_finds_each_holder_of_a_key_by_its_key_and_slot(leases: Leases, redis_client: redis.Redis) -> None:
    for _ in range(3):
        grant(leases, "report:1")
    grant(leases, "report:2", limit=1)
    for _ in range(2):
        grant(leases, "export:{user}:1")  # braces: stored under a digest tag
    grant(leases, "other:1")
    redis_client.set(f"{leases.prefix}:lease:{{report:1}}junk", "x")  # not a slot's name: debris
    every = {(i.key, i.slot) for i in leases.scan()}
    assert {("report:1", 0), ("report:1", 1), ("report:1", 2), ("export:{user}:1", 1)} <= every
    matched = sorted((i.key, i.slot) for i in leases.scan("report:*"))
    assert matched == [("report:1", 0), ("report:1", 1), ("report:1", 2), ("report:2", 0)]
    assert sorted((i.key, i.slot) for i in leases.scan("export:*")) == [("export:{user}:1", 0), ("export:{user}:1", 1)]
    assert sorted((i.key, i.slot) for i in leases.scan("report:1")) == [("report:1", s) for s in range(3)]


def test_fence_state_keeps_each_slots_records_apart(leases: Leases) -> None:
    plain = grant(leases, "k", limit=1)
    assert leases.release(plain)
    assert leases.fence_state("k") == {"fence": plain.fence, "released": plain.fence}
    first, second = grant(leases, "k", limit=2), grant(leases, "k", limit=2)
    assert leases.release(second)
    state = leases.fence_state("k")
    assert state == {
        "fence": second.fence,
        "released": plain.fence,
        "width": 2,
        f"g:{first.slot}": first.fence,
        f"g:{second.slot}": second.fence,
        f"r:{second.slot}": second.fence,
    }


def test_the_latest_waiters_pointer_is_not_counted_as_a_waiter(leases: Leases) -> None:
    grant(leases, "sync:1", limit=1)
    for n in range(2):  # the second supersedes the first: one waiter, and the pointer to it
        busy = leases._line.join("sync:1", 30_000, waiter=f"m{n}:0", meta=META, latest=True)
        assert isinstance(busy, Busy)
    line = leases.inspect_line("sync:1")
    assert line.length == 1 and line.head == "m1:0"
    assert sum(line.states.values()) == 1 and line.actors == {"export_report": 1}
    assert leases.client.hget(f"{leases.prefix}:waiters:{{sync:1}}", "") is not None, "the pointer is there"


# release_if_dead ----------------------------------------------------------------------------------------


def test_release_if_dead_of_a_key_of_several_holders_needs_the_fence(leases: Leases, redis_client: redis.Redis) -> None:
    alive = grant(leases, "report:3")
    leaked = dead(leases, redis_client, "report:3")
    with pytest.raises(LeaseStateError, match=r"2 holders \(fence \d+ in slot 0 \(alive\), fence \d+ in slot 1 "):
        leases.release_if_dead("report:3")
    assert len(leases.holders("report:3")) == 2, "never a guess: nothing released"

    assert leases.release_if_dead("report:3", fence=alive.fence)[::2] == (False, alive.fence)
    released, past, fence = leases.release_if_dead("report:3", fence=leaked.fence)
    assert (released, fence) == (True, leaked.fence) and past is not None and past < 0
    assert [i.fence for i in leases.holders("report:3")] == [alive.fence]
    # Recorded as that slot's release, so the exporter does not count an expiry.
    assert leases.fence_state("report:3")[f"r:{leaked.slot}"] == leaked.fence
    assert leases.release_if_dead("report:3", fence=leaked.fence) == (None, None, 0)

    # One holder left: no fence needed, as for a key of one holder.
    assert leases.release_if_dead("report:3").released is False


def test_release_if_dead_of_a_fence_whose_slot_another_grant_took_touches_nothing(leases: Leases) -> None:
    """Between the read that names a holder and the script, that grant ended and another took its slot: the
    script refuses (the other grant's fence in the answer), whatever that grant's state."""
    grant(leases, "report:4")
    old = grant(leases, "report:4")
    stale: LeaseInfo = leases.holders("report:4")[1]
    assert leases.release(old)
    new = grant(leases, "report:4")
    assert new.slot == old.slot and new.fence > old.fence

    def call(keys: list[str], args: list[Any]) -> Any:
        return leases._call(leases._release_if_dead, keys, args)

    result = recovery.release_if_dead(call, leases.prefix, 0, "report:4", stale)
    assert result == (False, None, new.fence)
    assert leases.inspect("report:4", slot=new.slot).token == new.token  # type: ignore[union-attr]


@pytest.mark.parametrize("fence", [-1, 1.5, "7", True])
def test_release_if_dead_refuses_a_fence_that_is_no_fence(leases: Leases, fence: object) -> None:
    with pytest.raises(LeaseConfigError, match="fence"):
        leases.release_if_dead("k", fence=fence)  # type: ignore[arg-type]
