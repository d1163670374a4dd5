"""A hostile review of Leader and of key history (issue 22, items 3 and 4): what a demanding user and an on-call
engineer would try. Real redis-servers (private ones where commands are counted), a blackhole proxy for a
socket that never answers, a real Redis Cluster for the history's hash slot, the CLI as a subprocess."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import redis
from prometheus_client import CollectorRegistry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from dramatiq_leases import Leader, LeaderLost, Leases
from dramatiq_leases.core import Busy, Lease, Renewal, scripts
from dramatiq_leases.core.errors import LeaseConfigError
from dramatiq_leases.core.keys import history_name, lease_name
from dramatiq_leases.core.lease import LostReason
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.exporter.observer import LeaseObserver
from dramatiq_leases.exporter.routes import ExporterApp
from dramatiq_leases.leader import EXIT_CODE

from .support.blackhole import Blackhole
from .support.cluster import RedisClusterNodes
from .support.processes import clean_env
from .support.waiting import wait_for

KEY = "scheduler"
CLI = str(Path(sys.executable).with_name("dramatiq-leases"))
#: How late past its local deadline a leader may be told on this loaded machine (well under the margin).
LATENESS_S = 0.25


# --- Leader -----------------------------------------------------------------------------------------------


def test_a_nested_with_of_one_leader_keeps_the_key_until_the_outer_with_ends(redis_client: redis.Redis) -> None:
    """Re-entering the same Leader (a helper that does `with leader:` called inside the scheduler's own block)
    must not release the key at the inner exit while the outer block still acts as leader: another process
    would be granted it and both would lead."""
    leases = Leases(redis_client)
    leader = Leader(leases, KEY, ttl=600)
    other = Leader(leases, KEY, ttl=600, poll=50)
    with leader:
        fence = leader.fence
        with leader:
            assert leader.fence == fence
        assert leader.is_leader, "the inner exit released the outer block's key"
        assert not other.wait(timeout=0.3), "another leader was granted the key inside the outer block"
    assert leases.inspect(KEY) is None and other.wait(timeout=2)
    other.release()


def test_a_body_that_raises_releases_the_key_and_a_lost_leader_leads_again_with_a_larger_fence(
    redis_client: redis.Redis,
) -> None:
    leases = Leases(redis_client)
    leader = Leader(leases, KEY, ttl=600)
    with pytest.raises(ZeroDivisionError), leader:
        _ = 1 / 0
    assert leases.inspect(KEY) is None and not leader.is_leader
    assert leases.fence_state(KEY)["released"] == leader.fence  # released, not left to expire
    # Lost inside the body (the key deleted), then the same Leader enters again, as the README's loop does.
    with pytest.raises(LeaderLost) as lost, leader:
        first = leader.fence
        redis_client.delete(leases.lease_name(KEY))
        time.sleep(30)  # interrupted by the loss (main thread)
    assert lost.value.reason is LostReason.GONE
    with leader:
        assert leader.fence > first and leader.is_leader
    assert leases.inspect(KEY) is None


def test_a_leader_whose_renewals_hang_is_told_by_its_deadline_before_the_key_can_go_to_another(
    redis_server: EmbeddedRedis,
) -> None:
    """A socket that never answers (no socket timeout at all): the watchdog, not the renewal, tells the loss,
    while the key still lives on the server; the standby is granted it only afterwards, with a larger fence;
    leaving the block then asks nothing of the hung Redis."""
    direct = redis.Redis.from_url(redis_server.url(0), socket_timeout=2)
    told: list[tuple[float, float, int]] = []
    with Blackhole(redis_server.port) as hole:
        hung = Leases(redis.Redis(port=hole.port))  # no socket_timeout: a renewal blocks for ever

        def on_lost(lease: Lease, reason: LostReason) -> None:
            told.append((time.monotonic(), lease.valid_until, int(direct.pttl(lease_name("dramatiq-leases", KEY)))))

        leader = Leader(hung, KEY, ttl=2_000, on_lost=on_lost)
        standby = Leader(Leases(direct), KEY, ttl=2_000, poll=20)
        assert leader.wait(timeout=5)
        fence = leader.fence
        hole.cut()
        got: list[float] = []

        def stand_by() -> None:
            if standby.wait(timeout=10):
                got.append(time.monotonic())

        thread = threading.Thread(target=stand_by)
        thread.start()
        wait_for(lambda: told, timeout=5, what="the hung leader to be told")
        told_at, deadline, pttl_then = told[0]
        assert told_at <= deadline + LATENESS_S, f"told {told_at - deadline:.3f} s past its deadline"
        assert pttl_then > 0, "the key was already gone on the server when the leader was told"
        thread.join(10)
        assert got and got[0] > told_at and standby.fence > fence
        started = time.monotonic()
        leader.release()  # the lease is lost: nothing is asked of the hung socket
        assert time.monotonic() - started < 0.5
        standby.release()


def test_wait_with_a_timeout_returns_within_one_socket_timeout_if_redis_never_answers(
    redis_server: EmbeddedRedis,
) -> None:
    """Promise (guide): wait(timeout) stands by at most the timeout plus the Redis call under way."""
    with Blackhole(redis_server.port) as hole:
        client = redis.Redis(port=hole.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        leader = Leader(Leases(client), KEY, ttl=1_000)
        hole.cut()
        done = threading.Event()

        def stand_by() -> None:
            leader.wait(timeout=0.3)
            done.set()

        threading.Thread(target=stand_by, daemon=True).start()
        try:
            assert done.wait(0.3 + 0.5 + 1.0), "wait(timeout=0.3) blocked past its timeout and one socket timeout"
        finally:
            hole.heal()  # the blocked ask fails and its thread ends
            done.wait(5)


def test_a_redis_restart_under_the_leader_is_told_and_the_next_grant_has_a_larger_fence(
    redis_server: EmbeddedRedis,
) -> None:
    """The key vanishes with a restart (no persistence): the leader is told (gone or unreachable) in time, and
    the fence of the grant after the restart is still larger (the counter was lost with the rest)."""
    leases = Leases.from_url(redis_server.url(0), socket_timeout=0.5)
    lost: list[LostReason] = []
    leader = Leader(leases, KEY, ttl=1_500, on_lost=lambda lease, reason: lost.append(reason))
    assert leader.wait(timeout=5)
    before = leader.fence
    redis_server.stop()
    redis_server.start()
    wait_for(lambda: lost, timeout=5, what="the leader to be told after the restart")
    assert lost[0] in (LostReason.GONE, LostReason.UNREACHABLE) and not leader.is_leader
    leader.release()
    assert leader.wait(timeout=5) and leader.fence > before
    leader.release()


def _race_once(leases: Leases, client: redis.Redis, in_main: bool, offset: float) -> list[str]:
    """Delete the key and release the Leader ``offset`` s later; returns where a LeaderLost landed, if anywhere
    but inside the block (or its exit)."""
    leader = Leader(leases, KEY, ttl=150)
    wrong: list[str] = []
    ready = threading.Event()

    def hold() -> None:
        try:
            with leader:
                ready.set()
                while leader.lease is not None or not leader._closing.is_set():
                    time.sleep(0.001)
        except LeaderLost:
            pass  # told inside the block or at its exit: that is allowed
        try:
            end = time.monotonic() + 0.05
            while time.monotonic() < end:
                time.sleep(0.001)
        except LeaderLost:
            wrong.append("after the block")

    if in_main:

        def later() -> None:
            if ready.wait(5):
                _delete_then_release(client, leader, offset)

        timer = threading.Thread(target=later)
        timer.start()
        hold()
        timer.join(5)
    else:
        worker = threading.Thread(target=hold)
        worker.start()
        assert ready.wait(5)
        _delete_then_release(client, leader, offset)
        worker.join(5)
    return wrong


def _delete_then_release(client: redis.Redis, leader: Leader, offset: float) -> None:
    client.delete(lease_name("dramatiq-leases", KEY))
    time.sleep(offset)
    leader.release()


@pytest.mark.parametrize("in_main", [True, False], ids=["main-thread", "worker-thread"])
def test_release_racing_the_heartbeats_loss_never_raises_after_the_block(
    redis_client: redis.Redis, in_main: bool
) -> None:
    leases = Leases(redis_client)
    rng = random.Random(22)
    for _ in range(12):
        assert _race_once(leases, redis_client, in_main, rng.uniform(0, 0.06)) == []


def test_exit_mode_ends_the_process_with_code_75_though_other_threads_run(redis_server: EmbeddedRedis) -> None:
    code = f"""
import threading, time, sys
from dramatiq_leases import Leader, Leases
def busy():
    while True:
        sum(range(1000))  # a non-daemon thread that never ends
threading.Thread(target=busy).start()
leader = Leader(Leases.from_url({redis_server.url(0)!r}), "scheduler", ttl=600, on_lost="exit")
with leader:
    print("leading", flush=True)
    while True:
        time.sleep(0.01)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "leading"
        redis.Redis.from_url(redis_server.url(0)).delete(lease_name("dramatiq-leases", KEY))
        assert proc.wait(5) == EXIT_CODE == 75
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- History ----------------------------------------------------------------------------------------------


def test_a_huge_metadata_value_does_not_make_each_event_huge(redis_client: redis.Redis) -> None:
    """The cap bounds the number of events; each event must be bounded too, or a holder's 1 MB actor or message
    id makes the capped list 10 000 MB. Cut values stay readable (cut at a UTF-8 boundary)."""
    leases = Leases(redis_client, prefix="t", history=5)
    meta = {"message_id": "m" * 200_000, "actor": "x" + "é" * 5_000, "host": "h" * 200_000, "pid": "7"}
    lease = leases.try_acquire("k", 10_000, meta=meta)
    assert isinstance(lease, Lease) and leases.release(lease)
    raw = redis_client.lrange(history_name("t", "k"), 0, -1)
    assert len(raw) == 2
    assert max(len(entry) for entry in raw) < 4_096, f"an event of {max(len(e) for e in raw)} bytes"
    granted, released = leases.history("k")
    assert (granted.event, released.event) == ("granted", "released")
    # Cut to 512 bytes; the actor's 512th byte starts an "é": dropped whole rather than left half.
    assert (granted.message_id, granted.actor, granted.holder) == ("m" * 512, "x" + "é" * 255, "h" * 512)
    assert released.actor == "x" + "é" * 255


@pytest.mark.parametrize("kind", ["hash", "zset", "string"])
def test_a_history_key_of_another_type_never_fails_a_change_and_is_left_with_a_ttl(
    redis_client: redis.Redis, kind: str
) -> None:
    leases = Leases(redis_client, prefix="t", history=5)
    name = history_name("t", "k")

    def spoil() -> None:
        redis_client.delete(name)
        if kind == "hash":
            redis_client.hset(name, "x", "1")
        elif kind == "zset":
            redis_client.zadd(name, {"x": 1})
        else:
            redis_client.set(name, "x")

    spoil()
    lease = leases.try_acquire("k", 10_000)
    assert isinstance(lease, Lease)
    spoil()
    redis_client.delete(leases.lease_name("k"))
    assert leases.renew(lease) is Renewal.GONE  # renew_many's 'lost'
    spoil()
    again = leases.try_acquire("k", 10_000)
    assert isinstance(again, Lease)
    spoil()
    assert leases.release(again)
    assert redis_client.type(name) == b"list" and 0 < redis_client.pttl(name) <= scripts.HISTORY_MS
    assert [e.event for e in leases.history("k")] == ["released"]


def test_the_cap_zero_one_and_max(redis_client: redis.Redis) -> None:
    bad: Any
    for bad in (-1, scripts.MAX_HISTORY + 1, True, 2.5):
        with pytest.raises(LeaseConfigError, match="history"):
            Leases(redis_client, history=bad)
    off = Leases(redis_client, prefix="z", history=0)
    lease = off.try_acquire("k", 10_000)
    assert isinstance(lease, Lease) and off.release(lease)
    assert not redis_client.exists(history_name("z", "k"))
    one = Leases(redis_client, prefix="o", history=1)
    for _ in range(3):
        lease = one.try_acquire("k", 10_000, meta={"message_id": "m1"})
        assert isinstance(lease, Lease) and one.release(lease)
    [only] = one.history("k")
    assert (only.event, only.fence, only.message_id) == ("released", lease.fence, "m1")
    top = Leases(redis_client, prefix="x", history=scripts.MAX_HISTORY)
    name = history_name("x", "k")
    redis_client.rpush(name, *([b"{}"] * (scripts.MAX_HISTORY + 50)))  # an over-long list (written by hand)
    lease = top.try_acquire("k", 10_000)
    assert isinstance(lease, Lease)
    assert redis_client.llen(name) == scripts.MAX_HISTORY
    assert [e.event for e in top.history("k")] == ["granted"]  # the hand-written entries are not events


class _Monitor:
    """Every command the server runs (a script's own commands too), from MONITOR on a connection of its own."""

    def __init__(self, client: redis.Redis) -> None:
        self.commands: list[str] = []
        self._client = client
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Monitor:
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def _run(self) -> None:
        with self._client.monitor() as monitor:  # type: ignore[no-untyped-call]
            self._ready.set()
            while True:
                command = monitor.next_command()["command"]
                if command == "ECHO monitor-end":
                    return
                self.commands.append(command)

    def __exit__(self, *exc: object) -> None:
        self._client.echo("monitor-end")
        self._thread.join(5)


def _every_change(leases: Leases, client: redis.Redis) -> None:
    """A grant, a refusal, a renewal, a lost renewal, an adoption, a line's grant, releases."""
    lease = leases.try_acquire("k", 10_000, meta={"message_id": "m1", "actor": "a"})
    assert isinstance(lease, Lease)
    assert isinstance(leases.try_acquire("k", 10_000), Busy)
    assert leases.renew(lease) is Renewal.OK
    adopted = leases.adopt("k", lease.token, ttl=10_000)
    assert isinstance(adopted, Lease) and leases.release(adopted)
    assert not leases.release(lease)
    wide = [leases.try_acquire("w", 10_000, limit=2) for _ in range(2)]
    assert all(isinstance(w, Lease) for w in wide)
    client.delete(leases.lease_name("w"))
    assert next(leases.renew(w) for w in wide if isinstance(w, Lease)) is Renewal.GONE
    for w in wide[1:]:
        assert isinstance(w, Lease) and leases.release(w)


def test_history_off_adds_no_redis_command_and_on_only_its_own() -> None:
    """On a private redis-server: with history off, no command a script runs names a history key, and the
    commands run are exactly those run with it on less the history's own (LPUSH, LTRIM, its PEXPIRE)."""
    with EmbeddedRedis() as server:
        client = redis.Redis(port=server.port, socket_timeout=5)
        seen: dict[str, list[str]] = {}
        for label, cap in (("off", None), ("on", 50)):
            client.flushall()
            leases = Leases(client, prefix=label, history=cap)
            # The general scripts both times: the plain ones (tried first without history) add a call on a busy
            # key, counted by tests/test_protocol.py; here the history's own commands are compared.
            leases.grants.plain = False
            _every_change(leases, client)  # scripts loaded, outside the count
            client.flushall()
            with _Monitor(redis.Redis(port=server.port)) as monitor:
                _every_change(leases, client)
            seen[label] = monitor.commands
        # A script call declares the key's history among its keys (no script builds a key name); no command
        # the scripts run touches it.
        touched = [c for c in seen["off"] if ":history:" in c and not c.upper().startswith("EVALSHA")]
        assert not touched, "a command named a history key with history off"
        off = Counter(c.split()[0].upper() for c in seen["off"])
        on = Counter(
            c.split()[0].upper() for c in seen["on"] if ":history:" not in c or c.upper().startswith("EVALSHA")
        )
        assert not off - on  # nothing runs with history off that does not with it on
        assert set(on - off) <= {"TIME"}  # with it on: the history's own commands, and a release's clock read
        assert not off["LPUSH"] and not off["LTRIM"] and not off["EXISTS"] - on["EXISTS"]
        client.close()


def test_events_stay_in_order_under_concurrent_holders(redis_client: redis.Redis) -> None:
    """lock_limit 3, six threads taking and releasing the key: every grant's event comes before its release's,
    at no point of the history are more than 3 held, server times never go back."""
    leases = Leases(redis_client, prefix="t", history=1_000)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            done = 0
            while done < 6:
                got = leases.try_acquire("k", 10_000, limit=3, meta={"message_id": f"w{n}-{done}"})
                if isinstance(got, Lease):
                    assert leases.release(got)
                    done += 1
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    events = leases.history("k")
    assert len(events) == 2 * 36
    held: set[int] = set()
    for e in events:
        if e.event == "granted":
            assert e.fence not in held and e.slot in (0, 1, 2)
            held.add(e.fence)
            assert len(held) <= 3
        else:
            assert e.event == "released" and e.fence in held, e
            held.remove(e.fence)
    assert not held
    assert [e.time_ms for e in events] == sorted(e.time_ms for e in events)
    grants = [e.fence for e in events if e.event == "granted"]
    assert grants == sorted(grants)  # fences in the order of their grants


ODD_KEY = 'inv\n{42}\x1b[2J "é"\\'


def test_the_cli_and_the_exporter_show_the_history_of_an_odd_key_safely(redis_server: EmbeddedRedis) -> None:
    url = redis_server.url(0)
    leases = Leases.from_url(url, prefix="t", history=5)
    lease = leases.try_acquire(ODD_KEY, 60_000, meta={"message_id": "m\x1b[31m\nx", "actor": "a\u202eb"})
    assert isinstance(lease, Lease)
    table = subprocess.run(
        [CLI, "--redis-url", url, "--prefix", "t", "show", ODD_KEY, "--history"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout and "\u202e" not in table.stdout  # shown as escapes, never acted on
    history_part = table.stdout[table.stdout.index("history of") :]
    rows = history_part.splitlines()
    assert len(rows) == 3 and "granted" in rows[2] and "m\\x1b[31m\\x0ax" in rows[2], history_part
    doc = subprocess.run(
        [CLI, "--redis-url", url, "--prefix", "t", "show", ODD_KEY, "--history", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert doc.returncode == 0, doc.stderr
    [event] = json.loads(doc.stdout)["history"]
    assert (event["event"], event["fence"], event["message_id"]) == ("granted", lease.fence, "m\x1b[31m\nx")

    status: list[str] = []
    app = ExporterApp(CollectorRegistry(), None, history_json=LeaseObserver(leases).history_json, open_lease_views=True)
    environ = {"PATH_INFO": "/leases/history", "QUERY_STRING": urlencode({"key": ODD_KEY}), "REQUEST_METHOD": "GET"}
    body = json.loads(b"".join(app(environ, lambda s, headers: status.append(s))))  # type: ignore[arg-type]
    assert status == ["200 OK"] and body["key"] == ODD_KEY
    assert [(e["event"], e["actor"]) for e in body["events"]] == [("granted", "a\u202eb")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes(masters=3, replicas=0) as nodes:
        yield nodes


def test_on_a_cluster_each_keys_history_lives_in_its_leases_slot(cluster: RedisClusterNodes) -> None:
    leases = Leases(cluster.client(), prefix="c", history=10)
    keys = ["a", "invoice:42", "b{x}c", "}{", ODD_KEY, "é" * 300]
    slots = {key_slot(lease_name("c", k).encode()) for k in keys}
    assert len(slots) > 1  # spread over several slots (and so masters)
    for i, k in enumerate(keys):
        assert key_slot(history_name("c", k).encode()) == key_slot(lease_name("c", k).encode())
        wide = [leases.try_acquire(k, 10_000, limit=2, meta={"message_id": f"m-{i}"}) for _ in range(2)]
        assert all(isinstance(w, Lease) for w in wide), wide
        leases.record_history(k, "skipped", reason="lock_on_busy=skip")
        for w in wide:
            assert isinstance(w, Lease) and leases.release(w)
        events = leases.history(k)
        assert [e.event for e in events] == ["granted", "granted", "skipped", "released", "released"], (k, events)
        assert events[0].message_id == f"m-{i}" and events[1].slot == 1


def test_an_operator_name_too_long_in_bytes_is_refused_as_bad_input_not_by_the_script(
    redis_server: EmbeddedRedis,
) -> None:
    """300 two-byte characters are 600 bytes: refused in Python (the scripts count bytes), nothing released."""
    from dramatiq_leases import LeaseConfigError

    leases = Leases.from_url(redis_server.url(0), history=10)
    lease = leases.try_acquire("k", 10_000)
    assert isinstance(lease, Lease)
    with pytest.raises(LeaseConfigError, match="512 bytes"):
        leases.release_token("k", lease.token, by="é" * 300)
    assert leases.inspect("k") is not None
