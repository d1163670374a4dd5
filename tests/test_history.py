"""The history of a key (``Leases(history=N)``, ``LeaseMiddleware(history=N)``): what happened to its lease, in
order, with fences. Real Redis; the first test runs real ``dramatiq`` workers (one SIGKILLed) and the CLI.

Also what an on-call engineer would try: a huge metadata value, a history key of another type, the cap at 0, 1
and its maximum, the commands it adds (none with it off: counted by MONITOR on a private server), events in
order under concurrent holders, an odd key through the CLI (a subprocess) and the exporter, and each key's
history in its lease's hash slot on a real Redis Cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import redis
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker
from prometheus_client import CollectorRegistry
from redis.crc import key_slot

from dramatiq_leases import Leases
from dramatiq_leases.core import Busy, Lease, Renewal, scripts
from dramatiq_leases.core.errors import LeaseConfigError, LeaseStateError
from dramatiq_leases.core.history import HistoryEvent
from dramatiq_leases.core.keys import history_name, lease_name
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.exporter.observer import LeaseObserver
from dramatiq_leases.exporter.routes import ExporterApp

from .support.cluster import RedisClusterNodes
from .support.processes import Processes, clean_env, wait_until
from .support.scriptcalls import grant_call, release_call

CLI = str(Path(sys.executable).with_name("dramatiq-leases"))
META = {"actor": "export", "message_id": "m1", "host": "web-1", "pid": "42"}


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *argv], capture_output=True, text=True, timeout=30, env=clean_env())


def runs(record: redis.Redis) -> dict[str, int]:
    """The messages the app's actors started, with the fence each held."""
    return {d["message_id"]: d["fence"] for d in (json.loads(raw) for raw in record.lrange("runs", 0, -1))}


def at(events: list[HistoryEvent], event: str, fence: int = 0, message_id: str = "") -> int:
    """The index of the first event of that kind (and fence, and message), or fail naming the history."""
    for i, e in enumerate(events):
        if e.event == event and (not fence or e.fence == fence) and (not message_id or e.message_id == message_id):
            return i
    pytest.fail(f"no {event} (fence {fence}, message {message_id!r}) in {events}", pytrace=False)


def test_a_killed_holder_a_forced_release_a_lost_lease_and_a_duplicate_appear_in_order(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """m1's worker is SIGKILLed while it holds the key: the next grant (m2's) finds m1's grant ended by its TTL.
    An operator releases m2's lease with its token from the CLI: m3, waiting in the line, is granted, and m2's
    heartbeat finds its lease lost. m3 runs and releases; a copy of m3 is then refused as a duplicate. Each event
    names its fence and message, and `show --history` prints them."""
    broker_url, leases_url = redis_server.url(0), redis_server.url(1)
    env = clean_env(LEASES_TEST_BROKER_URL=broker_url, LEASES_TEST_LEASES_URL=leases_url, LEASES_TEST_QUEUE="hist")
    broker = RedisBroker(url=broker_url)  # type: ignore[no-untyped-call]
    record = redis.Redis.from_url(broker_url)
    leases = Leases.from_url(leases_url)  # a reader: its own history setting does not matter

    def worker(queue: str) -> list[str]:
        app = ["-m", "dramatiq", "tests.apps.history_app", "--processes", "1", "--threads", "2"]
        return [sys.executable, *app, "--queues", queue, "--worker-shutdown-timeout", "5000"]

    def send(actor: str, queue: str, seconds: float) -> Message[Any]:
        return broker.enqueue(Message(queue_name=queue, actor_name=actor, args=("k", seconds), kwargs={}, options={}))

    try:
        with Processes(tmp_path / "logs") as procs:
            procs.start("a", worker("hist-first"), env=env)
            m1 = send("first", "hist-first", 60).message_id
            wait_until(lambda: m1 in runs(record), timeout=30, what="m1 holding the key", procs=procs)
            os.killpg(procs.procs["a"].pid, signal.SIGKILL)
            procs.may_exit.add("a")
            procs.procs["a"].wait(10)

            procs.start("b", worker("hist"), env=env)
            m2 = send("hold", "hist", 60).message_id
            wait_until(lambda: m2 in runs(record), timeout=30, what="m2 granted once m1's lease expired", procs=procs)
            m3_message = send("hold", "hist", 0.1)
            m3 = m3_message.message_id
            wait_until(lambda: leases.inspect_line("h:k").length, timeout=10, what="m3 in the line", procs=procs)

            (holder,) = leases.holders("h:k")
            done = cli("--redis-url", leases_url, "release", "h:k", "--owner", holder.token)
            assert done.returncode == 0, done.stderr

            def has(event: str, message_id: str) -> bool:
                return any(e.event == event and e.message_id == message_id for e in leases.history("h:k"))

            wait_until(lambda: has("released", m3), timeout=10, what="m3 run and released", procs=procs)
            wait_until(lambda: has("lost", m2), timeout=10, what="m2's heartbeat finding its lease lost", procs=procs)
            broker.enqueue(m3_message)  # a copy of m3, which already ran
            wait_until(lambda: has("duplicate", m3), timeout=10, what="the copy of m3 refused", procs=procs)

            events = leases.history("h:k")
            print(*events, sep="\n")  # shown if the test fails
            fences = runs(record)
            f1, f2, f3 = fences[m1], fences[m2], fences[m3]
            assert f1 < f2 < f3
            granted1, expired1 = at(events, "granted", f1, m1), at(events, "expired", f1, m1)
            granted2, forced2, lost2 = (
                at(events, "granted", f2, m2),
                at(events, "force_released", f2, m2),
                at(events, "lost", f2, m2),
            )
            granted3, released3, duplicate3 = (
                at(events, "granted", f3, m3),
                at(events, "released", f3, m3),
                at(events, "duplicate", 0, m3),
            )
            assert granted1 < expired1 < granted2 < forced2 < lost2, events
            assert forced2 < granted3 < released3 < duplicate3, events
            forced, lost = events[forced2], events[lost2]
            assert forced.reason == "owner" and "@" in forced.by and forced.actor == "hold", forced
            assert lost.reason in ("gone", "stolen"), lost
            if lost.reason == "stolen":
                assert lost.by == f"fence {f3}", lost
            assert events[duplicate3].waiter == f"{m3}:0"
            assert events[granted1].holder.split(":")[-1] != events[granted2].holder.split(":")[-1]  # two processes

            shown = cli("--redis-url", leases_url, "show", "h:k", "--history")
            assert shown.returncode == 0, shown.stderr
            for word in ("force_released", "expired", "lost", "duplicate", m1, m3):
                assert word in shown.stdout, shown.stdout
            as_json = cli("--redis-url", leases_url, "show", "h:k", "--history", "--json")
            assert json.loads(as_json.stdout)["history"] == [e.as_dict() for e in leases.history("h:k")]
    finally:
        leases.client.close()
        record.close()


def test_off_by_default_writes_no_history_and_on_keeps_the_newest_n_for_a_week(redis_client: redis.Redis) -> None:
    plain = Leases(redis_client, prefix="t")
    for _ in range(3):
        lease = plain.try_acquire("k", 10_000, meta=META)
        assert isinstance(lease, Lease) and plain.renew(lease) and plain.release(lease)
    assert not list(redis_client.scan_iter("t:history:*")) and plain.history("k") == []

    kept = Leases(redis_client, prefix="t", history=3)
    fences = []
    for _ in range(3):
        lease = kept.try_acquire("k", 10_000, meta=META)
        assert isinstance(lease, Lease) and kept.release(lease)
        fences.append(lease.fence)
    events = kept.history("k")
    assert [(e.event, e.fence) for e in events] == [
        ("released", fences[1]),
        ("granted", fences[2]),
        ("released", fences[2]),
    ]
    assert events[1] == HistoryEvent(
        "granted", events[1].time_ms, fences[2], message_id="m1", actor="export", holder="web-1:42"
    )
    name = history_name("t", "k")
    assert redis_client.llen(name) == 3
    assert scripts.HISTORY_MS - 5_000 < redis_client.pttl(name) <= scripts.HISTORY_MS


def test_each_change_of_a_key_appends_its_event(redis_client: redis.Redis) -> None:
    """Adopted, superseded, lost (stolen, naming the grant that holds it), expired (naming whose grant it was),
    released by an operator (--if-dead), and the middleware's own decisions (skipped, with its wait)."""
    leases = Leases(redis_client, prefix="t", history=50)
    handed = leases.try_acquire("k", 60_000, meta=META)
    assert isinstance(handed, Lease)
    adopted = leases.adopt("k", handed.token, ttl=200, meta={**META, "host": "worker-2"})
    assert isinstance(adopted, Lease)
    # A waiter replaced by a newer one (lock_on_busy="latest").
    for waiter, first in (("old:0", 1), ("new:0", 2)):
        busy = leases.line.join(
            "k", 60_000, waiter=waiter, first_ms=first, latest=True, order=first, meta={"actor": "export"}
        )
        assert isinstance(busy, Busy)
    redis_client.pexpire(leases.lease_name("k"), 1)  # the adopter's lease ends by its TTL, unreleased
    wait_until(lambda: not redis_client.exists(leases.lease_name("k")), timeout=5, what="the lease expiring")
    leases.line.leave("k", ["new:0"])
    taker = leases.try_acquire("k", 60_000, meta={**META, "message_id": "m2"})
    assert isinstance(taker, Lease)
    assert leases.renew(adopted) is Renewal.STOLEN
    leases.record_history("k", "skipped", reason="lock_on_busy=skip", meta={**META, "message_id": "m3"}, waited_ms=1500)
    redis_client.pexpire(leases.lease_name("k"), 10**9)  # outlives its holder's deadline: a leak
    redis_client.hset(leases.lease_name("k"), "renewed_ms", 1)
    assert leases.release_if_dead("k", by="ops@bastion").released

    events = leases.history("k")
    kinds = [(e.event, e.fence) for e in events]
    f1, f2 = handed.fence, taker.fence
    assert kinds == [
        ("granted", f1),
        ("adopted", f1),
        ("superseded", 0),
        ("expired", f1),
        ("granted", f2),
        ("lost", f1),
        ("skipped", 0),
        ("force_released", f2),
    ], events
    _, adopted_event, superseded, expired, _, lost, skipped, forced = events
    assert adopted_event.holder == "worker-2:42" and adopted_event.message_id == "m1"
    assert (superseded.waiter, superseded.message_id, superseded.by) == ("old:0", "old", "new:0")
    assert expired.message_id == "m1" and expired.holder == "worker-2:42"  # whose grant: its adopter's
    assert (lost.reason, lost.by) == ("stolen", f"fence {f2}")
    assert (skipped.message_id, skipped.reason, skipped.waited_ms) == ("m3", "lock_on_busy=skip", 1500)
    assert (forced.reason, forced.by, forced.message_id) == ("dead", "ops@bastion", "m2")


def test_an_operators_release_is_recorded_by_a_store_without_history_only_where_one_is_kept(
    redis_client: redis.Redis,
) -> None:
    fleet, operator = Leases(redis_client, prefix="t", history=5), Leases(redis_client, prefix="t")
    kept, not_kept = fleet.try_acquire("kept", 60_000), fleet.try_acquire("other", 60_000)
    assert isinstance(kept, Lease) and isinstance(not_kept, Lease)
    redis_client.delete(history_name("t", "other"))  # a key whose history expired, or a fleet without one
    assert operator.release_token("kept", kept.token, by="ops@bastion")
    assert operator.release_token("other", not_kept.token, by="ops@bastion")
    assert [(e.event, e.by) for e in operator.history("kept")] == [("granted", ""), ("force_released", "ops@bastion")]
    assert not redis_client.exists(history_name("t", "other"))


def test_a_bad_history_argument_is_refused_before_the_first_write(redis_client: redis.Redis) -> None:
    with pytest.raises(LeaseConfigError, match="history must be a whole number from 0 to 10000"):
        Leases(redis_client, history=scripts.MAX_HISTORY + 1)
    leases = Leases(redis_client, prefix="t", history=5)
    name, fence = leases.lease_name("k"), leases.fence_name("k")
    with pytest.raises(redis.ResponseError, match="invalid history"):
        redis_client.eval(*grant_call(history=scripts.MAX_HISTORY + 1))
    assert not redis_client.exists(name, fence, history_name("t", "k"))
    lease = leases.try_acquire("k", 60_000)
    assert isinstance(lease, Lease)
    with pytest.raises(redis.ResponseError, match="invalid history"):
        redis_client.eval(*release_call(token=lease.token, history="x"))
    assert redis_client.exists(name)  # still held
    with pytest.raises(LeaseConfigError, match="event must be"):
        leases.record_history("k", "granted")
    with pytest.raises(LeaseConfigError, match="by must be a string"):
        leases.release_token("k", lease.token, by="x" * 513)


def test_a_history_key_of_another_type_is_replaced_not_failed_on(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t", history=5)
    redis_client.set(history_name("t", "k"), "written by hand")
    with pytest.raises(LeaseStateError, match="not a list"):
        leases.history("k")
    lease = leases.try_acquire("k", 60_000)
    assert isinstance(lease, Lease)  # the grant stands; the history starts again
    assert [e.event for e in leases.history("k")] == ["granted"]


def test_hand_written_events_with_numbers_out_of_range_are_read_not_failed_on(redis_client: redis.Redis) -> None:
    """JSON numbers no event has (infinite, NaN, past any fence or slot), written by hand: read as none, not a
    crash of ``show --history`` or of the exporter's ``/leases/history`` (a 500 with a traceback)."""
    leases = Leases(redis_client, prefix="t", history=5)
    name = history_name("t", "k")
    for raw in (
        '{"e":"granted","t":1e400,"f":-Infinity,"wt":NaN}',
        '{"e":"released","s":NaN}',
        '{"e":"released","s":1e300,"f":1e300}',
        '{"e":"released","s":-1,"t":-5}',
    ):
        redis_client.lpush(name, raw)
    events = leases.history("k")
    assert [(e.event, e.time_ms, e.fence, e.slot, e.waited_ms) for e in events] == [
        ("granted", 0, 0, None, 0),
        ("released", 0, 0, None, 0),
        ("released", 0, 0, None, 0),
        ("released", 0, 0, None, 0),
    ]


def test_the_exporter_serves_a_keys_history_under_the_busy_views_rules(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t", history=5)
    lease = leases.try_acquire("invoice:42", 60_000, meta=META)
    assert isinstance(lease, Lease)
    observer = LeaseObserver(leases)

    def get(app: ExporterApp, query: str) -> tuple[str, dict[str, Any]]:
        status: list[str] = []
        body = app(
            {"PATH_INFO": "/leases/history", "QUERY_STRING": query, "REQUEST_METHOD": "GET"},
            lambda s, headers: status.append(s),  # type: ignore[arg-type]
        )
        return status[0], json.loads(b"".join(body))

    app = ExporterApp(CollectorRegistry(), None, history_json=observer.history_json, open_lease_views=True)
    status, doc = get(app, "key=invoice%3A42")
    assert status == "200 OK" and doc["key"] == "invoice:42"
    assert [(e["event"], e["fence"], e["holder"]) for e in doc["events"]] == [("granted", lease.fence, "web-1:42")]
    assert get(app, "")[0].startswith("400")
    closed = ExporterApp(CollectorRegistry(), None, history_json=observer.history_json)
    assert get(closed, "key=invoice%3A42")[0].startswith("403")  # not on a loopback bind, nobody authenticated
    assert observer.busy_json()["history_path"] == "/leases/history?key="


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
