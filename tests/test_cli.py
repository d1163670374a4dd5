"""The ``dramatiq-leases`` command on a real Redis: what it shows, what it refuses, and its exit codes."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import redis

from dramatiq_leases.cli import main
from dramatiq_leases.core import Lease, Leases, State
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.waiting import wait_for

META = {"actor": "send_invoice", "queue": "default", "message_id": "msg-1", "host": "web-7", "pid": "4242"}


def cli(capsys: pytest.CaptureFixture[str], server: EmbeddedRedis, *argv: str) -> tuple[int, str, str]:
    code = main(["--redis-url", server.url(), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def acquire(leases: Leases, key: str, **kwargs: object) -> Lease:
    kwargs.setdefault("interval", 10_000)  # as a worker's heartbeat would declare
    lease = leases.try_acquire(key, kwargs.pop("ttl", 30_000), **kwargs)  # type: ignore[arg-type]
    assert isinstance(lease, Lease)
    return lease


def overdue_lease(leases: Leases, key: str, **kwargs: object) -> Lease:
    """A lease whose holder stopped renewing but may still be running: it promised a 10 ms heartbeat and sent
    none, and its 60 s TTL keeps its deadline (54 s after the grant) far away."""
    kwargs.setdefault("ttl", 60_000)
    lease = acquire(leases, key, interval=10, meta=META, **kwargs)
    wait_for(
        lambda: (i := leases.inspect(key)) is not None and i.state is State.HEARTBEAT_OVERDUE,
        timeout=5,
        what="the heartbeat to be overdue",
    )
    return lease


def dead_lease(leases: Leases, client: redis.Redis, key: str) -> Lease:
    """A lease whose holder's deadline has passed while the key is still there.

    A 1 s TTL puts the holder's deadline 0.9 s after the grant; the key's TTL is then extended by hand, as
    an operator (or a buggy script) might, so that it outlives that deadline.
    """
    lease = acquire(leases, key, ttl=1_000, interval=300, meta=META)
    client.pexpire(leases.lease_name(key), 60_000)
    wait_for(
        lambda: (i := leases.inspect(key)) is not None and i.state is State.HOLDER_DEAD,
        timeout=5,
        what="the holder's deadline to pass",
    )
    return lease


# list ---------------------------------------------------------------------


def test_list_shows_every_lease_with_holder_fence_and_state(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    first = acquire(leases, "invoice:1", meta=META)
    acquire(leases, "invoice:3", ttl=1_000)
    redis_client.persist(leases.lease_name("invoice:3"))  # someone removed its TTL: it would never expire
    dead_lease(leases, redis_client, "invoice:2")
    wait_for(
        lambda: leases.inspect("invoice:3").state is State.NO_TTL,  # type: ignore[union-attr]
        timeout=5,
        what="the deadline of the holder of the key without TTL to pass",
    )
    acquire(leases, "invoice:4", max_hold=60_000)
    redis_client.hset(leases.lease_name("invoice:4"), "max_hold_until_ms", 1)  # its maximum hold has passed
    redis_client.set(f"{leases.prefix}:lease:by-hand", "x")  # debris under the prefix, no TTL
    overdue_lease(leases, "invoice:5")

    code, out, _ = cli(capsys, redis_server, "list")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["KEY"].split()[:4] == ["KEY", "ACTOR", "MESSAGE", "HOLDER"]
    assert lines["invoice:1"].split()[1:4] == ["send_invoice", "msg-1", "web-7:4242"]
    assert lines["invoice:1"].split()[-2:] == [str(first.fence), "alive"]
    assert lines["invoice:2"].endswith("holder_dead")
    assert lines["invoice:3"].endswith("no_ttl") and " none " in lines["invoice:3"]
    assert lines["invoice:4"].endswith("past_max_hold")
    assert lines["invoice:5"].endswith("heartbeat_overdue")
    assert lines[f"{leases.prefix}:lease:by-hand"].endswith("no_ttl")
    assert f"note: {leases.prefix}:lease:by-hand is a string key, not a lease hash" in out
    assert "note: heartbeat_overdue: renewals are late, but the holder may still be running" in out
    assert "note: holder_dead, past_max_hold, no_ttl: leaked" in out

    code, out, _ = cli(capsys, redis_server, "ls", "--json")
    assert code == 0
    rows = {row["key"]: row for row in json.loads(out)}
    assert {k: r["state"] for k, r in rows.items()} == {
        "invoice:1": "alive",
        "invoice:2": "holder_dead",
        "invoice:3": "no_ttl",
        "invoice:4": "past_max_hold",
        "invoice:5": "heartbeat_overdue",
        f"{leases.prefix}:lease:by-hand": "no_ttl",
    }
    assert {k for k, r in rows.items() if r["leaked"]} == {
        "invoice:2",
        "invoice:3",
        "invoice:4",
        f"{leases.prefix}:lease:by-hand",
    }
    assert rows["invoice:1"]["message_id"] == "msg-1"
    assert rows["invoice:1"]["holder"] == "web-7:4242"
    assert rows["invoice:1"]["fence"] > 10**15  # the grant's server time in µs
    assert 0 < rows["invoice:1"]["ttl_left"] <= 30_000
    assert rows["invoice:5"]["holder_deadline"] == rows["invoice:5"]["renewed_at"] + 54.0
    assert rows[f"{leases.prefix}:lease:by-hand"]["problem"] == "a string key, not a lease hash"
    assert all("token" not in row for row in rows.values()), "list must never print owner tokens"


def test_list_match_is_a_glob_on_the_lease_key_even_with_braces(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    acquire(leases, "invoice:1")
    acquire(leases, "export:{user}:7")  # stored under a digest hash tag, not under its own name

    code, out, _ = cli(capsys, redis_server, "list", "--json", "--match", "export:*")
    assert code == 0
    assert [row["key"] for row in json.loads(out)] == ["export:{user}:7"]

    code, out, _ = cli(capsys, redis_server, "list", "--match", "invoice:*")
    assert code == 0
    assert "invoice:1" in out and "export" not in out

    code, out, _ = cli(capsys, redis_server, "list", "--match", "nothing:*")
    assert code == 0
    assert out == "no leases matching 'nothing:*' under prefix 'dramatiq-leases'\n"


def test_list_with_nothing_there(capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis) -> None:
    assert cli(capsys, redis_server, "list") == (0, "no leases under prefix 'dramatiq-leases'\n", "")
    assert cli(capsys, redis_server, "list", "--json") == (0, "[]\n", "")


def test_prefix_selects_the_leases_and_flags_work_after_the_command(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    acquire(leases, "invoice:1")
    acquire(Leases.from_url(redis_server.url(), prefix="billing"), "invoice:2")

    assert main(["list", "--json", "--prefix", "billing", "--redis-url", redis_server.url()]) == 0
    assert [row["key"] for row in json.loads(capsys.readouterr().out)] == ["invoice:2"]


def test_redis_url_defaults_to_the_environment(
    capsys: pytest.CaptureFixture[str],
    redis_server: EmbeddedRedis,
    leases: Leases,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    acquire(leases, "invoice:1")
    monkeypatch.setenv("REDIS_URL", redis_server.url())
    assert main(["list", "--json"]) == 0
    assert [row["key"] for row in json.loads(capsys.readouterr().out)] == ["invoice:1"]


# show ---------------------------------------------------------------------


def test_show_prints_every_field_and_the_fence_counter(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    first = acquire(leases, "invoice:1")
    leases.release(first)
    lease = acquire(leases, "invoice:1", meta=META)

    code, out, _ = cli(capsys, redis_server, "show", "invoice:1")
    assert code == 0
    fields = dict(re.split(r" {2,}", line, maxsplit=1) for line in out.splitlines())
    assert fields["key"] == "invoice:1"
    assert fields["fence"] == str(lease.fence)
    assert fields["state"].startswith("alive")
    assert fields["message_id"] == "msg-1" and fields["host"] == "web-7" and fields["pid"] == "4242"
    assert fields["fence counter"] == f"last fence {lease.fence}, last released {first.fence}"
    assert fields["renew interval"] == "10.0s"
    assert fields["overdue after"] == "20.5s without a heartbeat (a warning: the holder may still run)"
    assert re.fullmatch(r"\S+ \(in 2[67]\.\ds\): no holder trusts the lease after it", fields["holder deadline"])
    assert re.fullmatch(r"at \S+ \(in (29\.\d|30\.0)s\)", fields["expires"])
    assert lease.token not in out, "the owner token is a capability: only --show-token prints it"

    code, out, _ = cli(capsys, redis_server, "show", "invoice:1", "--json", "--show-token")
    assert code == 0
    data = json.loads(out)
    assert data["token"] == lease.token
    assert data["fence_state"] == {"fence": lease.fence, "released": first.fence}
    assert data["state"] == "alive" and data["leaked"] is False and data["actor"] == "send_invoice"
    assert data["overdue_after"] == 20.5 and 29 < data["deadline_in"] <= 30
    assert data["holder_deadline"] == data["renewed_at"] + 27.0


def test_show_shows_the_line_of_waiters(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    lease = acquire(leases, "invoice:2", meta=META)
    code, out, _ = cli(capsys, redis_server, "show", "invoice:2")
    assert dict(re.split(r" {2,}", line, maxsplit=1) for line in out.splitlines())["line"] == "empty"
    server_ms = int(leases.client.time()[0]) * 1000
    for n, first in ((1, server_ms - 5_000), (2, server_ms - 1_000)):
        assert not leases.line.join("invoice:2", 10_000, meta=META, waiter=f"m{n}:0", first_ms=first)
    code, out, _ = cli(capsys, redis_server, "show", "invoice:2")
    line = dict(re.split(r" {2,}", row, maxsplit=1) for row in out.splitlines())["line"]
    assert re.fullmatch(r"2 waiting \(2 parked\); head m1:0; oldest waiting [56]\.\ds", line), line
    code, out, _ = cli(capsys, redis_server, "show", "invoice:2", "--json")
    assert json.loads(out)["line"]["length"] == 2 and json.loads(out)["line"]["actors"] == {"send_invoice": 2}
    # Released: the key is free for a moment, its head on its way; show says so rather than "no lease".
    assert leases.release(lease)
    code, out, _ = cli(capsys, redis_server, "show", "invoice:2")
    assert code == 0 and out.startswith("no lease on 'invoice:2' right now; line: 2 waiting"), out


def test_show_missing_lease_exits_3(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    assert cli(capsys, redis_server, "show", "invoice:9") == (
        3,
        "",
        "dramatiq-leases: no lease on 'invoice:9' under prefix 'dramatiq-leases'\n",
    )
    last = acquire(leases, "invoice:9")
    leases.release(last)
    code, _, err = cli(capsys, redis_server, "show", "invoice:9", "--json")
    assert code == 3
    assert f"the last grant had fence {last.fence}" in err


def test_show_says_what_is_wrong_with_a_key_of_the_wrong_type_rather_than_blame_redis(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    """A string where a key's line should be, a string where a held lease's fence counter should be, a list
    where a lease should be: ``show`` names the key and what it is (exit 0), never "cannot use Redis" (exit 4)."""
    line = "dramatiq-leases:line:{broken}"
    redis_client.set(line, "hand-written")
    code, out, err = cli(capsys, redis_server, "show", "broken")
    assert (code, err) == (0, ""), err
    assert "no lease on 'broken' right now" in out
    assert f"note: {line} is a string key, not a line of waiters (a sorted set)" in out
    code, out, err = cli(capsys, redis_server, "show", "broken", "--json")
    assert code == 0 and json.loads(out)["unreadable"] == {line: "a string key, not a line of waiters (a sorted set)"}

    acquire(leases, "invoice:7", meta=META)
    fence = leases.fence_name("invoice:7")
    redis_client.delete(fence)
    redis_client.set(fence, "not a counter")
    code, out, err = cli(capsys, redis_server, "show", "invoice:7")
    assert (code, err) == (0, ""), err
    assert "send_invoice" in out and re.search(r"state\s+alive", out)
    assert f"note: {fence} is a string key, not a fence counter (a hash)" in out
    code, out, _ = cli(capsys, redis_server, "show", "invoice:7", "--json")
    data = json.loads(out)
    assert code == 0 and data["fence_state"] == {} and list(data["unreadable"]) == [fence]

    redis_client.rpush(leases.lease_name("stray"), "x")
    code, out, err = cli(capsys, redis_server, "show", "stray")
    assert (code, err) == (0, "")
    assert out.startswith("dramatiq-leases:lease:{stray} is a list key, not a lease hash (TTL left: none)")


# release ------------------------------------------------------------------


def test_release_owner_releases_only_for_the_holding_token(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    lease = acquire(leases, "invoice:1", meta=META)

    code, out, err = cli(capsys, redis_server, "release", "invoice:1", "--owner", "not-the-token")
    assert (code, out) == (1, "")
    assert err.startswith(
        f"dramatiq-leases: refused: 'invoice:1' is held by another owner (fence {lease.fence}, web-7:4242)"
    )
    info = leases.inspect("invoice:1")
    assert info is not None and info.token == lease.token, "a refused release must not touch the lease"

    code, out, _ = cli(capsys, redis_server, "release", "invoice:1", "--owner", lease.token)
    assert code == 0
    assert out == f"released 'invoice:1' (fence {lease.fence}, held by web-7:4242): the token matched.\n"
    assert leases.inspect("invoice:1") is None
    assert leases.fence_state("invoice:1")["released"] == lease.fence  # a release, not an expiry, for the fence history


def test_show_explains_each_state(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    def state_of(key: str) -> str:
        code, out, _ = cli(capsys, redis_server, "show", key)
        assert code == 0
        return dict(re.split(r" {2,}", line, maxsplit=1) for line in out.splitlines())["state"]

    overdue_lease(leases, "invoice:1")
    note = state_of("invoice:1")
    assert note.startswith("heartbeat_overdue: renewals are late: none for ")
    assert re.search(
        r"the holder may still be running under the lease until its deadline \S+ \(in 5\d\.\ds\); "
        r"the lease ends by its TTL at \S+ \(in 5\d\.\ds\)\. It is not leaked",
        note,
    ), note
    assert "--if-dead" not in note and "release" not in note, "an overdue holder may still run: never suggest release"

    dead_lease(leases, redis_client, "invoice:2")
    note = state_of("invoice:2")
    assert note.startswith(
        "holder_dead: leaked: its holder's deadline and the safety margin its actor had to stop passed at "
    )
    assert "no holder can still be running under it" in note and "`release --if-dead` ends it now" in note

    acquire(leases, "invoice:3")
    redis_client.persist(leases.lease_name("invoice:3"))
    assert state_of("invoice:3").startswith("alive: the holder's heartbeat is renewing it")  # its deadline is ahead

    leases.try_acquire("invoice:4", 30_000)  # not heartbeated: taken in a web request, waiting to be adopted
    assert state_of("invoice:4").startswith("alive: not heartbeated (taken outside a worker, waiting to be adopted)")


def test_release_if_dead_refuses_a_live_holder_and_says_why(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    lease = acquire(leases, "invoice:1", meta=META)

    code, out, err = cli(capsys, redis_server, "release", "invoice:1", "--if-dead")
    assert (code, out) == (1, "")
    assert f"refused: the holder of 'invoice:1' (fence {lease.fence}, web-7:4242) is alive" in err
    assert re.search(
        r"its last heartbeat was 0\.\ds ago, and it relies on the lease until its deadline plus the safety margin its actor has to stop, in "
        r"(29|30)\.\ds \(\S+\); nothing changed",
        err,
    ), err
    assert len(err.splitlines()) == 1
    info = leases.inspect("invoice:1")
    assert info is not None and info.token == lease.token

    leases.try_acquire("invoice:2", 30_000)  # nobody heartbeats it: a web request's lease, waiting for a worker
    code, _, err = cli(capsys, redis_server, "release", "invoice:2", "--if-dead")
    assert code == 1 and "is not heartbeated (taken outside a worker, waiting to be adopted)" in err
    assert leases.inspect("invoice:2") is not None


def test_release_if_dead_spares_an_overdue_holder_until_its_deadline(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    """The bug an adversarial review found: a late heartbeat is not a dead holder.

    A holder trusts its lease until its own deadline (the last renewal it sent plus the TTL, less a 10%
    safety margin), however late its heartbeat. Releasing the lease before then lets a second worker run
    beside the first.
    """
    lease = overdue_lease(leases, "invoice:1")
    code, out, _ = cli(capsys, redis_server, "list")
    assert code == 0
    (row,) = (line for line in out.splitlines() if line.startswith("invoice:1 "))
    assert row.endswith("heartbeat_overdue")

    code, out, err = cli(capsys, redis_server, "release", "invoice:1", "--if-dead")
    assert (code, out) == (1, "")
    assert err.startswith(
        f"dramatiq-leases: refused: the heartbeat of 'invoice:1' (fence {lease.fence}, web-7:4242) is overdue"
    )
    assert re.search(
        r"its holder may still be running under the lease until its deadline plus the safety margin its actor has to stop, in 5\d\.\ds \(\S+\)",
        err,
    )
    assert len(err.splitlines()) == 1
    info = leases.inspect("invoice:1")
    assert info is not None and info.token == lease.token, "an overdue holder's lease must stay"
    assert lease.remaining() > 50, "and its holder still trusts it"

    # Once the holder's deadline has passed (a short TTL, the key kept alive past it by hand), it is leaked.
    short = dead_lease(leases, redis_client, "invoice:2")
    assert short.remaining() == 0, "the holder no longer trusts it"
    code, out, _ = cli(capsys, redis_server, "list", "--json", "--match", "invoice:2")
    assert code == 0 and [row["state"] for row in json.loads(out)] == ["holder_dead"]
    code, out, _ = cli(capsys, redis_server, "release", "invoice:2", "--if-dead")
    assert code == 0
    assert re.fullmatch(
        rf"released 'invoice:2' \(fence {short.fence}, held by web-7:4242\): its holder's deadline and safety margin passed "
        r"\d+\.\ds ago, so no holder could still be running under it\.\n",
        out,
    ), out
    assert leases.inspect("invoice:2") is None
    assert leases.fence_state("invoice:2")["released"] == short.fence


def test_release_if_dead_releases_leaked_leases(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    acquire(leases, "invoice:1", max_hold=60_000, meta=META)
    redis_client.hset(leases.lease_name("invoice:1"), "max_hold_until_ms", 1)  # its maximum hold has passed
    code, out, _ = cli(capsys, redis_server, "release", "invoice:1", "--if-dead")
    assert code == 0 and "its maximum hold ended" in out
    assert leases.inspect("invoice:1") is None

    # A key without TTL whose hash names no holder deadline (written by hand): nobody else could end it.
    redis_client.hset(leases.lease_name("invoice:2"), mapping={"token": "t", "fence": 3, "key": "invoice:2"})
    code, out, _ = cli(capsys, redis_server, "release", "invoice:2", "--if-dead")
    assert code == 0
    assert out == (
        "released 'invoice:2' (fence 3, held by -): it named no holder deadline and had no TTL, "
        "so it would never have expired.\n"
    )
    assert leases.inspect("invoice:2") is None

    # The same, with a TTL: it ends by itself, so it is not ours to end.
    redis_client.hset(leases.lease_name("invoice:3"), mapping={"token": "t", "fence": 4, "key": "invoice:3"})
    redis_client.pexpire(leases.lease_name("invoice:3"), 60_000)
    code, _, err = cli(capsys, redis_server, "release", "invoice:3", "--if-dead")
    assert code == 1
    assert "refused: 'invoice:3' (fence 4) names no holder deadline, and expires by itself by its TTL at " in err
    assert leases.inspect("invoice:3") is not None

    # Debris under the prefix: released without TTL, refused with one.
    redis_client.set(leases.lease_name("by-hand"), "x")
    code, out, _ = cli(capsys, redis_server, "release", "by-hand", "--if-dead")
    assert code == 0 and "it is not a lease hash, and had no TTL" in out
    redis_client.set(leases.lease_name("by-hand"), "x", px=60_000)
    code, _, err = cli(capsys, redis_server, "release", "by-hand", "--if-dead")
    assert code == 1 and "is not a lease hash, and expires by itself" in err


@pytest.mark.parametrize("how", [["--owner", "abc"], ["--if-dead"]])
def test_release_of_a_missing_lease_exits_3(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, how: list[str]
) -> None:
    code, out, err = cli(capsys, redis_server, "release", "invoice:9", *how)
    assert (code, out) == (3, "")
    assert err == ("dramatiq-leases: no lease on 'invoice:9' under prefix 'dramatiq-leases'; nothing to release\n")


@pytest.mark.parametrize("how", [[], ["--owner", "abc", "--if-dead"]])
def test_release_needs_exactly_one_of_owner_and_if_dead(
    capsys: pytest.CaptureFixture[str],
    redis_server: EmbeddedRedis,
    leases: Leases,
    redis_client: redis.Redis,
    how: list[str],
) -> None:
    dead_lease(leases, redis_client, "invoice:1")
    code, out, err = cli(capsys, redis_server, "release", "invoice:1", *how)
    assert (code, out) == (2, "")
    assert "--owner" in err and "--if-dead" in err
    assert leases.inspect("invoice:1") is not None, "a usage error must not release anything"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis) -> None:
    assert cli(capsys, redis_server)[0] == 2  # no command
    assert cli(capsys, redis_server, "frobnicate")[0] == 2
    code, _, err = cli(capsys, redis_server, "--prefix", "a*", "list")
    assert code == 2 and "prefix must be" in err
    code, _, err = cli(capsys, redis_server, "show", "")
    assert code == 2 and "lease key must be a non-empty string" in err
    assert main(["--redis-url", "http://example.com", "list"]) == 2
    assert "invalid --redis-url" in capsys.readouterr().err


# keys several may hold at once (lock_limit) ------------------------------------


def wide(leases: Leases, key: str, n: int, *, limit: int = 3) -> list[Lease]:
    """``n`` holders of ``key``, which ``limit`` may hold at once, each a message of its own."""
    return [acquire(leases, key, limit=limit, meta={**META, "message_id": f"msg-{i}"}) for i in range(n)]


def test_show_shows_every_holder_of_a_key_several_hold(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    held = wide(leases, "report:1", 2, limit=4)
    leaked = dead_lease_in(leases, redis_client, "report:1", limit=4)
    code, out, err = cli(capsys, redis_server, "show", "report:1")
    assert (code, err) == (0, "")
    head, *blocks = out.split("\n\n")
    fields = dict(re.split(r" {2,}", line, maxsplit=1) for line in head.splitlines())
    assert fields["key"] == "report:1"
    assert fields["holders"] == "3 of 4 (slots 0, 1, 2)"
    assert fields["fence counter"] == f"last fence {leaked.fence}, width 4"
    assert [block.splitlines()[0] for block in blocks] == [
        f"slot 0 (fence {held[0].fence}, alive)",
        f"slot 1 (fence {held[1].fence}, alive)",
        f"slot 2 (fence {leaked.fence}, holder_dead)",
    ]
    third = dict(re.split(r" {2,}", line.strip(), maxsplit=1) for line in blocks[2].splitlines()[1:])
    assert third["message_id"] == "msg-dead" and third["redis key"] == "dramatiq-leases:lease:{report:1}:2"
    assert third["slot records"] == f"last granted {leaked.fence}"
    assert third["state"].startswith("holder_dead: leaked")
    assert all(lease.token not in out for lease in held)

    code, out, _ = cli(capsys, redis_server, "show", "report:1", "--json", "--show-token")
    data = json.loads(out)
    assert code == 0 and (data["held"], data["limit"]) == (3, 4)
    assert [(h["slot"], h["fence"], h["state"], h["token"]) for h in data["holders"]] == [
        (0, held[0].fence, "alive", held[0].token),
        (1, held[1].fence, "alive", held[1].token),
        (2, leaked.fence, "holder_dead", leaked.token),
    ]
    # The first holder at the top, as for a key of one holder.
    assert (data["fence"], data["token"], data["message_id"]) == (held[0].fence, held[0].token, "msg-0")
    assert data["fence_state"]["width"] == 4 and data["fence_state"]["g:2"] == leaked.fence

    # One holder left of a key several may hold: the usual fields, with how many may hold it.
    for lease in held:
        assert leases.release(lease)
    code, out, _ = cli(capsys, redis_server, "show", "report:1")
    fields = dict(re.split(r" {2,}", line, maxsplit=1) for line in out.splitlines())
    assert code == 0 and fields["holders"] == "1 of 4 (slot 2)" and fields["fence"] == str(leaked.fence)
    assert fields["slot records"] == f"last granted {leaked.fence}"


def dead_lease_in(leases: Leases, client: redis.Redis, key: str, *, limit: int) -> Lease:
    """:func:`dead_lease`, as one holder of a key ``limit`` may hold."""
    lease = acquire(leases, key, ttl=1_000, interval=300, limit=limit, meta={**META, "message_id": "msg-dead"})
    client.pexpire(f"{leases.lease_name(key)}:{lease.slot}" if lease.slot else leases.lease_name(key), 60_000)
    wait_for(
        lambda: (i := leases.inspect(key, slot=lease.slot)) is not None and i.state is State.HOLDER_DEAD,
        timeout=5,
        what="the holder's deadline to pass",
    )
    return lease


def test_list_shows_a_row_per_holder_and_how_full_each_key_is(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    held = wide(leases, "report:1", 2)
    one = acquire(leases, "invoice:1", meta=META)
    code, out, _ = cli(capsys, redis_server, "list")
    rows = out.splitlines()
    assert code == 0 and rows[0].split()[-3:] == ["HELD", "FENCE", "STATE"]
    assert [row.split()[0] for row in rows[1:]] == ["invoice:1", "report:1", "report:1"]
    assert [row.split()[-3:] for row in rows[1:]] == [
        ["1/1", str(one.fence), "alive"],
        ["2/3", str(held[0].fence), "alive"],
        ["2/3", str(held[1].fence), "alive"],
    ]
    code, out, _ = cli(capsys, redis_server, "list", "--json", "--match", "report:*")
    assert code == 0
    assert [(r["key"], r["slot"], r["limit"], r["holders"], r["message_id"]) for r in json.loads(out)] == [
        ("report:1", 0, 3, 2, "msg-0"),
        ("report:1", 1, 3, 2, "msg-1"),
    ]


def test_release_if_dead_of_a_key_several_hold_judges_the_holder_its_fence_names(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    (alive,) = wide(leases, "report:2", 1)
    leaked = dead_lease_in(leases, redis_client, "report:2", limit=3)

    # Which one is never guessed: a usage error naming them, nothing released.
    code, out, err = cli(capsys, redis_server, "release", "report:2", "--if-dead")
    assert (code, out) == (2, "")
    assert f"'report:2' has 2 holders (fence {alive.fence} in slot 0 (alive, web-7:4242); fence {leaked.fence}" in err
    assert "--fence N" in err and len(err.splitlines()) == 1
    assert len(leases.holders("report:2")) == 2

    code, out, err = cli(capsys, redis_server, "release", "report:2", "--if-dead", "--fence", str(alive.fence))
    assert (code, out) == (1, "") and "refused: the holder of 'report:2'" in err and "is alive" in err
    code, _, err = cli(capsys, redis_server, "release", "report:2", "--if-dead", "--fence", "999")
    assert code == 3 and "no holder of 'report:2' has fence 999" in err

    code, out, err = cli(capsys, redis_server, "release", "report:2", "--if-dead", "--fence", str(leaked.fence))
    assert (code, err) == (0, "")
    assert out.startswith(f"released 'report:2' (fence {leaked.fence}, held by web-7:4242): its holder's deadline")
    assert [info.fence for info in leases.holders("report:2")] == [alive.fence], "the live holder keeps its slot"

    # --fence names a holder to judge; --owner's token names one already.
    code, _, err = cli(capsys, redis_server, "release", "report:2", "--owner", alive.token, "--fence", "1")
    assert code == 2 and "--fence goes with --if-dead" in err
    assert leases.holders("report:2") != []


def test_release_owner_finds_the_holder_of_the_token_in_any_slot(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    held = wide(leases, "report:3", 3)
    code, _, err = cli(capsys, redis_server, "release", "report:3", "--owner", "not-the-token")
    assert code == 1 and "refused: none of the 3 holders of 'report:3' has that token" in err
    code, out, _ = cli(capsys, redis_server, "release", "report:3", "--owner", held[2].token)
    assert code == 0 and out == f"released 'report:3' (fence {held[2].fence}, held by web-7:4242): the token matched.\n"
    assert [info.slot for info in leases.holders("report:3")] == [0, 1]


# Redis unreachable -----------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["list"],
        ["show", "invoice:1"],
        ["release", "invoice:1", "--owner", "abc"],
        ["release", "invoice:1", "--if-dead"],
        ["exporter", "--port", "0"],
        ["demo"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_unreachable_redis_exits_4_with_one_line_naming_the_url(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    port = free_port()  # nothing listens there
    code = main(["--redis-url", f"redis://:hunter2@127.0.0.1:{port}/0", *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (4, "")
    assert err.startswith(f"dramatiq-leases: cannot use Redis at redis://:***@127.0.0.1:{port}/0: ")
    assert len(err.splitlines()) == 1
    assert "hunter2" not in err, "the password must not be printed"


# The installed console script -------------------------------------------------


def _script() -> str:
    return str(Path(sys.executable).with_name("dramatiq-leases"))


def test_console_script_lists_leases_and_documents_its_exit_codes(redis_server: EmbeddedRedis, leases: Leases) -> None:
    acquire(leases, "invoice:1", meta=META)
    done = subprocess.run(
        [_script(), "--redis-url", redis_server.url(), "list", "--json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert [row["key"] for row in json.loads(done.stdout)] == ["invoice:1"]

    done = subprocess.run([_script(), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    codes = ("0    success", "1    refused", "2    usage error", "3    not found", "4    Redis unreachable")
    for line in codes:
        assert line in done.stdout

    port = free_port()
    done = subprocess.run(
        [_script(), "--redis-url", f"redis://127.0.0.1:{port}/0", "show", "invoice:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 4
    assert done.stderr.startswith(f"dramatiq-leases: cannot use Redis at redis://127.0.0.1:{port}/0: ")
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.skipif(
    importlib.util.find_spec("dramatiq_leases.exporter") is None, reason="dramatiq_leases.exporter is not written yet"
)
def test_exporter_serves_metrics_until_stopped(redis_server: EmbeddedRedis, leases: Leases) -> None:
    acquire(leases, "invoice:1", meta=META)
    port = free_port()
    proc = subprocess.Popen(
        [
            _script(),
            "--redis-url",
            redis_server.url(),
            "exporter",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--interval",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        def scrape() -> str | None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
                    return str(response.read().decode())
            except OSError:
                return None

        assert wait_for(scrape, timeout=15, what="the exporter to serve /metrics")
    finally:
        proc.terminate()
        proc.wait(10)
