"""What the waiters of a line wait for, as the exporter sees it: the key's rate (``lock_rate``), or a holder.

Real Redis, real grants and lines (``Leases.try_acquire(..., rate=...)``, ``Leases.line.join(..., rates=...)``):
a key over its rate keeps its waiters waiting for the rate, with when its next start may come; a held key keeps
them waiting for its holder. ``dramatiq_lease_waiting_for{reason}`` splits ``dramatiq_lease_waiting`` so, the
Busy view's hot keys say it row by row, and what it costs is counted: one HMGET of the key's fence counter per
line, in the pipeline that reads the line; nothing for a key without waiters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from dramatiq_leases.core import Busy, Lease, Leases
from dramatiq_leases.core.rates import parse_rates
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.exporter import WAIT_REASONS, Exporter
from dramatiq_leases.exporter.page import BUSY_PAGE

from .support.exporters import scrape, server_ms
from .support.stack import MakeLeases

PREFIX = "t"
VENDOR = {"actor": "call_vendor", "queue": "default", "host": "worker-1", "pid": "11"}
INVOICE = {"actor": "send_invoice", "queue": "default", "host": "worker-2", "pid": "22"}


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """Leases in database 1 under the prefix ``t``, as a fleet's would be beside its broker."""
    return make_leases(1, prefix=PREFIX)


@pytest.fixture
def exporter(leases: Leases) -> Iterator[Exporter]:
    """An exporter whose scans the test runs itself (``exporter.observer.scan()``)."""
    exporter = Exporter(leases, host="127.0.0.1", port=0)
    yield exporter
    exporter.close()


def grant(leases: Leases, key: str, meta: dict[str, str], rate: str | None = None) -> Lease:
    lease = leases.try_acquire(key, 60_000, meta=meta, rate=rate)
    assert isinstance(lease, Lease), lease
    return lease


def join(leases: Leases, key: str, n: int, meta: dict[str, str], rate: str | None = None) -> None:
    """``n`` messages find ``key`` busy (full, or over ``rate``) and take places in its line."""
    for i in range(n):
        reply = leases.line.join(key, 60_000, meta=meta, waiter=f"{key}-m{i}:0", rates=parse_rates(rate))
        assert isinstance(reply, Busy), reply


def waiting_for(exporter: Exporter, actor: str) -> dict[str, float]:
    """``dramatiq_lease_waiting_for`` of ``actor``, by reason, as served on ``/metrics``."""
    return {
        dict(labels)["reason"]: value
        for (name, labels), value in scrape(exporter).items()
        if name == "dramatiq_lease_waiting_for" and dict(labels)["actor_name"] == actor
    }


def hot_key(exporter: Exporter, key: str) -> dict[str, Any]:
    rows: list[dict[str, Any]] = exporter.observer.busy_json()["hot_keys"]
    (row,) = [row for row in rows if row["key"] == key]
    return row


def over_rate(leases: Leases, key: str, rate: str, meta: dict[str, str]) -> None:
    """``key`` granted (and released) as often as ``rate`` allows: free, and over its rate for a window."""
    count = int(rate.split("/")[0])
    for _ in range(count):
        assert leases.release(grant(leases, key, meta, rate))


def test_a_free_key_over_its_rate_keeps_its_waiters_waiting_for_the_rate(leases: Leases, exporter: Exporter) -> None:
    over_rate(leases, "vendor:1", "2/m", VENDOR)
    join(leases, "vendor:1", 3, VENDOR, rate="2/m")
    assert leases.fence_state("vendor:1") and leases.inspect("vendor:1") is None  # granted before, held by nobody

    snap = exporter.observer.scan()
    assert snap.waiting_for == {("call_vendor", "rate"): 3}
    assert waiting_for(exporter, "call_vendor") == {"rate": 3, "holder": 0}
    assert scrape(exporter)[("dramatiq_lease_waiting", (("actor_name", "call_vendor"),))] == 3
    row = hot_key(exporter, "vendor:1")
    assert (row["waiting_for"], row["state"], row["held"], row["line_length"]) == ("rate", "free", False, 3)
    # The rate's window is a minute and both its grants were just now: the next start is almost a minute away.
    assert 50_000 < row["next_start_ms"] <= 60_000
    (line,) = leases.scan_lines()
    assert line.waiting_for_rate and line.next_start_ms == pytest.approx(row["next_start_ms"], abs=5_000)


def test_a_held_key_keeps_its_waiters_waiting_for_its_holder(leases: Leases, exporter: Exporter) -> None:
    grant(leases, "invoice:1", INVOICE)
    join(leases, "invoice:1", 2, INVOICE)
    # A key with a rate that still allows more, held: waiting for its holder too.
    grant(leases, "vendor:2", VENDOR, rate="5/m")
    join(leases, "vendor:2", 1, VENDOR, rate="5/m")

    snap = exporter.observer.scan()
    assert snap.waiting_for == {("send_invoice", "holder"): 2, ("call_vendor", "holder"): 1}
    assert waiting_for(exporter, "send_invoice") == {"rate": 0, "holder": 2}
    assert waiting_for(exporter, "call_vendor") == {"rate": 0, "holder": 1}
    for key in ("invoice:1", "vendor:2"):
        row = hot_key(exporter, key)
        assert (row["waiting_for"], row["next_start_ms"], row["state"], row["held"]) == ("holder", None, "alive", True)


def test_each_actor_is_split_by_what_its_lines_wait_for(leases: Leases, exporter: Exporter) -> None:
    """One actor, two keys: one over its rate, one held. The split adds up to dramatiq_lease_waiting, and an actor
    seen once stays at zero (both reasons) once its lines are gone."""
    over_rate(leases, "vendor:1", "1/m", VENDOR)
    join(leases, "vendor:1", 2, VENDOR, rate="1/m")
    held = grant(leases, "vendor:2", VENDOR, rate="5/m")
    join(leases, "vendor:2", 3, VENDOR, rate="5/m")

    exporter.observer.scan()
    split = waiting_for(exporter, "call_vendor")
    assert split == {"rate": 2, "holder": 3}
    assert sum(split.values()) == scrape(exporter)[("dramatiq_lease_waiting", (("actor_name", "call_vendor"),))]
    assert set(split) == set(WAIT_REASONS)

    for key in ("vendor:1", "vendor:2"):
        leases.line.leave(key, [f"{key}-m{i}:0" for i in range(3)])
    assert leases.release(held)
    exporter.observer.scan()
    assert waiting_for(exporter, "call_vendor") == {"rate": 0, "holder": 0}


def test_a_hold_on_the_key_counts_as_its_rate(leases: Leases, exporter: Exporter) -> None:
    """``hold_until`` (a hold the key's last holder put on it) holds the waiters back as a rate does: the later of
    it and ``rate_until`` says until when."""
    lease = grant(leases, "vendor:3", VENDOR)
    join(leases, "vendor:3", 1, VENDOR)
    assert leases.release(lease)
    until = server_ms(leases) + 30_000
    leases.client.hset(leases.fence_name("vendor:3"), mapping={"hold_until": until, "rate_until": until - 20_000})

    exporter.observer.scan()
    assert waiting_for(exporter, "call_vendor") == {"rate": 1, "holder": 0}
    row = hot_key(exporter, "vendor:3")
    assert row["waiting_for"] == "rate" and 20_000 < row["next_start_ms"] <= 30_000

    # Once both are past, nothing holds the line back but its turn.
    leases.client.hset(leases.fence_name("vendor:3"), mapping={"hold_until": 1, "rate_until": 2})
    exporter.observer.scan()
    assert waiting_for(exporter, "call_vendor") == {"rate": 0, "holder": 1}
    assert hot_key(exporter, "vendor:3")["next_start_ms"] is None


def test_a_fence_counter_of_the_wrong_type_hides_no_line(leases: Leases, exporter: Exporter) -> None:
    grant(leases, "invoice:2", INVOICE)
    join(leases, "invoice:2", 1, INVOICE)
    leases.client.delete(leases.fence_name("invoice:2"))
    leases.client.set(leases.fence_name("invoice:2"), "not a counter")

    snap = exporter.observer.scan()
    assert snap.waiting_for == {("send_invoice", "holder"): 1}
    assert leases.fence_name("invoice:2") in snap.unreadable
    assert hot_key(exporter, "invoice:2")["waiting_for"] == "holder"


# --- what it costs --------------------------------------------------------------------------------------------


def calls_during(client: redis.Redis, action: Callable[[], object]) -> dict[str, int]:
    """Redis commands (by name) executed while ``action`` ran, excluding INFO itself."""

    def stats() -> dict[str, int]:
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in client.info("commandstats").items()}

    before = stats()
    action()
    after = stats()
    diff = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    diff.pop("info", None)
    return diff


def test_a_key_without_waiters_costs_no_command_and_a_line_one_hmget(
    leases: Leases, exporter: Exporter, redis_server: EmbeddedRedis
) -> None:
    """Keys without waiters (with a rate or not, over it or not) cost the scan no command of this: their fence
    counters are not read. A key with waiters costs one HMGET of its counter, in the pipeline that reads its line."""
    client = redis.Redis.from_url(redis_server.url(1))
    try:
        grant(leases, "invoice:1", INVOICE)
        grant(leases, "vendor:1", VENDOR, rate="5/m")
        over_rate(leases, "vendor:2", "1/m", VENDOR)
        exporter.observer.scan()  # the scripts loaded, the grants seen

        quiet = calls_during(client, exporter.observer.scan)
        assert "hmget" not in quiet, quiet  # (the leases' HGETALLs are the lease script's own)

        join(leases, "invoice:1", 2, INVOICE)
        join(leases, "vendor:2", 1, VENDOR, rate="1/m")
        lined = calls_during(client, exporter.observer.scan)
        # Per line: its head, its length, its waiters, and now its counter's two fields: one command more, in the
        # same pipeline (one TIME, the pipeline's clock, for both lines). Nothing else changed.
        assert lined["hmget"] == lined["zcard"] == lined["hvals"] == lined["zrange"] == 2, lined
        assert lined["time"] == quiet.get("time", 0) + 1, lined
        line_read = {"zrange", "zcard", "hvals", "hmget", "time"}
        assert {name: n for name, n in lined.items() if name not in line_read} == {
            name: n for name, n in quiet.items() if name not in line_read
        }
        assert exporter.observer.snapshot.waiting_for == {("send_invoice", "holder"): 2, ("call_vendor", "rate"): 1}
    finally:
        client.close()


def test_the_busy_page_says_what_a_line_waits_for() -> None:
    page = BUSY_PAGE.decode()
    assert "<th>Waiting for</th>" in page
    assert '"waiting for rate (next start in "' in page and '"waiting for a holder"' in page
