"""The scripts' protocol (``core/protocol.py``): each request's arguments as the Lua names them, and the
commands each option adds to a grant and a release: a plain lease pays for no option it does not use.
Real Redis; the commands counted by the server (``INFO commandstats``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import redis

from dramatiq_leases.core import Lease, LeaseConfigError, Leases, scripts
from dramatiq_leases.core.protocol import (
    GRANT_ARGV,
    GRANT_PLAIN_ARGV,
    RELEASE_ARGV,
    RELEASE_PLAIN_ARGV,
    GrantRequest,
    Join,
    Released,
    ReleaseRequest,
)

TTL = 60_000


@pytest.mark.parametrize(
    ("script", "names"),
    [
        ("acquire", GRANT_ARGV),
        ("release", RELEASE_ARGV),
        ("acquire_plain", GRANT_PLAIN_ARGV),
        ("release_plain", RELEASE_PLAIN_ARGV),
    ],
)
def test_each_script_header_names_the_arguments_the_encoder_sends(script: str, names: tuple[str, ...]) -> None:
    """One order of arguments, written twice (the Lua's header, Python's names): the two must agree."""
    header = scripts.ALL[script].split("-- Returns", 1)[0].split("-- ARGV", 1)[1]
    assert tuple(re.findall(r"^--   (\d+) (\w+):", header, re.MULTILINE)) == tuple(
        (str(i), name) for i, name in enumerate(names, 1)
    )


def commands(client: redis.Redis, cycle: Callable[[int], Any], n: int = 10) -> dict[str, float]:
    """The Redis commands one ``cycle`` runs, on average over ``n``, after the same ``n`` to warm up (the scripts
    loaded, each key's slot's epoch record written: the failover grace's first grant in a slot writes it)."""
    for i in range(n):
        cycle(i)
    client.config_resetstat()
    for i in range(n):
        cycle(i)
    # The INFO reading these counts is counted after its reply: every INFO counted is a script's.
    return {
        name.removeprefix("cmdstat_"): stat["calls"] / n
        for name, stat in client.info("commandstats").items()
        if name not in ("cmdstat_config|resetstat", "cmdstat_config")
    }


#: A plain lease's grant and release, with the failover grace (on by default: its INFO and epoch record's GET).
PLAIN = {"evalsha": 2, "time": 1, "info": 1, "get": 1, "hmget": 2, "exists": 2, "hset": 3, "pexpire": 1, "del": 1}


def _plus(**more: float) -> dict[str, float]:
    out: dict[str, float] = dict(PLAIN)
    for name, n in more.items():
        out[name] = out.get(name, 0) + n
    return {name: n for name, n in out.items() if n}


@pytest.mark.parametrize(
    ("option", "store", "grant", "expected"),
    [
        ("plain", {}, {}, PLAIN),
        # Without the failover grace: neither the server's replication id nor the slot's epoch record read.
        ("no failover_grace", {"failover_grace": 0}, {}, _plus(info=-1, get=-1)),
        # The counter's TTL, set by the grant and by the release.
        ("fence_retention", {"fence_retention": 600_000}, {}, _plus(pexpire=2)),
        # Two events (granted, released): LPUSH, LTRIM, PEXPIRE each, and the release's clock.
        ("history", {"history": 50}, {}, _plus(lpush=2, ltrim=2, pexpire=2, time=1, hmget=0)),
        # The slot walk: each slot's hash read, the counter's slot records, its width.
        ("limit", {}, {"limit": 4}, None),
    ],
)
def test_each_option_adds_its_own_commands_and_a_plain_lease_none(
    redis_client: redis.Redis,
    option: str,
    store: dict[str, Any],
    grant: dict[str, Any],
    expected: dict[str, float] | None,
) -> None:
    leases = Leases(redis_client, prefix="t", **store)

    def cycle(i: int) -> None:
        lease = leases.try_acquire(f"{option}:{i}", TTL, **grant)
        assert isinstance(lease, Lease) and leases.release(lease)

    calls = commands(redis_client, cycle)
    if expected is None:  # a wider key: more than the plain path, never less
        assert all(calls.get(name, 0) >= n for name, n in PLAIN.items()), calls
        assert calls != PLAIN
    else:
        assert calls == expected


def test_a_unique_grant_ends_its_queued_record_and_only_it_pays_for_that(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t")
    line = leases.line

    def cycle(unique: bool) -> Callable[[int], None]:
        def run(i: int) -> None:
            lease = line.join(f"u:{unique}:{i}", TTL, waiter=f"m{i}:0", unique=unique)
            assert isinstance(lease, Lease) and leases.release(lease)

        return run

    assert "zrem" not in commands(redis_client, cycle(False))
    assert commands(redis_client, cycle(True))["zrem"] == 1


# The plain scripts (lua/acquire_plain.lua, lua/release_plain.lua) ------------------------------------------


def _state(client: redis.Redis) -> dict[str, Any]:
    """Every key's type, value and whether it has a TTL: what a script wrote, compared before and after."""
    out: dict[str, Any] = {}
    for name in sorted(n.decode() if isinstance(n, bytes) else n for n in client.keys("*")):
        kind = client.type(name)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        value: Any
        if kind == "hash":
            value = client.hgetall(name)
        elif kind == "zset":
            value = client.zrange(name, 0, -1, withscores=True)
        else:
            value = client.get(name) if kind == "string" else client.lrange(name, 0, -1)
        out[name] = (kind, value, client.pttl(name) > 0)
    return out


def _plain_grant(client: redis.Redis, request: GrantRequest, retention: int = 0) -> Any:
    keys, args = request.encode_plain("t", retention)
    return client.eval(scripts.ACQUIRE_PLAIN, len(keys), *keys, *args)


def _plain_release(client: redis.Redis, request: ReleaseRequest, retention: int = 0) -> Any:
    keys, args = request.encode_plain("t", retention)
    return client.eval(scripts.RELEASE_PLAIN, len(keys), *keys, *args)


@pytest.mark.parametrize("retention", [None, 600_000])
@pytest.mark.parametrize("waiter", ["", "m1:0"])
def test_the_plain_scripts_write_what_the_general_ones_write_on_a_plain_key(
    redis_client: redis.Redis, retention: int | None, waiter: str
) -> None:
    """Two stores, one of plain scripts and one of the general scripts only: the same grants, expiries and
    releases leave the same counter and lease records, and the same answers."""
    stores = {}
    for plain in (True, False):
        leases = Leases(redis_client, prefix=f"p{plain:d}", fence_retention=retention)
        leases.grants.plain = plain
        stores[plain] = leases

    def request(n: int) -> GrantRequest:
        return GrantRequest("k", f"tok{n}", 60_000, interval=5_000, max_hold=30_000, meta={"actor": "a"}, waiter=waiter)

    answers: dict[bool, list[Any]] = {True: [], False: []}
    for plain, leases in stores.items():
        first = leases.grants.grant(request(1))
        assert isinstance(first, Lease)
        redis_client.delete(leases.lease_name("k"))  # ends as by its TTL: the next grant records the expiry
        second = leases.grants.grant(request(2))
        assert isinstance(second, Lease)
        busy = leases.grants.grant(request(3))
        released = leases.grants.release(ReleaseRequest("k", "tok2", fence=second.fence))
        again = leases.grants.release(ReleaseRequest("k", "tok2", fence=second.fence))
        answers[plain] = [second.fence > first.fence, type(busy).__name__, released, again]

    def records(plain: bool) -> dict[str, Any]:
        state = _state(redis_client)
        prefix = f"p{plain:d}:"
        out = {name.removeprefix(prefix): value for name, value in state.items() if name.startswith(prefix)}
        counter = out["fence:{k}"][1]
        base = int(counter[b"fence"])  # fences are times with a retention: each compared with the last
        for field in (b"fence", b"released", b"expired"):
            counter[field] = (int(counter[field]) > base) - (int(counter[field]) < base) if field in counter else None
        return out

    assert answers[True] == answers[False] == [True, "Turn", Released.NOW, Released.EARLIER]
    assert records(True) == records(False)


def test_the_plain_acquire_leaves_a_busy_lined_remembered_or_wide_key_to_the_general_script(
    redis_client: redis.Redis,
) -> None:
    """NOT_PLAIN, and not a write: the general script then decides, from the same facts."""
    leases = Leases(redis_client, prefix="t")
    held = leases.try_acquire("held", TTL)
    assert isinstance(held, Lease)
    assert isinstance(leases.line.join("lined", TTL, waiter="w1:0"), Lease)
    assert not isinstance(leases.line.join("lined", TTL, waiter="w2:0"), Lease)
    redis_client.zadd("t:done:{ran}", {"m1:0": 10**13})
    assert isinstance(leases.try_acquire("wide", TTL, limit=2), Lease)
    before = _state(redis_client)
    for key, waiter in [("held", ""), ("lined", ""), ("ran", "m1:0"), ("wide", "")]:
        assert _plain_grant(redis_client, GrantRequest(key, "new", TTL, waiter=waiter)) == scripts.NOT_PLAIN, key
    assert _state(redis_client) == before
    # Through the store, the general script decides: the key is free for another waiter, not for the one that ran.
    assert not isinstance(leases.line.join("ran", TTL, waiter="m1:0"), Lease)
    assert isinstance(leases.line.join("ran", TTL, waiter="m2:0"), Lease)


def test_the_plain_release_leaves_a_lined_or_wide_key_to_the_general_script(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t")
    lined = leases.try_acquire("lined", TTL)
    assert isinstance(lined, Lease)
    assert not isinstance(leases.line.join("lined", TTL, waiter="w2:0"), Lease)
    wide = leases.try_acquire("wide", TTL, limit=2)
    assert isinstance(wide, Lease)
    before = _state(redis_client)
    for lease in (lined, wide):
        request = ReleaseRequest(lease.key, lease.token, fence=lease.fence)
        assert _plain_release(redis_client, request) == scripts.NOT_PLAIN, lease.key
    assert _state(redis_client) == before
    assert leases.release(lined) and leases.release(wide)  # the general script releases and hands on
    assert leases.inspect_line("lined").states == {"promoted": 1}


@pytest.mark.parametrize(
    ("script", "argv", "bad"),
    [
        (scripts.ACQUIRE_PLAIN, GRANT_PLAIN_ARGV, {"ttl_ms": "1500.5"}),
        (scripts.ACQUIRE_PLAIN, GRANT_PLAIN_ARGV, {"max_hold_ms": "-1"}),
        (scripts.ACQUIRE_PLAIN, GRANT_PLAIN_ARGV, {"margin_ms": "60000"}),
        (scripts.ACQUIRE_PLAIN, GRANT_PLAIN_ARGV, {"token": ""}),
        (scripts.ACQUIRE_PLAIN, GRANT_PLAIN_ARGV, {"retention_ms": "1e300"}),
        (scripts.ACQUIRE_PLAIN, GRANT_PLAIN_ARGV, {"waiter": "w" * (scripts.MAX_ID_LENGTH + 1)}),
        (scripts.ACQUIRE_PLAIN, GRANT_PLAIN_ARGV, {"fields": "odd"}),
        (scripts.ACQUIRE_PLAIN, GRANT_PLAIN_ARGV, {"grace_ms": "x"}),
        (scripts.ACQUIRE_PLAIN, GRANT_PLAIN_ARGV, {"failover_ms": str(scripts.MAX_MS + 1)}),
        (scripts.RELEASE_PLAIN, RELEASE_PLAIN_ARGV, {"grant": "1.5"}),
        (scripts.RELEASE_PLAIN, RELEASE_PLAIN_ARGV, {"retention_ms": "-1"}),
    ],
)
def test_the_plain_scripts_check_every_argument_before_writing(
    redis_client: redis.Redis, script: str, argv: tuple[str, ...], bad: dict[str, str]
) -> None:
    """Lua is not a transaction: refused before the first write, the lease held or not."""
    held = Leases(redis_client, prefix="t").try_acquire("k", TTL, token="tok")
    assert isinstance(held, Lease)
    if script == scripts.ACQUIRE_PLAIN:
        redis_client.delete("t:lease:{k}")
        keys, args = GrantRequest("k", "tok", TTL).encode_plain("t", 0)
    else:
        keys, args = ReleaseRequest("k", "tok", fence=held.fence).encode_plain("t", 0)
    for name, value in bad.items():
        if name == "fields":
            args.append(value)
        else:
            args[argv.index(name)] = value
    before = _state(redis_client)
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid"):
        redis_client.eval(script, len(keys), *keys, *args)
    assert _state(redis_client) == before


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rules": (-1, 1, 1)}, "ready"),
        ({"rules": (2, 0, 1)}, "park_ms"),
        ({"rules": (2, 1, 1.5)}, "promote_ms"),
        ({"final": True, "waiter": "m:1", "join": Join.PARK}, "final refusal"),
        ({"final": True}, "final refusal"),
    ],
)
def test_a_request_is_checked_whole_when_built_whichever_script_answers_it(
    options: dict[str, Any], message: str
) -> None:
    """The plain script sees only its own arguments: what only the general one would refuse is refused here,
    so that a request does not succeed on a free key and fail on a busy one."""
    with pytest.raises(LeaseConfigError, match=message):
        GrantRequest("k", "tok", TTL, **options)
