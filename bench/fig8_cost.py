"""Figure 8: what a lease costs the lease store (server time per cycle, each option's own) and a worker thread
(round trips per job).

Server time is the store's own ``INFO commandstats`` (usec of every command, those run inside scripts too),
read before and after a block of cycles, as ``../shared/tools/lease_cost.py`` measures it from outside. Rows
run in interleaved blocks, the order rotating each round; each row's figure is its median over the rounds,
and its ratio to the raw lock's is taken per round. Round trips: one worker thread runs no-op jobs while the
store's every reply is held ``DELAY`` s by a proxy; the extra wall time per job over a job without a lease,
divided by ``DELAY``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import socket
import statistics
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import redis

from dramatiq_leases import Lease, Leases
from dramatiq_leases.core.unique import UniqueRecords
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from . import baseline
from .common import Context, FigureResult, Goal, fmt, table
from .workers import LOG_DIR, ROOT, dramatiq_cli

#: How long the proxy holds each reply of the lease store (s).
DELAY = 0.010
#: The commit before issue 28 (the lean path): its plain lease, measured beside today's.
BEFORE = "0e3bb5c"
TTL = 60_000

Cycle = Callable[[int], None]


def server_usec(client: redis.Redis) -> tuple[float, int]:
    """The server's total command time (usec) and calls so far, ``INFO`` and ``CONFIG`` left out."""
    usec, calls = 0.0, 0
    for name, stat in client.info("commandstats").items():
        if not name.startswith(("cmdstat_info", "cmdstat_config")):
            usec += float(stat["usec"])
            calls += int(stat["calls"])
    return usec, calls


def _rows(url: str, replica_url: str | None) -> dict[str, Callable[[str], Cycle]]:
    """Each row's cycle maker: ``make(prefix)`` returns ``cycle(i)``, one acquire+release of a fresh key."""
    client = redis.Redis.from_url(url)
    cad = client.register_script("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end")

    def raw(prefix: str) -> Cycle:
        def cycle(i: int) -> None:
            client.set(f"{prefix}:{i}", "token", nx=True, px=TTL)
            cad(keys=[f"{prefix}:{i}"], args=["token"])

        return cycle

    def redis_py(prefix: str) -> Cycle:
        def cycle(i: int) -> None:
            lock = client.lock(f"{prefix}:{i}", timeout=TTL / 1000)
            lock.acquire(blocking=False)
            lock.release()

        return cycle

    def lease(store: Any, **options: Any) -> Callable[[str], Cycle]:
        def make(prefix: str) -> Cycle:
            def cycle(i: int) -> None:
                got = store.try_acquire(f"{prefix}:{i}", TTL, **options)
                assert got, got  # a Lease (Busy is falsy), of today's core or the one before
                store.release(got)

            return cycle

        return make

    def unique(prefix: str) -> Cycle:
        store = Leases(client, prefix="cost-unique")
        records = UniqueRecords(store)

        def cycle(i: int) -> None:  # a unique message: its record at the send, ended by its grant
            key, mid = f"{prefix}:{i}", f"m{i}"
            records.take(key, mid, mode="queued", grace=TTL)
            got = store.line.join(key, TTL, waiter=f"{mid}:0", unique=True)
            assert isinstance(got, Lease), got
            store.release(got)

        return cycle

    # The floor of any fenced lease with a fair line: a fence counter's INCR and SET NX PX at the grant (the line
    # checked), owner-checked DEL at the release; no argument checks, no server time, no release record.
    floor_grant = client.register_script(
        "if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end "
        "if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end "
        "return redis.call('INCR', KEYS[2])"
    )
    floor_release = client.register_script(
        "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end redis.call('DEL', KEYS[1]) "
        "return redis.call('EXISTS', KEYS[3]) + 1"
    )

    def floor(prefix: str) -> Cycle:
        def cycle(i: int) -> None:
            names = [f"{prefix}:lease:{{{i}}}", f"{prefix}:fence:{{{i}}}", f"{prefix}:line:{{{i}}}"]
            assert floor_grant(keys=names, args=["token", TTL]) > 0
            floor_release(keys=names, args=["token"])

        return cycle

    general = Leases(client, prefix="cost-general")
    general.grants.plain = False  # the general scripts alone: what the plain ones save
    rows: dict[str, Callable[[str], Cycle]] = {
        "raw SET NX PX + Lua CAD": raw,
        "redis-py Lock": redis_py,
        "floor: INCR + SET NX, CAD (no records)": floor,
        "plain lease": lease(Leases(client, prefix="cost")),
        "plain lease, no failover grace": lease(Leases(client, prefix="cost-nograce", failover_grace=0)),
        "plain lease, general scripts only": lease(general),
    }
    with contextlib.suppress(RuntimeError):  # no git checkout: the row is left out
        rows[f"plain lease at {BEFORE} (before)"] = lease(baseline.core_at(BEFORE).Leases(client, prefix="cost-old"))
    rows["lock_limit=4"] = lease(Leases(client, prefix="cost-limit"), limit=4)
    rows["lock_unique"] = unique
    rows["history=50"] = lease(Leases(client, prefix="cost-history", history=50))
    rows["fence_retention"] = lease(Leases(client, prefix="cost-retention", fence_retention=600_000))
    if replica_url is not None:
        rows["min_replicas=1"] = lease(Leases(client, prefix="cost-replicas", min_replicas=1))
    return rows


def core_costs(url: str, replica_url: str | None, cycles: int, rounds: int) -> dict[str, dict[str, float]]:
    """Per row: median server usec per cycle, its ratio to raw (median of the per-round ratios), calls per cycle."""
    admin = redis.Redis.from_url(url)
    makers = _rows(url, replica_url)
    names = list(makers)
    usec: dict[str, list[float]] = {n: [] for n in names}
    calls: dict[str, float] = {}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cycle = makers[name](f"c{r}:{names.index(name)}")
            for i in range(20):
                cycle(10**6 + i)  # warm: scripts loaded, connections open
            before = server_usec(admin)
            for i in range(cycles):
                cycle(i)
            after = server_usec(admin)
            usec[name].append((after[0] - before[0]) / cycles)
            calls[name] = (after[1] - before[1]) / cycles
    raw = usec[names[0]]
    return {
        n: {
            "us": statistics.median(usec[n]),
            "x_raw": statistics.median(u / b for u, b in zip(usec[n], raw, strict=True)),
            "calls": calls[n],
        }
        for n in names
    }


@contextlib.contextmanager
def _worker(broker_url: str, leases_url: str, threads: int) -> Iterator[Any]:
    log_url = broker_url.rsplit("/", 1)[0] + "/2"
    """``dramatiq bench.cost_app`` in a subprocess; yields the app module, imported here to send with."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "COST_BROKER_URL": broker_url,
        "COST_LEASES_URL": leases_url,
        "COST_LOG_URL": log_url,
        "DRAMATIQ_LEASES_METRICS_PORT": str(free_port()),
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    LOG_DIR.mkdir(exist_ok=True)
    with open(LOG_DIR / "cost-worker.log", "ab") as log:
        proc = subprocess.Popen(
            [*dramatiq_cli(), "bench.cost_app", "--processes", "1", "--threads", str(threads)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    saved = {k: os.environ.get(k) for k in ("COST_BROKER_URL", "COST_LEASES_URL", "COST_LOG_URL")}
    os.environ.update(COST_BROKER_URL=broker_url, COST_LEASES_URL=leases_url, COST_LOG_URL=log_url)
    try:
        # Configured by the environment just set (a reload when imported before): sends go to this broker.
        yield importlib.reload(importlib.import_module("bench.cost_app"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_jobs(app: Any, log: redis.Redis, actor: str, jobs: int, timeout: float = 300.0) -> list[float]:
    """Send ``jobs`` messages to ``actor`` and wait until each logged its end; their end times, sorted."""
    log.delete(app.DONE_KEY)
    for i in range(jobs):
        getattr(app, actor).send(i)
    deadline = time.monotonic() + timeout
    while log.llen(app.DONE_KEY) < jobs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"figure 8: {jobs} {actor} jobs did not end within {timeout} s")
        time.sleep(0.02)
    return sorted(float(x.split()[1]) for x in log.lrange(app.DONE_KEY, 0, -1))


def middleware_cost(jobs: int) -> float:
    """The lease store's server usec per no-op leased job, through a real worker (4 threads)."""
    with EmbeddedRedis() as broker, EmbeddedRedis() as store:
        admin = redis.Redis(port=store.port)
        log = redis.Redis(port=broker.port, db=2)
        with _worker(broker.url(0), store.url(1), 4) as app:
            _run_jobs(app, log, "leased", 40)  # warm
            before = server_usec(admin)
            _run_jobs(app, log, "leased", jobs)
            time.sleep(0.5)  # the last releases (sent off the worker threads)
            after = server_usec(admin)
    return (after[0] - before[0]) / jobs


def _proxy(listen: socket.socket, port: int, delay: float) -> None:
    """Pass bytes both ways between clients and 127.0.0.1:``port``; hold each server reply ``delay`` s."""

    def pump(client: socket.socket, upstream: socket.socket) -> None:
        backlog: deque[tuple[float, bytes]] = deque()
        try:
            while True:
                now = time.monotonic()
                while backlog and backlog[0][0] <= now:
                    client.sendall(backlog.popleft()[1])
                ready, _, _ = select.select([client, upstream], [], [], 0.001 if backlog else 0.05)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is client:
                        upstream.sendall(data)
                    else:
                        backlog.append((time.monotonic() + delay, data))
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    while True:
        try:
            client, _ = listen.accept()
        except OSError:
            return
        upstream = socket.create_connection(("127.0.0.1", port))
        threading.Thread(target=pump, args=(client, upstream), daemon=True).start()


def round_trips(jobs: int) -> dict[str, float]:
    """Lease store round trips a worker thread waits for per job: ``leased`` and ``by_hand`` (redis-py Lock)."""
    with EmbeddedRedis() as broker, EmbeddedRedis() as store, socket.socket() as listen:
        listen.bind(("127.0.0.1", 0))
        listen.listen(128)
        threading.Thread(target=_proxy, args=(listen, store.port, DELAY), daemon=True).start()
        log = redis.Redis(port=broker.port, db=2)
        per_job: dict[str, list[float]] = {"leased": [], "plain": [], "by_hand": []}
        with _worker(broker.url(0), f"redis://127.0.0.1:{listen.getsockname()[1]}/0", 1) as app:
            for actor in per_job:
                _run_jobs(app, log, actor, 5)  # warm
            for _ in range(2):
                for actor in per_job:
                    times = _run_jobs(app, log, actor, jobs)
                    per_job[actor].append((times[-1] - times[0]) / (jobs - 1))
    plain = min(per_job["plain"])
    return {actor: (min(t) - plain) / DELAY for actor, t in per_job.items() if actor != "plain"}


def run(ctx: Context) -> FigureResult:
    """Measure the rows of :func:`core_costs`, the middleware's cost per job and the round trips."""
    cycles, rounds, jobs, rt_jobs = (100, 2, 100, 15) if ctx.quick else (500, 7, 600, 60)
    with EmbeddedRedis() as primary, EmbeddedRedis() as replica:
        redis.Redis(port=replica.port).replicaof("127.0.0.1", primary.port)
        _wait_in_sync(redis.Redis(port=primary.port))
        core = core_costs(primary.url(0), replica.url(0), cycles, rounds)
    per_job = middleware_cost(jobs)
    trips = round_trips(rt_jobs)
    raw = core["raw SET NX PX + Lua CAD"]
    plain = core["plain lease"]
    rows = [[name, fmt(c["us"]), f"{c['x_raw']:.2f}x", fmt(c["calls"])] for name, c in core.items()]
    rows.append(
        ["no-op job through LeaseMiddleware (lease store only)", fmt(per_job), f"{per_job / raw['us']:.2f}x", ""]
    )
    tables = [
        table(["per acquire + release", "server µs (median)", "/ raw (median per round)", "commands"], rows),
        table(
            ["per job, one worker thread, replies held 10 ms", "lease round trips waited for"],
            [
                ["lock_key (LeaseMiddleware)", f"{trips['leased']:.2f}"],
                ["redis-py Lock by hand", f"{trips['by_hand']:.2f}"],
            ],
        ),
    ]
    goals = [
        Goal(
            "8",
            "plain lease, core: server time per acquire+release at most 20 µs",
            f"{plain['us']:.1f} µs",
            plain["us"] <= 20,
        ),
        Goal("8", "plain lease, core: at most 2x raw in the same run", f"{plain['x_raw']:.2f}x", plain["x_raw"] <= 2),
        Goal(
            "8",
            "no-op job through the middleware: at most 25 µs of the lease store",
            f"{per_job:.1f} µs",
            per_job <= 25,
        ),
        Goal(
            "8",
            "lease round trips a worker thread waits for per job at most 1.1",
            f"{trips['leased']:.2f} (redis-py Lock by hand: {trips['by_hand']:.2f})",
            trips["leased"] <= 1.1,
        ),
    ]
    notes = [
        f"{cycles} cycles per row per round, {rounds} rounds; server µs count the commands run inside scripts too "
        "(as INFO commandstats does), as ../shared/tools/lease_cost.py does.",
        "Each option's row adds only its own commands to the plain lease's (tests/test_protocol.py pins them).",
        "The floor row is the least any fenced lease with a fair line costs in two scripts (a counter's INCR and "
        "SET NX PX after a look at the line; GET, DEL, the line's EXISTS), with none of the promises' records "
        "(no argument checks, server time, expiry and release records, holder metadata): the 20 µs and 2x goals "
        "are measured against it.",
    ]
    return FigureResult(
        key="fig8",
        title="8. What a lease costs: the lease store's time, each option's, and a worker's round trips",
        method=__doc__ or "",
        tables=tables,
        goals=goals,
        notes=notes,
        data={"core": core, "per_job_us": per_job, "round_trips": trips},
    )


def _wait_in_sync(primary: redis.Redis, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        primary.incr("bench:cost-sync")
        if int(primary.execute_command("WAIT", 1, 100)) >= 1:
            return
    raise RuntimeError("figure 8: the replica did not catch up")
