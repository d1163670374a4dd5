"""Figure 1: one uncontended acquire+release, per library.

Two passes over the same lock objects:

1. counting: a few hundred cycles with the wire counter on and ``INFO
   commandstats`` read around them; these figures are exact, noise-free;
2. timing: the counters off, every library run in interleaved blocks (the
   order rotates each round), so drift from other work on the machine lands
   on all of them alike. Each cycle is timed alone (``perf_counter_ns``);
   the client's CPU time is taken per block (``process_time_ns``, which
   includes pottery's pool threads).
"""

from __future__ import annotations

import time
from typing import Any

from .common import Context, Counts, FigureResult, Goal, measure_commands, median, percentile, table
from .peers import CYCLE_PEERS, LOCK, OURS, OURS_HISTORY, PING, RAW, cleanup

#: Cycles per library in the counting pass.
COUNT_CYCLES = 200
#: Issue 11's goal: the median cycle within this factor of raw SET NX + Lua CAD.
GOAL_RATIO = 1.1


def run(ctx: Context) -> FigureResult:
    """Measure every library of :data:`CYCLE_PEERS`; return tables, goals and chart data."""
    rounds, block = (4, 250) if ctx.quick else (20, 500)
    client = ctx.client()
    cleanup(client)
    cycles = {p.name: p.make(client) for p in CYCLE_PEERS}
    for cycle in cycles.values():
        for _ in range(50):  # load scripts, open pool connections, fill caches
            cycle()

    counts: dict[str, Counts] = {}
    for name, cycle in cycles.items():
        with measure_commands(ctx.admin, ctx.wire) as out:
            for _ in range(COUNT_CYCLES):
                cycle()
        counts[name] = out[0].per(COUNT_CYCLES)

    samples: dict[str, list[float]] = {name: [] for name in cycles}
    cpu: dict[str, list[float]] = {name: [] for name in cycles}
    block_medians: dict[str, list[float]] = {name: [] for name in cycles}
    names = list(cycles)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cycle, buf = cycles[name], samples[name]
            cpu0 = time.process_time_ns()
            for _ in range(block):
                t0 = time.perf_counter_ns()
                cycle()
                buf.append((time.perf_counter_ns() - t0) / 1000)
            cpu[name].append((time.process_time_ns() - cpu0) / 1000 / block)
            block_medians[name].append(median(buf[-block:]))
    cleanup(client)
    client.close()

    stats: dict[str, dict[str, Any]] = {}
    for name in names:
        stats[name] = {
            "rtt": counts[name].rtt_each,
            "wire": counts[name].wire_each,
            "server": counts[name].server_each,
            "server_us": counts[name].server_us_each,
            "breakdown": counts[name].breakdown(),
            "median_us": median(samples[name]),
            "p99_us": percentile(samples[name], 99),
            "cpu_us": median(cpu[name]),
            "n": len(samples[name]),
        }
    raw, ping, ours = stats[RAW.name], stats[PING.name], stats[OURS.name]
    with_history = stats[OURS_HISTORY.name]
    rows = []
    for p in CYCLE_PEERS:
        s = stats[p.name]
        rows.append(
            [
                p.name,
                s["rtt"],
                s["wire"],
                s["server"],
                s["server_us"],
                s["median_us"],
                s["p99_us"],
                s["cpu_us"],
                s["median_us"] / raw["median_us"],
                s["p99_us"] / raw["p99_us"],
                s["median_us"] / ping["median_us"],
            ]
        )
    main = table(
        [
            "library",
            "round trips",
            "wire cmds",
            "server cmds",
            "server µs",
            "median µs",
            "p99 µs",
            "client CPU µs",
            "median / raw",
            "p99 / raw",
            "median / PING",
        ],
        rows,
    )
    detail = table(
        ["library", "server commands per cycle (commandstats, incl. inside Lua)", "what it does"],
        [[p.name, stats[p.name]["breakdown"], p.note] for p in CYCLE_PEERS],
    )

    # The same ratios round by round (each round times every library once, back to back): their spread
    # shows how far load from other work on the machine moved the pooled figure.
    def spread(other: str, ours_name: str = OURS.name) -> str:
        ratios = [a / b for a, b in zip(block_medians[ours_name], block_medians[other], strict=True)]
        return f"{percentile(ratios, 25):.2f}-{percentile(ratios, 75):.2f}x (IQR of {len(ratios)} rounds)"

    libraries = [p.name for p in CYCLE_PEERS if p not in (PING, RAW, OURS, OURS_HISTORY)]
    slower_peers = [n for n in libraries if stats[n]["median_us"] <= ours["median_us"]]
    ratio = ours["median_us"] / raw["median_us"]
    goals = [
        Goal("1", "2 round trips per acquire+release", f"{ours['rtt']:.2f}", abs(ours["rtt"] - 2) < 1e-9),
        Goal(
            "1",
            f"median within {GOAL_RATIO:g}x of raw SET NX + Lua CAD",
            f"{ratio:.2f}x (p99 {ours['p99_us'] / raw['p99_us']:.2f}x; per round {spread(RAW.name)})",
            ratio <= GOAL_RATIO,
        ),
        Goal(
            "1",
            "ahead of every peer library (median)",
            "ahead of all"
            if not slower_peers
            else "behind or equal: "
            + ", ".join(
                f"{n} ({stats[n]['median_us']:.0f} vs {ours['median_us']:.0f} µs; ours / it per round {spread(n)})"
                for n in slower_peers
            ),
            not slower_peers,
        ),
    ]
    notes = [
        f"{len(samples[OURS.name]):,} timed cycles per library ({rounds} rounds of {block}, order rotated per round).",
        f"Round by round, dramatiq-leases / raw: {spread(RAW.name)}; dramatiq-leases / redis-py Lock: "
        f"{spread(LOCK.name)}. The PING floor ({ping['median_us']:.0f} µs here) tells how fast this machine's "
        "loopback round trips were during the run; compare it before comparing times across runs.",
        "ConcurrentRateLimiter's release leaves its counter key at 0 (with the TTL), so the next acquire on "
        "the same key finds it, falls back to WATCH/GET/MULTI/SET/EXEC and costs 4 round trips instead of 1.",
        "python-redis-lock calls GET before SET NX (it refuses to re-acquire a lock it holds): 3 round trips.",
        f"The history of a key (opt-in, {OURS_HISTORY.name!r}): median "
        f"{with_history['median_us'] / ours['median_us']:.2f}x the cycle without it "
        f"(p99 {with_history['p99_us'] / ours['p99_us']:.2f}x; per round {spread(OURS.name, OURS_HISTORY.name)}), "
        f"{with_history['server'] - ours['server']:.0f} more server commands per cycle inside the same "
        f"{with_history['rtt']:.0f} round trips; without it, the scripts make no extra call.",
    ]
    return FigureResult(
        key="fig1",
        title="1. Uncontended acquire + release",
        method=__doc__ or "",
        tables=[main, detail],
        goals=goals,
        notes=notes,
        data={"stats": stats, "order": names},
    )
