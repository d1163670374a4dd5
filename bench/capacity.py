"""``python -m bench.capacity [--quick]``: the capacity model, measured (issue 13, item 5).

Prints a Markdown report. What it measures, on this machine:

1. acquire+release cycles and heartbeat renewals (``Leases.renew_many`` rounds of N = 1 000) driven by
   several client processes (multiprocessing, fork) against one private standalone ``redis-server``
   (``--save "" --appendonly no``); Redis CPU seconds per 1 000 operations from ``INFO cpu``
   (``used_cpu_sys + used_cpu_user`` deltas), hence operations per Redis core;
2. the same against a 3-master Redis Cluster without replicas (keys spread over the slots), the CPU
   summed over the masters;
3. ``INFO memory`` ``used_memory`` per held lease (with the middleware's metadata), per fence counter left
   after release (with and without ``fence_retention_ms``), and per waiter in a line;
4. a simulated fleet: processes each holding leases tracked by the real :class:`Heartbeat` (TTL 30 s,
   interval 10 s) plus a paced acquire/release load: Redis commands/s, acquire latency, renewal margin;
5. on paper, from those measurements: heartbeat and acquire load per 1 000 workers, workers per Redis
   core, memory for 1 M keys.

Ratios and CPU per operation matter more than absolute rates: the clients share the machine's cores
with Redis, so the rates are client-bound long before Redis is.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import redis

from dramatiq_leases.core import Heartbeat, Lease, Leases, LostReason, Renewal
from dramatiq_leases.embedded import EmbeddedRedis

from .common import fmt, load_average, machine_info, percentile, table

TTL_MS = 30_000
INTERVAL_MS = 10_000
RENEW_N = 1_000
PREFIX = "cap"


def meta_for(i: int) -> dict[str, str]:
    """The metadata the middleware stores with a lease (actor, queue, message_id, host, pid)."""
    return {
        "actor": "export_report",
        "queue": "default",
        "message_id": f"5f0c6d2e-8a3b-4c1d-9e7f-{i:012d}",
        "host": "worker-host-01.example.internal",
        "pid": str(os.getpid()),
    }


# Redis readings ----------------------------------------------------------------------------------


def redis_cpu(clients: Sequence[redis.Redis]) -> float:
    """``used_cpu_sys + used_cpu_user`` summed over ``clients``' servers (s)."""
    total = 0.0
    for c in clients:
        info = c.info("cpu")
        total += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return total


#: The script commands: their ``commandstats`` time covers everything the script ran.
SCRIPT_COMMANDS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro", "cmdstat_eval_ro")


def redis_commands(clients: Sequence[redis.Redis]) -> tuple[int, int, float]:
    """From ``commandstats``: (script calls, all calls incl. the commands scripts run, script execution µs).

    ``INFO`` itself is left out.
    """
    scripts = calls = 0
    usec = 0.0
    for c in clients:
        for name, stats in c.info("commandstats").items():
            if name == "cmdstat_info":
                continue
            calls += int(stats["calls"])
            if name in SCRIPT_COMMANDS:
                scripts += int(stats["calls"])
                usec += float(stats["usec"])
    return scripts, calls, usec


def default_listpack_of(client: redis.Redis) -> str:
    return str(client.config_get("hash-max-listpack-value")["hash-max-listpack-value"])


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


# Client processes ----------------------------------------------------------------------------------


def _cycle_worker(url: str, wid: int, keys: int, ready: Any, go: Any, deadline: Any, out: Connection) -> None:
    """acquire+release on ``keys`` distinct keys of its own, round robin, until ``deadline``."""
    leases = Leases.from_url(url, prefix=PREFIX)
    meta = meta_for(wid)
    names = [f"c{wid}:{i}" for i in range(keys)]
    for k in names[:10]:  # warm: scripts loaded, connection open
        lease = leases.try_acquire(k, TTL_MS, interval=INTERVAL_MS, meta=meta)
        assert isinstance(lease, Lease)
        leases.release(lease)
    ready.release()
    go.wait()
    end = deadline.value
    n = 0
    while time.time() < end:
        lease = leases.try_acquire(names[n % keys], TTL_MS, interval=INTERVAL_MS, meta=meta)
        assert isinstance(lease, Lease)
        leases.release(lease)
        n += 1
    out.send(n)


def _renew_worker(url: str, wid: int, keys: int, ready: Any, go: Any, deadline: Any, out: Connection) -> None:
    """Hold ``keys`` leases; renew them all with ``renew_many`` in rounds until ``deadline``."""
    leases = Leases.from_url(url, prefix=PREFIX)
    meta = meta_for(wid)
    held = []
    for i in range(keys):
        lease = leases.try_acquire(f"r{wid}:{i}", TTL_MS, interval=INTERVAL_MS, meta=meta)
        assert isinstance(lease, Lease)
        held.append(lease)
    leases.renew_many(held)  # warm
    ready.release()
    go.wait()
    end = deadline.value
    rounds = 0
    while time.time() < end:
        leases.renew_many(held)
        rounds += 1
    for lease in held:
        leases.release(lease)
    out.send(rounds * keys)


@dataclass
class Load:
    """One load point: processes, operations done, wall time, Redis CPU used."""

    processes: int
    ops: int
    seconds: float
    cpu: float
    #: Script execution time (``commandstats`` usec of EVALSHA): command work only, no I/O or event loop.
    exec_us: float

    @property
    def rate(self) -> float:
        return self.ops / self.seconds

    @property
    def cpu_us(self) -> float:
        """Redis CPU (user + sys, ``INFO cpu``) per operation, µs."""
        return 1e6 * self.cpu / self.ops

    @property
    def exec_us_each(self) -> float:
        return self.exec_us / self.ops

    @property
    def per_core(self) -> float:
        return 1e6 / self.cpu_us

    @property
    def busy(self) -> float:
        """Redis CPU use during the run, in cores (summed over masters)."""
        return self.cpu / self.seconds


@dataclass
class Window:
    """What the client processes reported and what the servers spent over one measured window."""

    seconds: float
    cpu: float
    commands: tuple[int, int, float]
    reports: list[Any]


def run_clients(
    admins: Sequence[redis.Redis],
    target: Callable[..., None],
    args: Callable[[int], tuple[Any, ...]],
    processes: int,
    seconds: float,
    ready_timeout: float = 120,
) -> Window:
    """Fork ``processes`` copies of ``target(*args(wid), ready, go, deadline, pipe)``, start them together and
    measure the servers' CPU and commands over ``seconds``; each copy sends one report down its pipe."""
    ctx = mp.get_context("fork")
    ready, go = ctx.Semaphore(0), ctx.Event()
    deadline = ctx.Value("d", 0.0)
    pipes, procs = [], []
    for wid in range(processes):
        rx, tx = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(*args(wid), ready, go, deadline, tx), daemon=True)
        p.start()
        pipes.append(rx)
        procs.append(p)
    for _ in range(processes):
        if not ready.acquire(timeout=ready_timeout):
            raise RuntimeError("a client process did not get ready")
    cpu0, commands0, t0 = redis_cpu(admins), redis_commands(admins), time.time()
    deadline.value = t0 + seconds
    go.set()
    time.sleep(max(0.0, deadline.value - time.time()))  # the measured window itself, not a wait for an event
    cpu1, commands1, t1 = redis_cpu(admins), redis_commands(admins), time.time()
    reports = [rx.recv() for rx in pipes]
    for p in procs:
        p.join(30)
    delta = (commands1[0] - commands0[0], commands1[1] - commands0[1], commands1[2] - commands0[2])
    return Window(t1 - t0, cpu1 - cpu0, delta, reports)


def drive(
    url: str, admins: Sequence[redis.Redis], target: Callable[..., None], processes: int, keys: int, seconds: float
) -> Load:
    """Run ``processes`` copies of ``target``; count their operations and the servers' CPU over ``seconds``."""
    w = run_clients(admins, target, lambda wid: (url, wid, keys), processes, seconds)
    return Load(processes, sum(w.reports), w.seconds, w.cpu, w.commands[2])


def load_table(rows: Sequence[Load], what: str) -> str:
    return table(
        [
            "client processes",
            f"{what}/s",
            "Redis CPU (cores busy)",
            "Redis CPU µs each (INFO cpu)",
            "script execution µs each (commandstats)",
            f"{what}/s per Redis core (from CPU)",
        ],
        [[r.processes, r.rate, r.busy, r.cpu_us, r.exec_us_each, r.per_core] for r in rows],
    )


# Memory ------------------------------------------------------------------------------------------------


def memory(url: str, admin: redis.Redis, n: int) -> dict[str, float]:
    """used_memory per held lease, per fence counter left after release (with and without retention), per waiter."""
    out: dict[str, float] = {}
    default_listpack = default_listpack_of(admin)
    variants = (
        ("", None, default_listpack),
        (" (fence_retention=1 h)", 3_600_000, default_listpack),
        (" (hash-max-listpack-value 256)", None, "256"),
    )
    for label, retention, listpack in variants:
        admin.flushall()
        admin.config_set("hash-max-listpack-value", listpack)
        leases = Leases.from_url(url, prefix=PREFIX, fence_retention=retention)
        warm = leases.try_acquire("warm", TTL_MS, interval=INTERVAL_MS, meta=meta_for(0))
        assert isinstance(warm, Lease)
        leases.release(warm)
        admin.delete(leases.fence_name("warm"))
        base = used_memory(admin)
        held = []
        for i in range(n):
            lease = leases.try_acquire(f"invoice:{i}", TTL_MS, interval=INTERVAL_MS, meta=meta_for(i))
            assert isinstance(lease, Lease)
            held.append(lease)
        out[f"held lease + its fence counter{label}"] = (used_memory(admin) - base) / n
        for lease in held:
            leases.release(lease)
        out[f"fence counter left after release{label}"] = (used_memory(admin) - base) / n
        leases.client.close()
    admin.config_set("hash-max-listpack-value", default_listpack)
    # The line: 100 held keys, n waiters spread over them (parked: they do not wait in place).
    admin.flushall()
    leases = Leases.from_url(url, prefix=PREFIX)
    keys = 100
    holders = []
    for k in range(keys):
        lease = leases.try_acquire(f"line:{k}", 600_000, interval=INTERVAL_MS, meta=meta_for(k))
        assert isinstance(lease, Lease)
        holders.append(lease)
    base = used_memory(admin)
    for i in range(n):
        busy = leases.line.join(
            f"line:{i % keys}",
            600_000,
            interval=INTERVAL_MS,
            meta=meta_for(i),
            waiter=f"5f0c6d2e-8a3b-4c1d-9e7f-{i:012d}.0",
            first_ms=0,
            may_wait=False,
        )
        assert not busy
    out[f"waiter in a line ({n:,} waiters on {keys} keys)"] = (used_memory(admin) - base) / n
    admin.flushall()
    leases.client.close()
    return out


# The fleet ------------------------------------------------------------------------------------------


@dataclass
class FleetProcess:
    """What one fleet process saw."""

    cycles: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    margins_s: list[float] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)
    renewals: int = 0
    lost: int = 0


def _fleet_worker(
    url: str, wid: int, held: int, rate: float, ready: Any, go: Any, deadline: Any, out: Connection
) -> None:
    """Hold ``held`` leases tracked by a real Heartbeat; acquire+release ``rate`` times a second meanwhile."""
    leases = Leases.from_url(url, prefix=PREFIX)
    seen = FleetProcess()
    lock = threading.Lock()
    original = leases.renew_many

    def renew_many(batch: Sequence[Lease], *, links: Sequence[object] = ()) -> list[Renewal]:
        # How much of the TTL is left on the server when the renewal lands, estimated from the client:
        # the last confirmed send + TTL (a lower bound: Redis set its expiry a little after the send).
        expiry = [lease.valid_until + lease.margin / 1000 for lease in batch]
        started = time.monotonic()
        result = original(batch, links=links)
        landed = time.monotonic()
        with lock:
            seen.rounds.append(landed - started)
            seen.renewals += len(batch)
            seen.margins_s.extend(e - landed for e in expiry)
        return result

    leases.renew_many = renew_many  # type: ignore[method-assign,assignment]
    heartbeat = Heartbeat(leases)

    def lost(lease: Lease, reason: LostReason) -> None:
        with lock:
            seen.lost += 1

    meta = meta_for(wid)
    mine = []
    for i in range(held):
        lease = leases.try_acquire(f"f{wid}:{i}", TTL_MS, interval=INTERVAL_MS, meta=meta_for(i))
        assert isinstance(lease, Lease)
        heartbeat.track(lease, lost)
        mine.append(lease)
    other = Leases.from_url(url, prefix=PREFIX)  # the job path: its own client, as worker threads have
    ready.release()
    go.wait()
    end = deadline.value
    with lock:  # the measured window starts now; leases acquired before go are set-up
        seen.margins_s.clear()
        seen.rounds.clear()
        seen.renewals = 0
    n = 0
    step = 1 / rate
    next_at = time.monotonic()
    while time.time() < end:
        t0 = time.perf_counter()
        lease = other.try_acquire(f"j{wid}:{n % 500}", TTL_MS, interval=INTERVAL_MS, meta=meta)
        seen.latencies_ms.append((time.perf_counter() - t0) * 1000)
        assert isinstance(lease, Lease)
        other.release(lease)
        n += 1
        next_at += step
        time.sleep(max(0.0, next_at - time.monotonic()))
    seen.cycles = n
    with lock:
        snapshot = FleetProcess(n, seen.latencies_ms, list(seen.margins_s), list(seen.rounds), seen.renewals, seen.lost)
    heartbeat.stop()
    out.send(snapshot)


@dataclass
class FleetResult:
    processes: int
    held: int
    seconds: float
    cpu: float
    scripts: int
    commands: int
    parts: list[FleetProcess]

    def row(self, where: str) -> list[Any]:
        lat = [x for p in self.parts for x in p.latencies_ms]
        margins = [x for p in self.parts for x in p.margins_s]
        rounds = [x for p in self.parts for x in p.rounds]
        renewals = sum(p.renewals for p in self.parts)
        cycles = sum(p.cycles for p in self.parts)
        return [
            where,
            f"{self.processes} x {self.held:,}",
            self.seconds,
            renewals / self.seconds,
            cycles / self.seconds,
            self.scripts / self.seconds,
            self.commands / self.seconds,
            self.cpu / self.seconds,
            percentile(lat, 50),
            percentile(lat, 99),
            max(rounds) * 1000 if rounds else None,
            min(margins) if margins else None,
            percentile(margins, 1),
            sum(p.lost for p in self.parts),
        ]


FLEET_HEADERS = [
    "Redis",
    "processes x held leases",
    "s",
    "renewals/s",
    "acquire+release/s",
    "EVALSHA/s",
    "commands/s (incl. in scripts)",
    "Redis CPU (cores)",
    "acquire p50 ms",
    "acquire p99 ms",
    "longest renewal round ms",
    "renewal margin min s",
    "renewal margin p1 s",
    "leases lost",
]


def fleet(
    url: str, admins: Sequence[redis.Redis], processes: int, held: int, rate: float, seconds: float
) -> FleetResult:
    w = run_clients(admins, _fleet_worker, lambda wid: (url, wid, held, rate), processes, seconds, ready_timeout=300)
    return FleetResult(processes, held, w.seconds, w.cpu, w.commands[0], w.commands[1], w.reports)


# Cluster --------------------------------------------------------------------------------------------------


def start_cluster() -> Any:
    """3 masters, no replicas, via tests/support/cluster.py (importable without pytest)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.support.cluster import RedisClusterNodes

    return RedisClusterNodes(masters=3, replicas=0).start()


# Report ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, under ~2 minutes")
    parser.add_argument("--no-cluster", action="store_true", help="skip the Redis Cluster sections")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    quick = args.quick
    secs = 3.0 if quick else 8.0
    cycle_points = (2, 4) if quick else (1, 2, 4, 8)
    renew_points = (2,) if quick else (1, 2, 4)
    fleet_secs = 12.0 if quick else 30.0
    fleet_procs, fleet_held, fleet_rate = 8, 1_250, 50.0
    mem_n = 10_000
    cmd = "python -m bench.capacity" + (" --quick" if quick else "")
    started = time.monotonic()
    load_before = load_average()
    out: list[str] = [f"# Capacity model ({'quick' if quick else 'full'} run)", ""]

    def say(line: str) -> None:
        out.append(line)
        print(line, file=sys.stderr, flush=True)  # progress; the report goes to stdout at the end

    cluster = None if args.no_cluster else start_cluster()
    try:
        masters = [redis.Redis(port=p, socket_timeout=60) for p in cluster.masters()] if cluster else []
        with EmbeddedRedis() as server:
            admin = redis.Redis(port=server.port, socket_timeout=60)
            info = machine_info(admin)
            say("Machine: " + " · ".join(f"{k} {v}" for k, v in info.items()))
            say(f"\nCommand: `{cmd}`. Load average (1 min) before: {load_before}.\n")
            url = server.url(0)

            say("## 1. Standalone Redis: CPU per operation\n")
            cycles = [drive(url, [admin], _cycle_worker, p, 1_000, secs) for p in cycle_points]
            admin.flushall()
            say(
                f"acquire+release cycles (`try_acquire` with the middleware's metadata, then `release`; distinct "
                f"keys; {secs:g} s per point):\n"
            )
            say(load_table(cycles, "cycles"))
            renews = [drive(url, [admin], _renew_worker, p, RENEW_N, secs) for p in renew_points]
            admin.flushall()
            say(f"\nHeartbeat renewals (`renew_many` rounds of N = {RENEW_N:,} leases per process):\n")
            say(load_table(renews, "renewals"))
            # The busiest point: Redis's fixed per-wakeup costs are spread over the most operations there.
            cyc = min(cycles, key=lambda r: r.cpu_us)
            ren = min(renews, key=lambda r: r.cpu_us)

            cluster_cycles: list[Load] = []
            cluster_renews: list[Load] = []
            if cluster:
                curl = cluster.url
                say("\n## 2. 3-master Redis Cluster (no replicas): CPU summed over the masters\n")
                cluster_cycles = [drive(curl, masters, _cycle_worker, p, 1_000, secs) for p in cycle_points]
                say("acquire+release cycles:\n")
                say(load_table(cluster_cycles, "cycles"))
                cluster_renews = [drive(curl, masters, _renew_worker, p, RENEW_N, secs) for p in renew_points]
                for m in masters:
                    m.flushall()
                say(
                    f"\nHeartbeat renewals (`renew_many` rounds of N = {RENEW_N:,}; keys spread over the slots, so "
                    "a round is one script call per slot):\n"
                )
                say(load_table(cluster_renews, "renewals"))
                best_c = max(cluster_cycles, key=lambda r: r.rate)
                best_s = max(cycles, key=lambda r: r.rate)
                say(
                    f"\nTotal cycles/s, 1 master vs 3 masters (best point each): {fmt(best_s.rate)} vs "
                    f"{fmt(best_c.rate)} ({best_c.rate / best_s.rate:.2f}x). On {info['nproc']} cores shared by "
                    "the clients and the servers the total cannot scale with the masters: CPU per operation is "
                    "the figure that does (each master carries its share of the slots)."
                )

            say("\n## 3. Memory (`INFO memory` used_memory deltas)\n")
            mem = memory(url, admin, mem_n)
            say(table(["what", "bytes each"], [[k, v] for k, v in mem.items()]))
            held_b = mem["held lease + its fence counter"]
            fence_b = mem["fence counter left after release"]
            fence_r = mem["fence counter left after release (fence_retention=1 h)"]
            lp = mem["held lease + its fence counter (hash-max-listpack-value 256)"]
            say(
                f"\nThe lease hash (10 fields; the metadata is one JSON field of ~170 bytes here) exceeds Redis's "
                f"default `hash-max-listpack-value` ({default_listpack_of(admin)} bytes), so Redis stores it as a "
                f"hashtable; with `hash-max-listpack-value 256` a held lease costs {fmt(lp)} B instead of "
                f"{fmt(held_b)} B. The waiter figure is a parked waiter joining a line by the line's `join`; "
                "the 100 holders' leases are in the baseline."
            )

            say(
                f"\n## 4. Simulated fleet: {fleet_procs} processes x {fleet_held:,} held leases "
                f"({fleet_procs * fleet_held:,} worker threads), TTL {TTL_MS // 1000} s, interval "
                f"{INTERVAL_MS // 1000} s, plus {fleet_rate:g} acquire+release/s per process; {fleet_secs:g} s\n"
            )
            fleets = [fleet(url, [admin], fleet_procs, fleet_held, fleet_rate, fleet_secs).row("standalone")]
            admin.flushall()
            admin.close()
        if cluster and not quick:
            fleets.append(
                fleet(cluster.url, masters, fleet_procs, fleet_held, fleet_rate, fleet_secs).row("3-master cluster")
            )
        for m in masters:
            m.close()
    finally:
        if cluster:
            cluster.close()
    say(table(FLEET_HEADERS, fleets))
    say(
        "\nRenewal margin: the TTL left on the server when a renewal's reply is back, estimated from the client "
        "(last confirmed send + TTL - reply time; a lower bound). `acquire` latency: the job path's `try_acquire` "
        "alone, in a process whose heartbeat thread shares the GIL."
    )

    say("\n## 5. On paper, from the figures above\n")
    iv = INTERVAL_MS // 1000
    say(
        f"Per-operation costs used (standalone, busiest point measured): acquire+release {cyc.cpu_us:.1f} µs of "
        f"Redis CPU ({cyc.exec_us_each:.1f} µs of it script execution); one renewal in a round of {RENEW_N:,} "
        f"{ren.cpu_us:.2f} µs ({ren.exec_us_each:.2f} µs script execution). The CPU figure is the honest one "
        "(it includes reading, parsing and replying); the execution figure is the floor a busier, better-batched "
        "server tends towards.\n"
    )
    workers = 1_000
    ren_s = workers / iv
    say(
        f"- Heartbeat load per {workers:,} workers each holding a lease: {workers:,} / {iv} s = {fmt(ren_s)} "
        f"renewals/s, costing {fmt(ren_s)} x {ren.cpu_us:.2f} µs = {ren_s * ren.cpu_us / 1000:.2f} ms of Redis CPU "
        f"per second ({ren_s * ren.cpu_us / 1e4:.3f} % of one core)."
    )
    say(
        f"- Workers one Redis core can carry on heartbeats alone at the default {iv} s interval: "
        f"1 s / {ren.cpu_us:.2f} µs = {fmt(1e6 / ren.cpu_us)} renewals/s x {iv} s = {fmt(1e7 / ren.cpu_us)} "
        "held leases (each process renews its own leases in one round, so this assumes rounds of ~1 000; "
        "a process with few leases pays the per-round cost for fewer, see the N=1 column of figure 2 in "
        "docs/benchmarks.md)."
    )
    for job_rate in (100.0, 1_000.0):
        say(
            f"- Acquire+release at {fmt(job_rate)} jobs/s: {fmt(job_rate)} x {cyc.cpu_us:.1f} µs = "
            f"{job_rate * cyc.cpu_us / 1e4:.1f} % of one core."
        )
    say(
        f"- One core carries 1 s / {cyc.cpu_us:.1f} µs = {fmt(1e6 / cyc.cpu_us)} acquire+release cycles/s with "
        f"nothing else (1 s / {cyc.exec_us_each:.1f} µs = {fmt(1e6 / cyc.exec_us_each)} on script execution alone). "
        f"A fleet of W worker threads running jobs of J s each makes W / J jobs/s: its core share is "
        f"(W / J) x {cyc.cpu_us:.1f} µs + (W / {iv}) x {ren.cpu_us:.2f} µs per second. E.g. W = 10 000, J = 10 s: "
        f"1 000 x {cyc.cpu_us:.1f} + 1 000 x {ren.cpu_us:.2f} = "
        f"{(1000 * cyc.cpu_us + 1000 * ren.cpu_us) / 1e4:.1f} % of one core: the job rate, not the heartbeat, "
        "dominates."
    )
    if cluster_renews:
        c_ren = min(cluster_renews, key=lambda r: r.cpu_us)
        c_cyc = min(cluster_cycles, key=lambda r: r.cpu_us)
        say(
            f"- On the cluster the Redis CPU per operation, summed over the masters, is {c_cyc.cpu_us:.1f} µs per "
            f"cycle ({c_cyc.cpu_us / cyc.cpu_us:.2f}x standalone) and {c_ren.cpu_us:.2f} µs per renewal "
            f"({c_ren.cpu_us / ren.cpu_us:.1f}x standalone: a round of {RENEW_N:,} leases on random keys is one "
            "script call per hash slot, ~1 000 calls, not one). Each master carries about a third of it, so "
            "3 masters give ~3x the cores for cycles; for heartbeats they give less than standalone (each lease "
            "key is its own hash tag, so leases on different keys land in different slots)."
        )
    million = 1_000_000
    say(
        f"- Memory for 1 M distinct keys: held at once, {fmt(held_b)} B x 1 M = {held_b * million / 2**20:,.0f} MiB; "
        f"once released, the fence counters left without `fence_retention_ms`: {fmt(fence_b)} B x 1 M = "
        f"{fence_b * million / 2**20:,.0f} MiB, kept for ever and growing with every new key. With "
        "`Leases(fence_retention=R)` a counter idle for R expires: the store holds only the keys used in the "
        f"last R, at {fmt(fence_r)} B each (the expiry adds an entry to the expires dict); e.g. 10 new keys/s "
        f"with R = 1 h: 36 000 counters, {36_000 * fence_r / 2**20:.1f} MiB, bounded."
    )

    seconds = time.monotonic() - started
    say(f"\nTotal {seconds:.0f} s; load average (1 min) before {load_before}, after {load_average()}.")
    print("\n".join(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
