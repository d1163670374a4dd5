"""Redis Cluster end to end: Dramatiq workers, the CLI and the exporter on a real cluster, and a slot migration.

One cluster for the module: three masters with one replica each (six
``redis-server`` processes, :mod:`tests.support.cluster`). Dramatiq's broker
stays on a standalone Redis (its Redis broker does not speak Cluster); the
leases live on the cluster. Lease keys are chosen so that their hash slots land
on every master: a heartbeat round then renews on all three (one script call
per slot), ``list`` and the exporter must scan all three, and a key's line
lives beside its lease (same hash tag, same slot).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.cluster import RedisCluster
from redis.crc import key_slot

from dramatiq_leases import LeaseLost, LeaseMiddleware, current_lease
from dramatiq_leases.cli import main
from dramatiq_leases.core import Busy, Heartbeat, Lease, Leases, LeaseUnavailableError, Renewal
from dramatiq_leases.core.keys import lease_name
from dramatiq_leases.core.metrics import LeaseMetrics
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.cluster import RedisClusterNodes, SlotMove
from .support.runs import Runs
from .support.stack import Stack
from .support.waiting import wait_for

pytestmark = pytest.mark.system

META = {"actor": "send_invoice", "queue": "default", "message_id": "msg-1", "host": "web-7", "pid": "4242"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes(masters=3, replicas=1) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def broker_server() -> Iterator[EmbeddedRedis]:
    """Dramatiq's broker: a standalone Redis (the leases live on the cluster)."""
    with EmbeddedRedis() as server:
        yield server


class Counting(LeaseMetrics):
    """Counts renewals, losses, Redis errors and handoffs, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()

    def _add(self, *what: str) -> None:
        with self.lock:
            self.counts[(what[0], what[1])] += 1

    def renewal(self, meta: Any, outcome: str) -> None:
        self._add("renewal", outcome)

    def lost(self, meta: Any, reason: str) -> None:
        self._add("lost", reason)

    def redis_error(self, operation: str) -> None:
        self._add("error", operation)

    def handoff(self, meta: Any, seconds: float) -> None:
        self._add("handoff", "")

    def of(self, kind: str) -> dict[str, int]:
        with self.lock:
            return {outcome: n for (k, outcome), n in self.counts.items() if k == kind}


def problems(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Warnings and errors logged by Dramatiq and this package."""
    return [
        f"{r.name} {r.levelname}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith(("dramatiq", "dramatiq_leases"))
    ]


def assert_one_at_a_time(runs: list[dict[str, Any]]) -> None:
    """Runs of one key never overlap, and each later start has a larger fence."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_key.setdefault(run["key"], []).append(run)
    for key, of_key in by_key.items():
        of_key.sort(key=lambda r: r["start"])
        for before, after in itertools.pairwise(of_key):
            assert after["start"] >= before["end"], f"{key}: two runs at once: {before} and {after}"
            assert after["fence"] > before["fence"], f"{key}: fences out of order: {before} then {after}"


# --- (a) the middleware on the cluster -----------------------------------------------------------------------

TTL = 1_500  # ms: renewed every 500 ms; a holder trusts its lease 1.35 s after its last renewal
LONG = 4.6  # s: a long job outlives three TTLs, only if renewed
SHORT = 0.2  # s
HOLDER_TTL = 5_000  # ms: the TTL of the long job holding a contended key, longer than the socket timeout


class Jobs:
    """A worker (in this process) whose actor ``job`` holds its key's lease for a while and records its run.

    A run records its key, label, fence, start and end (monotonic) and its outcome: ``held`` (its lease was
    still its own at the end, and renewed ``renewed_ago`` seconds before), ``lost`` (``LeaseLost`` reached
    it), ``not held``.
    """

    def __init__(
        self,
        cluster: RedisClusterNodes,
        broker_server: EmbeddedRedis,
        prefix: str,
        *,
        form: str = "client",
        threads: int = 16,
    ) -> None:
        self.metrics = Counting()
        # A slot a reshard moves starts its grace on the new master (docs/guarantees.md): the longest TTL here,
        # not the default 30 s, which the waiters of a moved key would wait out.
        options: dict[str, Any] = {
            "prefix": prefix,
            "metrics": self.metrics,
            "metrics_endpoint": False,
            "failover_grace": HOLDER_TTL,
        }
        if form == "client":
            middleware = LeaseMiddleware(client=cluster.client(), **options)
        else:
            middleware = LeaseMiddleware(redis_url=cluster.url, **options)
        assert isinstance(middleware.leases.client, RedisCluster)
        self.stack = Stack(broker_server.url(0), "", threads=threads, middleware=middleware)
        self.leases = leases = self.stack.leases
        self.runs = runs = Runs()
        self.messages: list[Any] = []

        @self.stack.actor(lock_key="{key}", lock_ttl=TTL, max_retries=0, queue_name=f"cluster-{prefix}")
        def job(key: str, label: str, seconds: float) -> None:
            lease = current_lease()
            start = time.monotonic()
            outcome, renewed_ago = "lost", None
            try:
                while time.monotonic() - start < seconds:  # Python code: a LeaseLost lands within 10 ms
                    time.sleep(0.01)
                info = leases.inspect(key)  # still ours, renewed a moment ago
                outcome = "held" if info is not None and info.token == lease.token else "not held"
                renewed_ago = (info.now_ms - info.renewed_ms) / 1000 if info is not None else None
            except LeaseLost:
                outcome = "lost"
                raise
            finally:
                runs.add(
                    key=key,
                    label=label,
                    fence=lease.fence,
                    start=start,
                    end=time.monotonic(),
                    outcome=outcome,
                    renewed_ago=renewed_ago,
                )

        self.job = job

    def send(self, key: str, label: str, seconds: float, **options: Any) -> None:
        self.messages.append(self.job.send_with_options(args=(key, label, seconds), **options))

    def hold(self, keys: list[str]) -> None:
        """Wait until each of ``keys`` is held."""
        wait_for(
            lambda: all(self.leases.inspect(k) is not None for k in keys),
            timeout=10,
            what="the long jobs to hold their keys",
        )

    def settle(self) -> dict[str, str]:
        """Wait until every message sent settled; its outcome (acked or nacked) by message id."""
        return {m.message_id: self.stack.recorder.wait_settled(m.message_id, timeout=30) for m in self.messages}

    def outcome_of(self, key: str, label: str) -> str:
        [run] = self.runs.where(key=key, label=label)
        return str(run["outcome"])


@pytest.mark.parametrize("form", ["client", "url"])
def test_workers_on_the_cluster_hold_renew_wait_in_line_and_release(
    cluster: RedisClusterNodes, broker_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture, form: str
) -> None:
    caplog.set_level(logging.WARNING)
    prefix = f"e2e-{form}"
    jobs = Jobs(cluster, broker_server, prefix, form=form)
    leases, runs, metrics = jobs.leases, jobs.runs, jobs.metrics
    masters = cluster.masters()
    # Two keys per master: the first is contended (a long job, then two short ones wait in its line), the
    # second holds a long job alone.
    spread = cluster.spread(lambda k: lease_name(prefix, k), 2, (f"invoice:{i}" for i in range(10_000)))
    contended = [keys[0] for keys in spread.values()]
    alone = [keys[1] for keys in spread.values()]
    stats_before = cluster.commandstats()
    try:
        jobs.stack.start()
        # A contended key's holder has a TTL longer than the client's socket timeout (2 s): its waiters block
        # in place until it is released, longer than one read may wait on a socket.
        for key in contended:
            jobs.send(key, "long", LONG, lock_ttl=HOLDER_TTL)
        for key in alone:
            jobs.send(key, "long", LONG)
        jobs.hold(contended)
        for n in (1, 2):
            for key in contended:
                jobs.send(key, f"short-{n}", SHORT)
        # The line: both short messages of each contended key wait in it, on their key's master.
        wait_for(
            lambda: all(leases.inspect_line(k).length == 2 for k in contended),
            timeout=5,
            what="two waiters in the line of each contended key",
        )
        for key in contended:
            assert cluster.master_of(leases.lease_name(key)) == cluster.master_of(f"{prefix}:line:{{{key}}}")
        outcome = jobs.settle()
    finally:
        jobs.stack.stop()

    assert problems(caplog) == []
    assert set(outcome.values()) == {"acked"}, outcome
    assert runs.count() == len(outcome) == 12
    assert [r for r in runs.items if r["outcome"] != "held"] == []
    assert_one_at_a_time(runs.items)
    # Renewed on every master: a long job of more than three TTLs on a key of each master kept its lease,
    # renewed until the end; no renewal failed.
    long_runs = [r for r in runs.where(label="long") if r["key"] in alone]
    assert {cluster.master_of(leases.lease_name(r["key"])) for r in long_runs} == set(masters)
    assert all(r["renewed_ago"] < TTL / 1000 / 3 + 0.25 for r in long_runs), long_runs
    renewals = metrics.of("renewal")
    assert renewals.get("ok", 0) >= 3 * (int(LONG * 1000 / (TTL / 3)) - 2), renewals
    assert set(renewals) == {"ok"} and metrics.of("lost") == {} and metrics.of("error") == {}, metrics.counts
    stats_after = cluster.commandstats()
    for port in masters:
        assert stats_after[port].get("evalsha", 0) - stats_before[port].get("evalsha", 0) >= 2 * 8, port
    # The line handed each contended key over on release: the short jobs ran after the long one.
    for key in contended:
        order = [r["label"] for r in sorted(runs.where(key=key), key=lambda r: r["start"])]
        assert order[0] == "long" and sorted(order[1:]) == ["short-1", "short-2"], order
    assert metrics.of("handoff").get("", 0) >= 3
    # Released: nothing left under the prefix, lines gone, the fence counters say released.
    assert list(leases.scan()) == []
    assert [line for line in leases.scan_lines() if line.length] == []
    for key in contended + alone:
        fences = leases.fence_state(key)
        assert fences["released"] == fences["fence"] == max(r["fence"] for r in runs.where(key=key))
    leases.client.close()


def test_a_wait_in_place_ends_before_the_cluster_client_times_out(cluster: RedisClusterNodes) -> None:
    """A RedisCluster client has no per-thread connections: a block longer than its socket timeout would fail
    the wait (after redis-py's retries, each refreshing the cluster's layout) instead of ending it."""
    leases = Leases(cluster.client(socket_timeout=1))
    started = time.monotonic()
    assert leases.line.wait_turn("invoice:1", "m-1:0", 8_000) is False  # nobody wakes it: it ends, unwoken
    assert time.monotonic() - started < 1.0
    leases.client.close()


def test_a_wait_in_place_that_fails_sends_the_message_back_without_failing_it(
    cluster: RedisClusterNodes, broker_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A wait in place can fail where an acquire did not (its node failing over, its slot moving): the message
    asks again and comes back later, as when its acquire fails; it is not failed, nor its actor called."""
    caplog.set_level(logging.WARNING)
    jobs = Jobs(cluster, broker_server, "wait-fails", threads=4)
    leases = jobs.leases
    wait_turn = leases.line.wait_turn
    failed: list[str] = []

    def failing_once(key: str, waiter: str, block_ms: int) -> bool:
        if not failed:
            failed.append(waiter)
            raise LeaseUnavailableError(f"could not wait for {key!r}: ConnectionError: injected", key=key)
        return wait_turn(key, waiter, block_ms)

    leases.line.wait_turn = failing_once  # type: ignore[method-assign]
    try:
        jobs.stack.start()
        jobs.send("invoice:1", "long", 1.0, lock_ttl=HOLDER_TTL)
        jobs.hold(["invoice:1"])
        jobs.send("invoice:1", "short", SHORT)
        outcome = jobs.settle()
    finally:
        jobs.stack.stop()
    assert failed, "the waiter never waited in place"
    assert set(outcome.values()) == {"acked"}, outcome
    assert [r["outcome"] for r in sorted(jobs.runs.items, key=lambda r: r["start"])] == ["held", "held"]
    assert_one_at_a_time(jobs.runs.items)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert jobs.metrics.of("error") == {"acquire": 1}
    leases.client.close()


# --- (b) the CLI and the exporter on the cluster ----------------------------------------------------------

WAITER_META = {"actor": "export_report", "queue": "reports", "host": "worker-3", "pid": "99"}


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def fetch(port: int, path: str) -> bytes | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            body: bytes = response.read()
            return body
    except OSError:
        return None


def samples(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_cli_and_exporter_see_and_release_leases_on_every_master(cluster: RedisClusterNodes) -> None:
    prefix = "ops"
    leases = Leases.from_url(cluster.url, prefix=prefix)
    assert isinstance(leases.client, RedisCluster)
    name_of = leases.lease_name
    spread = cluster.spread(name_of, 3, (f"invoice:{i}" for i in range(10_000)))
    masters = sorted(spread)
    held: dict[str, Lease] = {}
    for keys in spread.values():
        for key in keys[:2]:  # two live leases on each master ...
            lease = leases.try_acquire(key, 60_000, interval=10_000, meta=META)
            assert isinstance(lease, Lease)
            held[key] = lease
        # ... the first of which has two messages waiting in its line, on the same master.
        for n in range(2):
            busy = leases.line.join(keys[0], 60_000, meta=WAITER_META, waiter=f"{keys[0]}-m{n}:0")
            assert isinstance(busy, Busy) and busy.line == n + 1
    contended = [keys[0] for keys in spread.values()]
    # Debris on the third key of the first master: a hash written by hand, without TTL (a leak).
    leaked = spread[masters[0]][2]
    leases.client.hset(name_of(leaked), mapping={"token": "t", "fence": 3, "key": leaked})
    base = ["--redis-url", cluster.url, "--prefix", prefix]

    # list: every master's leases, in one listing.
    code, out, err = cli([*base, "list", "--json"])
    assert code == 0, err
    rows = {row["key"]: row for row in json.loads(out)}
    assert set(rows) == {*held, leaked}
    assert {cluster.master_of(name_of(key)) for key in rows} == set(masters)
    assert {rows[key]["state"] for key in held} == {"alive"} and rows[leaked]["state"] == "no_ttl"
    code, out, _ = cli([*base, "list"])
    assert code == 0 and all(key in out for key in rows)

    # show: a lease and its line, on each master.
    for key in contended:
        code, out, err = cli([*base, "show", key, "--json"])
        assert code == 0, err
        shown = json.loads(out)
        assert shown["fence"] == held[key].fence and shown["line"]["length"] == 2, shown
    assert cli([*base, "show", "invoice:none"])[0] == 3

    # The exporter, as the command runs it: it scans every master.
    port = free_port()
    exporter = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dramatiq_leases.cli",
            *base,
            "exporter",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--interval",
            "0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        def scraped() -> dict[Any, float]:
            assert exporter.poll() is None, exporter.stdout.read() if exporter.stdout else ""
            body = fetch(port, "/metrics")
            return samples(body) if body else {}

        labels = (("actor_name", "send_invoice"), ("queue_name", "default"))
        figures = wait_for(
            lambda: (f := scraped()).get(("dramatiq_lease_present", labels)) and f,
            timeout=20,
            what="the exporter's first scan",
        )
        assert isinstance(figures, dict)  # for mypy: wait_for returns only a truthy value, here the figures
        assert figures[("dramatiq_lease_present", labels)] == len(held)
        assert figures[("dramatiq_lease_leaked", (("actor_name", ""), ("queue_name", ""), ("reason", "no_ttl")))] == 1
        assert figures[("dramatiq_lease_waiting", (("actor_name", "export_report"),))] == 2 * len(contended)
        page = json.loads(fetch(port, "/leases") or b"{}")
        assert page["leases_total"] == len(held) + 1
        assert {row["key"] for row in page["leases"]} == {*held, leaked}
        assert page["leases"][0]["key"] == leaked  # leaked first
        assert {row["key"]: row["line_length"] for row in page["hot_keys"]} == dict.fromkeys(contended, 2)
        # Its `show` commands name the cluster.
        command = next(row["inspect_command"] for row in page["hot_keys"])
        assert cluster.url in command
        assert cli(shlex.split(command)[1:])[0] == 0

        # A grant on a second master that ends by its TTL is counted as expired (fence counters read across
        # slots); one released by its owner is not.
        short_key = spread[masters[1]][2]
        short = leases.try_acquire(short_key, 400, interval=100, meta=META)
        assert isinstance(short, Lease)
        wait_for(
            lambda: short_key in {row["key"] for row in json.loads(fetch(port, "/leases") or b"{}")["leases"]},
            timeout=5,
            what="the exporter to see the short lease",
        )

        # release --owner: only the holding token; release --if-dead: only the leak.
        released, other = contended[1], spread[masters[2]][1]
        assert cli([*base, "release", released, "--owner", "not-the-token"])[0] == 1
        code, out, err = cli([*base, "release", released, "--owner", held[released].token])
        assert code == 0 and "the token matched" in out, err
        code, _, err = cli([*base, "release", other, "--if-dead"])
        assert code == 1 and "refused" in err
        code, out, err = cli([*base, "release", leaked, "--if-dead"])
        assert code == 0 and "had no TTL" in out, err
        assert cli([*base, "release", leaked, "--if-dead"])[0] == 3
        assert leases.inspect(released) is None and leases.inspect(leaked) is None
        assert leases.inspect(other) is not None

        no_ttl = ("dramatiq_lease_leaked", (("actor_name", ""), ("queue_name", ""), ("reason", "no_ttl")))

        def after() -> dict[Any, float] | None:
            # A scan after both releases and the short grant's expiry (one between the releases sees the leak).
            figures = scraped()
            expired = figures.get(("dramatiq_lease_expired_total", labels), 0)
            settled = figures.get(("dramatiq_lease_present", labels)) == len(held) - 1 and not figures.get(no_ttl)
            return figures if expired >= 1 and settled else None

        figures = wait_for(after, timeout=10, what="the exporter to count the expired grant")
        assert figures is not None  # for mypy: wait_for returns only a truthy value
        assert figures[("dramatiq_lease_expired_total", labels)] == 1  # the released one is not counted
    finally:
        exporter.terminate()
        exporter.wait(10)

    # A cluster URL that cannot work: unreachable (exit 4, one line), or naming a database (exit 2).
    code, _, err = cli(["--redis-url", f"redis+cluster://127.0.0.1:{free_port()}", "list"])
    assert (
        code == 4 and err.startswith("dramatiq-leases: cannot use Redis at redis+cluster://") and err.count("\n") == 1
    )
    assert cli(["--redis-url", f"{cluster.url}/1", "list"])[0] == 2
    leases.client.close()


# --- (c) slot migrations while leases are held and renewed ---------------------------------------------------

MOVE_LONG = 4.0  # s: long enough to hold across the move and be renewed after it


def move_keys(cluster: RedisClusterNodes, prefix: str, slot: int) -> tuple[list[str], list[str]]:
    """Two keys whose leases live in ``slot``, and one key on each master in other slots."""
    name_of: Callable[[str], str] = lambda k: lease_name(prefix, k)  # noqa: E731
    moving = cluster.in_slot(name_of, slot, 2, (f"invoice:{i}" for i in itertools.count()))
    spread = cluster.spread(name_of, 1, (f"order:{i}" for i in range(10_000)))
    others = [keys[0] for keys in spread.values()]
    assert all(key_slot(name_of(k).encode()) != slot for k in others)
    return moving, others


def unexpected_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Errors logged other than the loss of a lease (and the failure of the actor it interrupted)."""
    out = []
    for r in caplog.records:
        if r.levelno < logging.ERROR:
            continue
        if r.exc_info and isinstance(r.exc_info[1], LeaseLost):
            continue
        if r.name == "dramatiq_leases.core.heartbeat" and " lost: " in r.getMessage():
            continue
        out.append(f"{r.name}: {r.getMessage()} {r.exc_info[1] if r.exc_info else ''}")
    return out


def redirections(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log lines naming a Cluster redirection: one that reached this package or Dramatiq unhandled."""
    words = ("MOVED", "ASK ", "MovedError", "AskError")
    return [r.getMessage() for r in caplog.records if any(word in r.getMessage() for word in words)]


def test_a_slot_resharded_while_its_leases_are_held_keeps_them_renewed(
    cluster: RedisClusterNodes, broker_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """``redis-cli --cluster reshard`` moves the slot of two held leases (and of the line of one) to another
    master while the jobs run: renewals follow it (ASK, then MOVED), the jobs keep their leases, and the
    waiters take the key after the move, one at a time."""
    caplog.set_level(logging.WARNING)
    prefix = "reshard"
    jobs = Jobs(cluster, broker_server, prefix, threads=12)
    leases = jobs.leases
    masters = cluster.masters()
    owners = cluster.slot_owners(masters[0])
    source, target = masters[0], masters[1]
    slot = min(s for s, port in owners.items() if port == source)  # the slot reshard moves first
    moving, others = move_keys(cluster, prefix, slot)
    try:
        jobs.stack.start()
        for key in moving + others:
            jobs.send(key, "long", MOVE_LONG)
        jobs.hold(moving + others)
        for n in (1, 2):
            jobs.send(moving[0], f"short-{n}", SHORT)
        wait_for(lambda: leases.inspect_line(moving[0]).length == 2, timeout=5, what="two waiters in the line")
        cluster.reshard(source, target, slots=1)
        seconds, micros = leases.client.time()
        moved_ms = int(seconds) * 1000 + int(micros) // 1000
        assert {cluster.master_of(leases.lease_name(k)) for k in moving} == {target}
        # Renewed since the move, at the new master, by the same holders.
        wait_for(
            lambda: all((i := leases.inspect(k)) is not None and i.renewed_ms > moved_ms for k in moving + others),
            timeout=5,
            what="renewals after the move",
        )
        assert [r for r in jobs.runs.items if r["label"] == "long"] == [], "the jobs ended before the move"
        outcome = jobs.settle()
    finally:
        jobs.stack.stop()

    assert redirections(caplog) == [] and unexpected_errors(caplog) == [], problems(caplog)
    assert set(outcome.values()) == {"acked"}, outcome
    assert [r for r in jobs.runs.items if r["outcome"] != "held"] == []
    assert_one_at_a_time(jobs.runs.items)
    order = [r["label"] for r in sorted(jobs.runs.where(key=moving[0]), key=lambda r: r["start"])]
    assert order[0] == "long" and sorted(order[1:]) == ["short-1", "short-2"], order
    assert jobs.metrics.of("lost") == {}, jobs.metrics.counts
    assert list(leases.scan()) == []
    leases.client.close()


def test_a_slot_left_half_moved_loses_only_its_own_leases_and_never_runs_a_key_twice(
    cluster: RedisClusterNodes, broker_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A slot stuck half moved (one lease key at the new master, the rest of its slot at the old one): its
    leases cannot be renewed (TRYAGAIN), so their jobs are told (``LeaseLost``) before their keys expire,
    and nothing takes those keys until the slot is whole again; leases in other slots go on being renewed."""
    caplog.set_level(logging.WARNING)
    prefix = "split"
    jobs = Jobs(cluster, broker_server, prefix, threads=12)
    leases = jobs.leases
    masters = cluster.masters()
    owners = cluster.slot_owners(masters[0])
    source, target = masters[1], masters[2]
    slot = sorted(s for s, port in owners.items() if port == source)[100]
    moving, others = move_keys(cluster, prefix, slot)
    move = SlotMove(cluster, slot, target)
    try:
        jobs.stack.start()
        for key in moving + others:
            jobs.send(key, "long", MOVE_LONG)
        jobs.hold(moving + others)
        jobs.send(moving[0], "short", SHORT)
        wait_for(lambda: leases.inspect_line(moving[0]).length == 1, timeout=5, what="a waiter in the line")
        move.begin()
        move.migrate([leases.lease_name(moving[0])])  # the rest of the slot stays behind, for now
        # Both leases of the slot are renewed by one script call, which finds half its keys gone: TRYAGAIN.
        # Their jobs are told before the keys expire; the other leases are renewed meanwhile.
        wait_for(lambda: len(jobs.runs.where(outcome="lost")) == 2, timeout=5, what="the jobs of the slot to be told")
        assert {r["key"] for r in jobs.runs.where(outcome="lost")} == set(moving)
        assert jobs.runs.where(label="short") == [], "a waiter ran while the slot was half moved"
        move.finish()
        assert {cluster.master_of(leases.lease_name(k)) for k in moving} == {target}
        outcome = jobs.settle()
    finally:
        jobs.stack.stop()

    assert redirections(caplog) == [] and unexpected_errors(caplog) == [], problems(caplog)
    by_id = {m.message_id: m.args for m in jobs.messages}
    for message_id, result in outcome.items():
        key, label, _ = by_id[message_id]
        assert result == ("nacked" if key in moving and label == "long" else "acked"), (key, label, result)
    for key in others:
        assert jobs.outcome_of(key, "long") == "held"
    assert jobs.outcome_of(moving[0], "short") == "held"
    assert_one_at_a_time(jobs.runs.items)
    assert jobs.metrics.of("lost") == {"unreachable": 2}, jobs.metrics.counts
    assert list(leases.scan()) == []
    leases.client.close()


def stop_master(nodes: RedisClusterNodes, port: int, how: str) -> Callable[[], None]:
    """Make master ``port`` hang (``SIGSTOP``: its connections time out, as behind a partition) or die
    (``SIGKILL``: refused); returns what undoes a hang."""
    server = next(n for n in nodes.nodes if n.port == port)
    assert server.process is not None
    pid = server.process.pid
    if how == "killed":
        os.kill(pid, signal.SIGKILL)
        server.process.wait()
        return lambda: None
    os.kill(pid, signal.SIGSTOP)
    return lambda: os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("how", ["hung", "killed"])
def test_a_master_that_fails_costs_only_its_own_leases(how: str) -> None:
    """A master stops answering (hung or dead, no replica to replace it). Each heartbeat round waits one socket
    timeout for it in all, not one per slot (redis-py's cluster pipeline retried slot by slot: a round of 60
    leases took 211 s), and fails only its calls, so the leases on the other masters go on being renewed while
    the failed master's, with a longer TTL, are still tracked; those are lost at their own deadline."""
    short_ttl, long_ttl, interval = 3_000, 8_000, 500
    with RedisClusterNodes(masters=3, replicas=0) as nodes:
        for port in nodes.masters():  # the other masters keep serving their slots once the failed one is FAIL
            nodes.node(port).config_set("cluster-require-full-coverage", "no")
        client = nodes.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        leases = Leases(client)
        by_master = nodes.spread(leases.lease_name, 10, (f"fail:{i}" for i in itertools.count()))
        victim = nodes.masters()[0]
        lost: dict[str, str] = {}
        heartbeat = Heartbeat(leases)
        held: dict[str, Lease] = {}
        for port, keys in by_master.items():
            for key in keys:
                lease = leases.try_acquire(key, long_ttl if port == victim else short_ttl, interval=interval)
                assert isinstance(lease, Lease)
                held[key] = lease
                heartbeat.track(lease, on_lost=lambda lease, reason: lost.setdefault(lease.key, reason))  # type: ignore[arg-type]  # what the callback returns is ignored
        heartbeat.start()
        failed, healthy = set(by_master[victim]), set(held) - set(by_master[victim])
        resume = stop_master(nodes, victim, how)
        stopped_at = time.monotonic()
        try:
            # A wait in place for a key of the failed master fails in one socket timeout (redis-py's cluster
            # client took 22 s), so the message goes back; one for a key elsewhere just waits its time.
            with pytest.raises(LeaseUnavailableError):
                leases.line.wait_turn(next(iter(failed)), "waiter", 200)
            assert time.monotonic() - stopped_at < 4 * 0.5, "the wait outlasted the socket timeout"
            assert leases.line.wait_turn(next(iter(healthy)), "waiter", 200) is False

            def renewed_since_the_stop(lease: Lease) -> bool:
                # Confirmed by a renewal sent a second or more after the stop.
                return time.monotonic() + lease.remaining() > stopped_at + (lease.ttl - lease.margin) / 1000 + 1.0

            wait_for(
                lambda: all(renewed_since_the_stop(held[k]) for k in healthy),
                timeout=5,
                what="the other masters' leases to be renewed",
            )
            assert lost == {}, "a lease was lost before the failed master's deadline"
            wait_for(lambda: set(lost) == failed, timeout=15, what="the failed master's leases to be lost")
        finally:
            resume()
            heartbeat.stop()
        assert set(lost) == failed and set(lost.values()) == {"unreachable"}, lost
        client.close()


def test_leases_on_a_master_that_fails_over_go_on_being_renewed_by_its_replica() -> None:
    """A master dies; its replica is promoted: the same client's renewal rounds find the new master (the slot
    map is read again after the failure), and leases the replica had received are renewed there, not lost."""
    with RedisClusterNodes(masters=3, replicas=1) as nodes:
        client = nodes.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        leases = Leases(client)
        by_master = nodes.spread(leases.lease_name, 3, (f"failover:{i}" for i in itertools.count()))
        held = {key: leases.try_acquire(key, 60_000) for key in itertools.chain(*by_master.values())}
        assert all(isinstance(lease, Lease) for lease in held.values())
        victim = next(port for port in by_master if port != nodes.nodes[0].port)
        assert nodes.node(victim).execute_command("WAIT", 1, 5_000) == 1  # type: ignore[no-untyped-call]  # its replica has the grants (execute_command: untyped)
        stop_master(nodes, victim, "killed")
        rounds: list[list[Renewal]] = []

        def renewed_everywhere() -> bool:
            with contextlib.suppress(LeaseUnavailableError):
                rounds.append(leases.renew_many(list(held.values())))  # type: ignore[arg-type]
            return bool(rounds) and rounds[-1] == [Renewal.OK] * len(held)

        wait_for(renewed_everywhere, timeout=30, interval=0.5, what="renewals on the promoted replica")
        assert victim not in {n.port for n in client.get_primaries()}  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        assert Renewal.ERROR in itertools.chain(*rounds), "the failure was never seen: the test proves nothing"
        assert all(r in (Renewal.OK, Renewal.ERROR) for r in itertools.chain(*rounds)), rounds  # never gone/stolen
        client.close()


# --- (e) a hung master blinds the CLI and the exporter to its own keys only ----------------------------------


def test_a_hung_master_hides_only_its_own_leases_from_list_and_the_exporter_and_is_named() -> None:
    """One master SIGSTOPped (no replica to replace it). ``list`` shows what the others hold, names the hung
    master on stderr and exits 6; the exporter goes on reporting a no-TTL leak on a healthy master, says one
    master did not answer (``dramatiq_lease_exporter_unreachable_nodes``, and by name on ``/leases``), and
    does not take the hung master's leases for ended. Each costs about a socket timeout, not redis-py's
    cluster retries (``list`` exited 4 after 22 s; the exporter withheld every gauge)."""
    from dramatiq_leases.exporter import Exporter

    timeout = 0.5
    prefix = "blind"
    with RedisClusterNodes(masters=3, replicas=0) as nodes:
        for port in nodes.masters():  # the other masters keep serving their slots once the hung one is FAIL
            nodes.node(port).config_set("cluster-require-full-coverage", "no")
        client = nodes.client(socket_timeout=timeout, socket_connect_timeout=timeout)
        leases = Leases(client, prefix=prefix)
        by_master = nodes.spread(leases.lease_name, 2, (f"blind:{i}" for i in itertools.count()))
        victim = next(port for port in nodes.masters() if port != nodes.nodes[0].port)  # not the CLI's seed
        healthy = [port for port in by_master if port != victim]
        held = {}
        for keys in by_master.values():
            lease = leases.try_acquire(keys[0], 60_000, interval=10_000, meta=META)
            assert isinstance(lease, Lease)
            held[keys[0]] = lease
        leak = by_master[healthy[0]][1]  # a lease hash written by hand without TTL, on a healthy master
        client.hset(leases.lease_name(leak), mapping={"token": "t", "fence": 3, "key": leak, "meta": '{"actor":"a"}'})
        visible = {keys[0] for port, keys in by_master.items() if port != victim} | {leak}
        exporter = Exporter(leases, host="127.0.0.1", port=0)
        labels = (("actor_name", "send_invoice"), ("queue_name", "default"))
        no_ttl = (("actor_name", "a"), ("queue_name", ""), ("reason", "no_ttl"))
        url = f"{nodes.url}?socket_timeout={timeout}&socket_connect_timeout={timeout}"
        assert exporter.observer.scan().present[("send_invoice", "default")] == len(held)  # before the hang
        resume = stop_master(nodes, victim, "hung")
        try:
            for moment in ("at once", "once the cluster marks it failed"):
                if moment != "at once":
                    wait_for(
                        lambda: all(
                            b"fail" in line
                            for line in nodes.node(healthy[0]).execute_command("CLUSTER", "NODES").encode().splitlines()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                            if str(victim).encode() in line
                        ),
                        timeout=20,
                        interval=0.2,
                        what="the cluster to mark the hung master failed",
                    )
                started = time.monotonic()
                snap = exporter.observer.scan()
                took = time.monotonic() - started
                assert took < 4 * timeout, f"the scan took {took:.1f}s {moment}"
                assert list(snap.unreachable) == [f"127.0.0.1:{victim}"], (moment, snap.unreachable)
                figures = samples(fetch(exporter.port, "/metrics") or b"")
                assert figures[("dramatiq_lease_exporter_unreachable_nodes", ())] == 1
                assert figures[("dramatiq_lease_leaked", no_ttl)] == 1, moment
                assert figures[("dramatiq_lease_present", labels)] == len(healthy)
                assert figures[("dramatiq_lease_expired_total", labels)] == 0  # not seen is not ended
                assert figures[("dramatiq_lease_ended_unknown_total", labels)] == 0
                page = json.loads(fetch(exporter.port, "/leases") or b"{}")
                assert [row["node"] for row in page["unreachable_nodes"]] == [f"127.0.0.1:{victim}"]

                started = time.monotonic()
                code, out, err = cli(["--redis-url", url, "--prefix", prefix, "list", "--json"])
                took = time.monotonic() - started
                assert code == 6, (moment, code, err)
                assert {row["key"] for row in json.loads(out)} == visible
                assert err.startswith("dramatiq-leases: 1 Redis Cluster master(s) did not answer")
                assert f"127.0.0.1:{victim}" in err and err.count("\n") == 1
                assert took < 8 * timeout, f"list took {took:.1f}s {moment}"
                code, out, err = cli(["--redis-url", url, "--prefix", prefix, "list"])
                assert code == 6 and all(key in out for key in visible) and f"127.0.0.1:{victim}" in err
                # show: a key on a healthy master as ever; one on the hung master, Redis unreachable (exit 4), soon.
                assert cli(["--redis-url", url, "--prefix", prefix, "show", leak])[0] == 0
                started = time.monotonic()
                code, _, err = cli(["--redis-url", url, "--prefix", prefix, "show", by_master[victim][0]])
                assert code == 4 and f"127.0.0.1:{victim}" in err, err
                assert time.monotonic() - started < 8 * timeout
        finally:
            resume()
            exporter.close()
        # Back: nothing was lost meanwhile, and the figures are whole again.
        snap = wait_for(  # type: ignore[assignment]  # wait_for returns only a truthy value, never None
            lambda: s if not (s := exporter.observer.scan()).unreachable else None,
            timeout=10,
            what="the master to answer again",
        )
        assert snap.present[("send_invoice", "default")] == len(held)
        assert exporter.observer.expired == Counter() and exporter.observer.ended_unknown == Counter()
        client.close()


def test_a_line_in_a_slot_half_moved_is_read_at_its_new_master_and_no_master_is_called_silent(
    cluster: RedisClusterNodes,
) -> None:
    """A reshard moves a busy key's line and waiters to another master while its lease stays behind: the
    exporter's and ``show``'s reads follow ``ASK`` to the importing master, and name no master as silent."""
    from dramatiq_leases.core.reading import ReadGaps

    prefix = "asked"
    leases = Leases.from_url(cluster.url, prefix=prefix)
    masters = cluster.masters()
    source, target = masters[0], masters[1]
    owners = cluster.slot_owners(source)
    slot = sorted(s for s, port in owners.items() if port == source)[200]
    [key] = cluster.in_slot(leases.lease_name, slot, 1, (f"invoice:{i}" for i in itertools.count()))
    assert isinstance(leases.try_acquire(key, 60_000, meta=META), Lease)
    for n in range(2):
        assert isinstance(leases.line.join(key, 60_000, meta=WAITER_META, waiter=f"m{n}:0"), Busy)
    move = SlotMove(cluster, slot, target)
    move.begin()
    try:
        line = f"{prefix}:line:{{{key}}}"
        move.migrate([line, line.replace(":line:", ":waiters:")])
        gaps = ReadGaps()
        lines = {info.name: info for info in leases.scan_lines(gaps=gaps)}
        assert gaps.nodes == {} and gaps.keys == {}, gaps
        assert lines[line].length == 2 and lines[line].actors == {"export_report": 2}
        assert [info.key for info in leases.scan(gaps=gaps)] == [key] and gaps.nodes == {}
        code, out, err = cli(["--redis-url", cluster.url, "--prefix", prefix, "show", key, "--json"])
        assert code == 0, err
        assert json.loads(out)["line"]["length"] == 2
    finally:
        move.finish()
    assert leases.inspect_line(key).length == 2
    leases.client.close()


def test_a_master_that_answers_scan_but_refuses_the_read_hides_only_its_own_leases(cluster: RedisClusterNodes) -> None:
    """A master that lists its keys but fails their read (here its ACL refuses EVALSHA: the lease hashes are read
    by a script) is a blind spot of its own: the exporter reports the other masters' leases, a leak among
    them, and names that master; it does not fail the whole scan."""
    from dramatiq_leases.exporter import Exporter

    prefix = "refused"
    leases = Leases.from_url(cluster.url, prefix=prefix)
    by_master = cluster.spread(leases.lease_name, 2, (f"refused:{i}" for i in range(10_000)))
    victim, *healthy = sorted(by_master)
    for keys in by_master.values():
        assert isinstance(leases.try_acquire(keys[0], 60_000, meta=META), Lease)
    leak = by_master[healthy[0]][1]
    leases.client.hset(leases.lease_name(leak), mapping={"token": "t", "fence": 3, "key": leak})
    exporter = Exporter(leases, host="127.0.0.1", port=0)
    node = cluster.node(victim)
    node.execute_command("ACL", "SETUSER", "default", "-evalsha")  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
    try:
        snap = exporter.observer.scan()
        assert (
            list(snap.unreachable) == [f"127.0.0.1:{victim}"]
            and "NoPermissionError" in snap.unreachable[f"127.0.0.1:{victim}"]
        )
        assert {info.key for info in snap.leases} == {by_master[port][0] for port in healthy} | {leak}
        assert snap.leaked[("", "", "no_ttl")] == 1
    finally:
        node.execute_command("ACL", "SETUSER", "default", "+@all")  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        node.close()
        exporter.close()
    assert not exporter.observer.scan().unreachable
    for keys in by_master.values():
        leases.client.delete(leases.lease_name(keys[0]), leases.lease_name(keys[1]))
    leases.client.close()
