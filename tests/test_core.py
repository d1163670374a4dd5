"""The lease core against a real Redis: ownership, fencing, TTLs, one script per operation."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
import redis
from redis.crc import key_slot  # where redis.cluster imports it from (it does not re-export it)

from dramatiq_leases.core import (
    Busy,
    DeadRelease,
    Lease,
    LeaseConfigError,
    LeaseKeyError,
    Leases,
    LeaseUnavailableError,
    Renewal,
    State,
    scripts,
)
from dramatiq_leases.core.client import ThreadConnections
from dramatiq_leases.core.keys import lease_name, script_names
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from tools import slot_tags

from .support.scriptcalls import grant_call, renew_call
from .support.waiting import wait_for

CORE = pathlib.Path(__file__).parents[1] / "dramatiq_leases" / "core"


def commandstats(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in client.info("commandstats").items()}


def calls_during(client: redis.Redis, action) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Redis commands (by name) executed while ``action`` ran, excluding INFO itself."""
    before = commandstats(client)
    action()
    after = commandstats(client)
    diff = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    diff.pop("info", None)
    return diff


@pytest.fixture(params=["plain", "general"])
def leases(redis_client: redis.Redis, request: pytest.FixtureRequest) -> Leases:
    """A store as users make it (a grant or release without options runs the plain scripts first), and one held
    to the general scripts only: the same promises hold for both. On ``redis_client`` itself, not a client of its
    own (``make_leases``): the round trips counted below are that one client's, its connection already open."""
    leases = Leases(redis_client)
    leases.grants.plain = request.param == "plain"
    return leases


def test_acquire_busy_release_is_owner_checked(leases: Leases) -> None:
    lease = leases.try_acquire("invoice:42", ttl=5_000, meta={"actor": "send_invoice"})
    assert isinstance(lease, Lease)
    assert len(bytes.fromhex(lease.token)) * 8 >= 128

    busy = leases.try_acquire("invoice:42", ttl=5_000)
    assert isinstance(busy, Busy) and not busy
    assert 4_000 < busy.ttl_left <= 5_000
    assert busy.fence == lease.fence
    assert busy.retry_after == 5

    assert leases.release_token("invoice:42", "not-the-owner") is False
    assert leases.inspect("invoice:42") is not None
    assert leases.release(lease) is True
    assert leases.release(lease) is False  # released once
    assert leases.inspect("invoice:42") is None


def test_different_keys_do_not_contend(leases: Leases) -> None:
    a = leases.try_acquire("invoice:1", ttl=5_000)
    b = leases.try_acquire("invoice:2", ttl=5_000)
    assert isinstance(a, Lease) and isinstance(b, Lease)


def test_fence_strictly_increases_across_release_and_expiry(leases: Leases) -> None:
    fences = []
    for _ in range(3):
        lease = leases.try_acquire("k", ttl=5_000)
        assert isinstance(lease, Lease)
        fences.append(lease.fence)
        leases.release(lease)
    expiring = leases.try_acquire("k", ttl=50)
    assert isinstance(expiring, Lease)
    fences.append(expiring.fence)
    after = wait_for(lambda: leases.try_acquire("k", ttl=5_000) or None, what="the 50 ms lease to expire")
    assert isinstance(after, Lease)  # for mypy: wait_for returns only a truthy value, and a Busy is falsy
    fences.append(after.fence)
    assert fences == sorted(set(fences)) and len(fences) == 5
    # The grant that ended by TTL is recorded as such; the released ones are not.
    assert leases.fence_state("k") == {"fence": after.fence, "released": fences[2], "expired": expiring.fence}


def test_renew_restores_ttl_only_for_the_owner(leases: Leases, redis_client: redis.Redis) -> None:
    lease = leases.try_acquire("k", ttl=2_000)
    assert isinstance(lease, Lease)
    redis_client.pexpire(lease_name(leases.prefix, "k"), 500)
    assert leases.renew(lease) is Renewal.OK
    assert redis_client.pttl(lease_name(leases.prefix, "k")) > 1_500

    stranger = Lease(
        key="k", token="x" * 32, fence=0, ttl=2_000, interval=600, max_hold=None, acquired_at=0, meta={}, sent_at=0
    )
    assert leases.renew(stranger) is Renewal.STOLEN
    leases.release(lease)
    assert leases.renew(lease) is Renewal.GONE


def test_renewal_never_extends_past_max_hold(leases: Leases, redis_client: redis.Redis) -> None:
    sent = time.monotonic()
    lease = leases.try_acquire("k", ttl=10_000, max_hold=300)
    assert isinstance(lease, Lease)
    # The holder trusts it for the whole max hold; the key outlives that by the safety margin (1 s).
    assert sent + 0.3 <= lease.hold_until <= time.monotonic() + 0.3
    assert lease.valid_until == lease.hold_until
    assert redis_client.pttl(lease_name(leases.prefix, "k")) <= 300 + 1_000
    assert leases.renew(lease) is Renewal.OK
    assert redis_client.pttl(lease_name(leases.prefix, "k")) <= 300 + 1_000
    wait_for(lambda: leases.renew(lease) is not Renewal.OK, what="max hold to end renewals", timeout=5)
    assert lease.remaining() == 0


class RoundTrips:
    """Counts requests sent to Redis by this process (a pipeline counts once)."""

    def __init__(self, client: redis.Redis) -> None:
        self.count = 0
        self.original = redis.connection.Connection.send_packed_command

    def __enter__(self) -> RoundTrips:
        original = self.original

        def send_counted(conn: redis.connection.AbstractConnection, *a: Any, **kw: Any) -> Any:
            self.count += 1
            return original(conn, *a, **kw)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

        redis.connection.Connection.send_packed_command = send_counted  # type: ignore[method-assign, assignment]  # mypy rejects any function over this unannotated method
        return self

    def __exit__(self, *exc: object) -> None:
        redis.connection.Connection.send_packed_command = self.original  # type: ignore[method-assign]


def test_every_operation_is_one_script_call_in_one_round_trip(leases: Leases, redis_client: redis.Redis) -> None:
    # Load the scripts once; from then on every call is a single EVALSHA.
    warm = leases.try_acquire("warm", ttl=1_000)
    assert isinstance(warm, Lease)
    leases.renew(warm)
    leases.release(warm)
    box: dict[str, object] = {}
    operations = {
        "acquire": lambda: box.update(lease=leases.try_acquire("k", ttl=1_000)),
        "renew": lambda: leases.renew(box["lease"]),  # type: ignore[arg-type]
        "release": lambda: leases.release(box["lease"]),  # type: ignore[arg-type]
    }
    for name, operation in operations.items():
        with RoundTrips(redis_client) as trips:
            calls = calls_during(redis_client, operation)
        assert calls.get("evalsha") == 1 and "eval" not in calls, name
        assert trips.count == 1 + 2, name  # plus the two INFO calls of calls_during


def test_renewing_many_leases_is_one_round_trip(leases: Leases, redis_client: redis.Redis) -> None:
    held = [leases.try_acquire(f"job:{i}", ttl=10_000) for i in range(2_500)]
    assert all(isinstance(lease, Lease) for lease in held)
    leases.renew(held[0])  # type: ignore[arg-type]  # Redis loads the script on first use
    with RoundTrips(redis_client) as trips:
        results = leases.renew_many(held)  # type: ignore[arg-type]
    assert results == [Renewal.OK] * 2_500
    assert trips.count == 1  # three script calls of up to 1 000 leases, pipelined


def test_all_keys_of_a_lease_share_one_hash_slot() -> None:
    for key in ["invoice:42", "a{b}c", "}x{", "{", "tenant:{7}:user:9", "ünïcødé", "x" * 1000]:
        slot = key_slot(lease_name("p", key).encode())
        assert {key_slot(name.encode()) for name in script_names("p", key)} == {slot}, key


def test_each_slot_has_its_epoch_record_tag_as_the_tool_writes_them() -> None:
    """``core/slot_tags.txt`` names one tag per Cluster slot, in slot order (``tools/slot_tags.py``)."""
    written = (pathlib.Path(scripts.__file__).parent / "slot_tags.txt").read_text(encoding="ascii").split()
    assert written == slot_tags.tags()
    assert [key_slot(f"{{{tag}}}".encode()) for tag in written] == list(range(16_384))


def test_scan_lists_leases_and_states(leases: Leases, redis_client: redis.Redis) -> None:
    alive = leases.try_acquire("alive", ttl=10_000, interval=1_000)
    overdue = leases.try_acquire("overdue", ttl=60_000, interval=10)
    dead = leases.try_acquire("dead", ttl=1_000, interval=300)
    assert isinstance(alive, Lease) and isinstance(dead, Lease) and isinstance(overdue, Lease)
    redis_client.pexpire(lease_name(leases.prefix, "dead"), 60_000)  # extended by hand past its holder's deadline
    orphan = lease_name(leases.prefix, "orphan")
    redis_client.hset(orphan, mapping={"token": "t", "fence": 1, "key": "orphan"})  # no TTL: the classic orphan
    redis_client.set("unrelated", "x")
    states = wait_for(
        lambda: (s := {i.key: i.state for i in leases.scan()}).get("dead") is State.HOLDER_DEAD and s,
        what="the silent holder's deadline to pass",
    )
    assert states == {
        "alive": State.ALIVE,
        "overdue": State.HEARTBEAT_OVERDUE,
        "dead": State.HOLDER_DEAD,
        "orphan": State.NO_TTL,
    }
    assert [s for s in State if s.leaked] == [State.HOLDER_DEAD, State.PAST_MAX_HOLD, State.NO_TTL]
    assert [i.key for i in leases.scan("ali*")] == ["alive"]


def test_release_if_dead_spares_every_holder_that_may_still_run(leases: Leases, redis_client: redis.Redis) -> None:
    live = leases.try_acquire("live", ttl=60_000, interval=20_000)
    assert isinstance(live, Lease)
    released, deadline_in, fence = leases.release_if_dead("live")
    assert released is False and 59 < deadline_in <= 60 and fence == live.fence  # type: ignore[operator]
    assert leases.inspect("live") is not None

    # Its heartbeat is long overdue, but the holder trusts the lease until its own deadline (0.9 x TTL
    # after the last renewal it sent): releasing it now would let a second worker run beside it.
    silent = leases.try_acquire("silent", ttl=3_000, interval=10)
    assert isinstance(silent, Lease)
    redis_client.pexpire(lease_name(leases.prefix, "silent"), 60_000)  # so the key outlives the deadline
    wait_for(lambda: leases.inspect("silent").state is State.HEARTBEAT_OVERDUE, what="an overdue heartbeat")  # type: ignore[union-attr]
    assert leases.release_if_dead("silent").released is False
    assert silent.remaining() > 0  # the holder still trusts it
    result = wait_for(lambda: (r := leases.release_if_dead("silent")).released and r, what="release", timeout=5)
    assert isinstance(result, DeadRelease)  # for mypy: wait_for returns only a truthy value
    # Not before the holder's deadline, nor before the margin its actor has to stop after it.
    assert time.monotonic() >= silent.valid_until + silent.margin / 1000
    assert result.deadline_in is not None and result.deadline_in <= 0
    assert leases.inspect("silent") is None
    assert leases.release_if_dead("never-held") == (None, None, 0)

    foreign = lease_name(leases.prefix, "foreign")
    redis_client.hset(foreign, "token", "t")
    redis_client.pexpire(foreign, 60_000)
    assert leases.release_if_dead("foreign") == (False, None, 0)  # no holder deadline: it expires by itself
    redis_client.persist(foreign)
    assert leases.release_if_dead("foreign").released is True  # no deadline, no TTL: nobody can end it but us


def test_a_handed_over_lease_is_adopted_once(leases: Leases) -> None:
    handed = leases.try_acquire("export:9", ttl=5_000)
    assert isinstance(handed, Lease)
    first = leases.adopt("export:9", handed.token, ttl=10_000, max_hold=60_000)
    second = leases.adopt("export:9", handed.token, ttl=10_000, max_hold=60_000)
    assert isinstance(first, Lease) and first.fence == handed.fence and first.token != handed.token
    assert isinstance(second, Busy) and second.fence == handed.fence  # busy like any other delivery
    assert leases.release(handed) is False  # the producer's token no longer owns it
    assert leases.renew(first) is Renewal.OK
    info = leases.inspect("export:9")
    assert info is not None and info.adopted_ms and info.max_hold_until_ms - info.now_ms <= 61_000
    assert first.hold_until <= time.monotonic() + 60


def test_an_adopted_lease_keeps_the_adopters_max_hold(leases: Leases) -> None:
    handed = leases.try_acquire("export:10", ttl=5_000)
    assert isinstance(handed, Lease)
    adopted = leases.adopt("export:10", handed.token, ttl=5_000, max_hold=200)
    assert isinstance(adopted, Lease) and adopted.max_hold is not None and adopted.max_hold <= 200
    wait_for(lambda: leases.renew(adopted) is not Renewal.OK, what="max hold to end renewals", timeout=5)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ls: ls.try_acquire("k", ttl=1500.5), "ttl must be a whole number of milliseconds"),
        (lambda ls: ls.try_acquire("k", ttl=0.5), "ttl must be a whole number"),
        (lambda ls: ls.try_acquire("k", ttl=float("nan")), "ttl must be a whole number"),
        (lambda ls: ls.try_acquire("k", ttl=10**13), "ttl must be a whole number"),
        (lambda ls: ls.try_acquire("k", ttl=True), "ttl must be a whole number"),
        (lambda ls: ls.try_acquire("k", ttl=1_000, max_hold=-1), "max_hold must be"),
        (lambda ls: ls.try_acquire("k", ttl=1_000, interval=2.5), "interval must be"),
        (lambda ls: ls.try_acquire("k", ttl=1_000, meta={"token": "mine"}), "lease metadata"),
        (lambda ls: ls.try_acquire("k", ttl=1_000, meta={"n": 1}), "lease metadata"),
        (lambda ls: ls.adopt("k", "", ttl=1_000), "handed-over token"),
    ],
)
def test_bad_numbers_are_refused_before_any_write(
    leases: Leases, redis_client: redis.Redis, call: Any, message: str
) -> None:
    with pytest.raises(LeaseConfigError, match=message):
        call(leases)
    assert redis_client.keys("*") == []  # nothing written, so nothing can be left without a TTL


@pytest.mark.parametrize(
    "named",
    [
        {"ttl_ms": "1500.5"},
        {"max_hold_ms": "-1"},
        {"margin_ms": "60000"},
        {"token": ""},
        {"ttl_ms": "1e300"},
        {"retention_ms": "-1"},
        {"history": str(scripts.MAX_HISTORY + 1)},
        {"unique": "1"},  # without a waiter
        {"order": "5"},  # the plain build takes none
        {"grace_ms": "-1"},
        {"failover_ms": "0.5"},
    ],
)
def test_the_acquire_script_checks_every_argument_before_writing(
    redis_client: redis.Redis, named: dict[str, Any]
) -> None:
    """Lua is not a transaction: a script that failed halfway would keep its first writes."""
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid"):
        redis_client.eval(*grant_call(**named))
    with pytest.raises(redis.ResponseError, match="dramatiq-leases: invalid fields"):
        redis_client.eval(*grant_call(), "odd-metadata")
    with pytest.raises(redis.ResponseError, match=r"dramatiq-leases: invalid key count 4"):
        redis_client.eval(*grant_call(failover_ms=1_000, keys=list(script_names("t", "k"))[:4]))
    assert redis_client.keys("*") == []


def test_no_script_leaves_a_lease_without_ttl(leases: Leases, redis_client: redis.Redis) -> None:
    """Every way in: acquire, adopt, renew, with good and bad numbers; after each, every lease key has a TTL."""
    lease = leases.try_acquire("a", ttl=1_000, max_hold=100_000)
    assert isinstance(lease, Lease)
    name = leases.lease_name("a")
    attempts: list[Any] = [
        lambda: redis_client.eval(*renew_call([name], "12.5", lease.token)),
        lambda: redis_client.eval(*renew_call([name], lease.token)),
        lambda: redis_client.eval(scripts.ADOPT, 1, name, lease.token, "new", "-5", "0", "0", "0"),
        lambda: redis_client.eval(scripts.ADOPT, 1, name, lease.token, "new", "1000", "0", "0", "x"),
        lambda: leases.adopt("a", lease.token, ttl=1_000, max_hold=10),
    ]
    for attempt in attempts:
        try:
            attempt()
        except redis.ResponseError as e:
            assert "dramatiq-leases: invalid" in str(e)
        for name in redis_client.scan_iter(f"{leases.prefix}:lease:*"):
            assert redis_client.pttl(name) > 0, name


def test_adopt_needs_the_token(leases: Leases) -> None:
    lease = leases.try_acquire("export:7", ttl=5_000)
    assert isinstance(lease, Lease)
    adopted = leases.adopt("export:7", lease.token, ttl=10_000, meta={"actor": "export"})
    assert isinstance(adopted, Lease) and adopted.fence == lease.fence
    assert leases.inspect("export:7").meta["actor"] == "export"  # type: ignore[union-attr]
    assert isinstance(leases.adopt("export:7", "f" * 32, ttl=10_000), Busy)
    leases.release(adopted)
    assert leases.adopt("export:7", lease.token, ttl=10_000) is None  # gone: the caller acquires anew


def test_bad_keys_are_refused(leases: Leases) -> None:
    for bad in ["", None, 42, "x" * 5000]:
        with pytest.raises(LeaseKeyError):
            leases.try_acquire(bad, ttl=1_000)  # type: ignore[arg-type]


def test_unreachable_redis_raises_and_grants_nothing() -> None:
    leases = Leases(redis.Redis(port=free_port(), socket_connect_timeout=0.2))
    with pytest.raises(LeaseUnavailableError, match="could not acquire lease 'k'") as info:
        leases.try_acquire("k", ttl=1_000)
    assert info.value.key == "k"


def test_works_on_redis_cluster() -> None:
    """Three masters: every script's keys live in one slot, so Cluster runs them as they are."""
    nodes = [
        EmbeddedRedis(extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")) for _ in range(3)
    ]
    try:
        for node in nodes:
            node.start()
        subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes], "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        client = redis.cluster.RedisCluster(host="127.0.0.1", port=nodes[0].port)
        each = [redis.Redis(port=n.port) for n in nodes]
        wait_for(
            lambda: all("cluster_state:ok" in str(c.execute_command("CLUSTER", "INFO")) for c in each),  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            what="every node to be ok",
        )
        for c in each:
            c.close()
        leases = Leases(client)
        held = [leases.try_acquire(f"invoice:{i}", ttl=10_000) for i in range(50)]
        assert all(isinstance(x, Lease) for x in held)
        assert len({key_slot(lease_name(leases.prefix, x.key).encode()) for x in held}) > 10  # spread over slots
        assert leases.renew_many(held) == [Renewal.OK] * 50  # type: ignore[arg-type]
        assert isinstance(leases.try_acquire("invoice:3", ttl=1_000), Busy)
        assert sorted(i.key for i in leases.scan()) == sorted(f"invoice:{i}" for i in range(50))
        assert all(leases.release(x) for x in held)  # type: ignore[arg-type]
        client.close()
    finally:
        for node in nodes:
            node.close()


def test_core_does_not_import_dramatiq_and_never_uses_keys() -> None:
    code = "import sys, dramatiq_leases.core; print('dramatiq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    for path in CORE.parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "keys" and isinstance(node.value, ast.Name):
                assert node.value.id not in {"client", "redis_client", "r"}, f"KEYS used in {path}"
        assert "'KEYS'" not in path.read_text() and '"KEYS"' not in path.read_text(), path


def test_an_interrupted_call_never_hands_its_reply_to_the_next(redis_server: EmbeddedRedis) -> None:
    """An interruption between sending a command and reading its reply must not make the next call read it.

    With thread connections (what Leases uses on Dramatiq's worker threads) the dirty connection is
    reopened; the next call sees its own answer.
    """
    client = redis.Redis.from_url(redis_server.url(0), socket_timeout=2)
    connections = ThreadConnections(client)
    echo = client.register_script("return ARGV[1]")
    assert connections.call(echo, [], ["first"]) == b"first"  # opens this thread's connection

    def interrupted(client: redis.Redis) -> None:
        # Sent, not read: as if Dramatiq's TimeLimit struck right after the request left.
        client.connection.send_command("EVAL", "return 'stale'", 0)  # type: ignore[union-attr]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        connections.run(interrupted)
    assert connections.call(echo, [], ["mine"]) == b"mine"  # its own reply, not the stale one
    leases = Leases(client, thread_connections=True)
    assert isinstance(leases.try_acquire("free", ttl=10_000), Lease)


def test_asking_again_with_the_same_token_gets_the_same_answer(leases: Leases) -> None:
    """A client that retries after a lost reply must not find its own grant busy (nor its own adoption)."""
    first = leases.try_acquire("retry", ttl=10_000, token="t" * 32)
    again = leases.try_acquire("retry", ttl=10_000, token="t" * 32)
    assert isinstance(first, Lease) and isinstance(again, Lease) and again.fence == first.fence
    assert leases.fence_state("retry")["fence"] == first.fence  # no second grant
    adopted = leases.adopt("retry", first.token, ttl=10_000, new_token="n" * 32)
    adopted_again = leases.adopt("retry", first.token, ttl=10_000, new_token="n" * 32)
    assert isinstance(adopted, Lease) and isinstance(adopted_again, Lease) and adopted_again.fence == first.fence
    assert isinstance(leases.try_acquire("retry", ttl=10_000), Busy)  # anyone else: busy


def test_core_imports_nothing_outside_core() -> None:
    """The arrows point one way: integrations plug into the core, never the reverse (walks every import)."""
    forbidden = ("dramatiq", "prometheus_client", "opentelemetry", "dramatiq_leases")
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name} imports from outside core: {'.' * node.level}{node.module}"
                names = [node.module or ""] if node.level == 0 else []
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in forbidden, f"{path.name} imports {name}"


def test_each_script_is_complete_and_checks_numbers_against_the_same_limit(redis_client: redis.Redis) -> None:
    """Every .lua file loads alone (Redis compiles it), and those that check their arguments' numbers use MAX_MS."""
    for name, source in scripts.ALL.items():
        assert source.startswith("-- KEYS:"), f"{name}.lua must begin with its KEYS/ARGV/returns header"
        redis_client.script_load(source)
        if "whole(ARGV" in source:
            assert f"local MAX_MS = {scripts.MAX_MS}" in source, name
