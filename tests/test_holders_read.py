"""Reading a key with several holders (``limit``), on a real Redis: every holder by slot, scans that find each
slot's hash, per-slot fence records, a line whose latest-waiter pointer is no waiter, and ``release_if_dead``
of one holder named by its fence."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from dramatiq_leases.core import (
    Busy,
    Lease,
    LeaseConfigError,
    LeaseInfo,
    Leases,
    LeaseStateError,
    State,
    recovery,
    scripts,
)
from dramatiq_leases.core.keys import lease_name
from dramatiq_leases.exporter import Exporter
from dramatiq_leases.exporter.observer import grant_ending

from .support.waiting import wait_for

META = {"actor": "export_report", "queue": "default", "host": "web-7", "pid": "4242"}


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
    client.pexpire(lease_name(leases.prefix, key, lease.slot), 60_000)
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
        busy = leases.line.join("sync:1", 30_000, waiter=f"m{n}:0", meta=META, latest=True, order=n + 1)
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

    script = leases.runner.register(scripts.RELEASE_IF_DEAD)

    def call(keys: list[str], args: list[Any]) -> Any:
        return leases.runner.call(script, keys, args)

    result = recovery.release_if_dead(call, leases.prefix, 0, "report:4", stale)
    assert result == (False, None, new.fence)
    assert leases.inspect("report:4", slot=new.slot).token == new.token  # type: ignore[union-attr]


@pytest.mark.parametrize("fence", [-1, 1.5, "7", True])
def test_release_if_dead_refuses_a_fence_that_is_no_fence(leases: Leases, fence: object) -> None:
    with pytest.raises(LeaseConfigError, match="fence"):
        leases.release_if_dead("k", fence=fence)  # type: ignore[arg-type]


# the exporter -----------------------------------------------------------------------------------------------

WORK = {"actor": "send_invoice", "queue": "default"}
WORK_LABELS = (("actor_name", "send_invoice"), ("queue_name", "default"))


def scrape(exporter: Exporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of the exporter's registry, by name and labels (its ``/metrics``, read in process)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in exporter.registry.collect()
        for sample in family.samples
    }


def test_the_exporter_says_how_full_keys_are_per_actor_never_per_key(leases: Leases) -> None:
    full = [grant(leases, "tenant:1", meta=WORK) for _ in range(3)]
    lone = grant(leases, "tenant:2", meta=WORK)  # one of three
    grant(leases, "invoice:1", limit=1)  # a key of one holder is full while held
    exporter = Exporter(leases, host="127.0.0.1", port=0)
    try:
        exporter.observer.scan()
        samples = scrape(exporter)
        assert samples[("dramatiq_lease_present", WORK_LABELS)] == 4, "each holder is a lease present"
        assert samples[("dramatiq_lease_keys_full", WORK_LABELS)] == 1
        assert samples[("dramatiq_lease_key_saturation", WORK_LABELS)] == 1.0
        other = (("actor_name", "export_report"), ("queue_name", "default"))
        assert (samples[("dramatiq_lease_keys_full", other)], samples[("dramatiq_lease_key_saturation", other)]) == (
            1,
            1.0,
        )
        assert not any("tenant" in str(labels) for _, labels in samples), "never a key in a label"

        assert leases.release(full[1])
        exporter.observer.scan()
        samples = scrape(exporter)
        assert samples[("dramatiq_lease_keys_full", WORK_LABELS)] == 0
        assert samples[("dramatiq_lease_key_saturation", WORK_LABELS)] == pytest.approx(2 / 3)
        for lease in (full[0], full[2], lone):
            assert leases.release(lease)
        exporter.observer.scan()
        samples = scrape(exporter)
        assert samples[("dramatiq_lease_key_saturation", WORK_LABELS)] == 0, "kept, at zero, once nothing is held"
    finally:
        exporter.close()


def test_the_busy_page_has_a_row_per_holder_and_each_hot_key_says_how_full_it_is(
    leases: Leases, redis_client: redis.Redis
) -> None:
    alive = grant(leases, "tenant:3")
    leaked = dead(leases, redis_client, "tenant:3")
    third = grant(leases, "tenant:3")
    assert isinstance(leases.line.join("tenant:3", 30_000, waiter="m9:0", meta=META, limit=3), Busy)
    exporter = Exporter(leases, host="127.0.0.1", port=0)
    try:
        exporter.observer.scan()
        doc = exporter.observer.busy_json()
        rows = [(r["key"], r["slot"], r["fence"], r["holders"], r["limit"], r["state"]) for r in doc["leases"]]
        assert rows[0] == ("tenant:3", leaked.slot, leaked.fence, 3, 3, "holder_dead"), "the leak first"
        assert sorted(rows[1:]) == [
            ("tenant:3", alive.slot, alive.fence, 3, 3, "alive"),
            ("tenant:3", third.slot, third.fence, 3, 3, "alive"),
        ]
        assert doc["leases"][0]["inspect_command"] == "dramatiq-leases show 'tenant:3'"
        (hot,) = doc["hot_keys"]
        assert (hot["key"], hot["held"], hot["holders"], hot["limit"], hot["state"]) == (
            "tenant:3",
            True,
            3,
            3,
            "holder_dead",
        ), "the worst holder's state speaks for the key"
        assert hot["line_length"] == 1
    finally:
        exporter.close()


@pytest.mark.parametrize(
    ("state", "slot", "ending"),
    [
        ({"fence": 9, "width": 2, "g:1": 7, "r:1": 7}, 1, "released"),
        ({"fence": 9, "width": 2, "g:1": 7}, 1, "expired"),  # the last of its slot, never released
        ({"fence": 9, "width": 2, "g:1": 8, "e:1": 7}, 1, "expired"),  # the next grant of its slot found it
        ({"fence": 9, "width": 2, "g:1": 8, "r:1": 8, "e:1": 5}, 1, "released"),
        ({"fence": 9, "width": 2, "g:0": 9, "r:0": 9}, 1, "unknown"),  # another slot's records say nothing of it
        ({"fence": 7, "released": 7, "width": 2, "g:0": 9}, None, "released"),  # granted before the key went wide
    ],
)
def test_how_a_grant_of_a_slot_ended_is_told_from_that_slots_records(
    state: dict[str, int], slot: int | None, ending: str
) -> None:
    assert grant_ending(7, state, slot).value == ending


def test_the_exporter_tells_a_released_holder_from_one_that_expired(leases: Leases) -> None:
    """Two holders of one key end, one by release and one by TTL: only the second is an expiry (the counter's
    last fence is the released one's, which a reading of the key-wide records would call expired)."""
    expires = grant(leases, "tenant:4", ttl=1_000, limit=2, meta=WORK)
    released = grant(leases, "tenant:4", limit=2, meta=WORK)
    assert released.fence > expires.fence
    exporter = Exporter(leases, host="127.0.0.1", port=0)
    try:
        exporter.observer.scan()
        assert leases.release(released)
        wait_for(lambda: leases.holders("tenant:4") == [], timeout=5, what="the short lease to expire")
        exporter.observer.scan()
        samples = scrape(exporter)
        assert samples[("dramatiq_lease_expired_total", WORK_LABELS)] == 1
        assert samples[("dramatiq_lease_ended_unknown_total", WORK_LABELS)] == 0
    finally:
        exporter.close()
