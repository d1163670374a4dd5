"""Figure 7: N holders per key (``lock_limit``): the uncontended cycle against the code before, and K jobs on N slots.

Part 1, the cycle of figure 1 at ``lock_limit=1`` against the core as it was
before N holders (commit ``0b342a6``, imported beside today's by
:mod:`bench.baseline`: its own Python and its own scripts), both against raw
``SET NX`` + Lua CAD in the same process: interleaved blocks, the order
rotated each round, so each round gives an old / raw and a new / raw ratio
measured back to back. Today's cycle at ``limit=4`` (one holder, so
uncontended too) is shown beside them. Commands are counted as in figure 1.

Part 2, K = 100 ``hold_limit`` jobs of 100 ms on one key of N = 4 slots,
sent at once to real workers (2 processes x 8 threads, Redis broker):
ours with ``lock_limit=4`` and LeaseMiddleware's defaults, and as the peer
Dramatiq's ``ConcurrentRateLimiter(limit=4)`` raising ``RateLimitExceeded``
when full so that Retries backs off (50 ms..2 s, as figure 6). From the
jobs' log and the enqueue counter of figure 6: the makespan over
K x job / N, enqueues per message (the send, each park or retry, each
return), the handoffs (the i-th release to the (N+i)-th grant: the grant
that release made room for), the moments more than N jobs ran at once, and
where the makespan beyond K x job / N went: the slots' idle time (over N)
before their first grant, between a release and the grant it made room for,
and after their last job (the three add up to it exactly).
``python -m bench.limit_trace`` runs part 2 with a trace of every enqueue and
delivery, to see how each grant was served.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dramatiq_leases import Leases

from .baseline import core_at
from .common import Context, Counts, FigureResult, Goal, measure_commands, median, percentile, table
from .defaults import DEFAULT_BACKOFF
from .enqueues import enqueue_counts
from .holds import HoldRun
from .limit_names import HOLD_LIMIT_ACTOR, TRACE_KEY
from .names import HOLD_QUEUE
from .peers import RAW, cleanup, leases_cycle
from .workers import WorkerGroup, producer, reset_broker, send, wait_log_length, wait_ready

#: The commit before N holders per key: the code part 1 compares against.
BEFORE = "0b342a6"
#: Cycles per variant in the counting pass.
COUNT_CYCLES = 200
#: Part 1's goal: today's ratio to raw no higher than the old one's, within this share of the old one (the
#: run-to-run noise of a ratio on this machine is a few %, see the spread reported beside it).
NOISE = 0.02

#: Part 2: jobs, their length (ms), the key's holders.
K, JOB_MS, LIMIT = 100, 100, 4
GOAL_RATIO = 1.1
GOAL_ENQUEUES = 3.0
#: Retries' ``max_retries`` for the peer (as figure 6): every full attempt is a retry; none may drop a job.
CRL_MAX_RETRIES = 10_000

OLD, NEW, NEW4 = f"dramatiq-leases at {BEFORE} (before)", "dramatiq-leases, limit=1", "dramatiq-leases, limit=4"
MODES = {"leases": "dramatiq-leases, lock_limit=4", "crl": "ConcurrentRateLimiter(limit=4) + Retries"}


# Part 1: the uncontended cycle -------------------------------------------------------------------


def _cycle_part(ctx: Context) -> dict[str, Any]:
    rounds, block = (4, 250) if ctx.quick else (20, 500)
    client = ctx.client()
    cleanup(client)
    makers = {
        RAW.name: RAW.make,
        OLD: leases_cycle(core_at(BEFORE).Leases, "bench:limit:old"),
        NEW: leases_cycle(Leases, "bench:limit:new"),
        NEW4: leases_cycle(Leases, "bench:limit:new4", limit=LIMIT),
    }
    cycles = {name: make(client) for name, make in makers.items()}
    for cycle in cycles.values():
        for _ in range(50):  # load scripts, open connections
            cycle()
    counts: dict[str, Counts] = {}
    for name, cycle in cycles.items():
        with measure_commands(ctx.admin, ctx.wire) as out:
            for _ in range(COUNT_CYCLES):
                cycle()
        counts[name] = out[0].per(COUNT_CYCLES)

    samples: dict[str, list[float]] = {name: [] for name in cycles}
    block_medians: dict[str, list[float]] = {name: [] for name in cycles}
    names = list(cycles)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cycle, buf = cycles[name], samples[name]
            for _ in range(block):
                t0 = time.perf_counter_ns()
                cycle()
                buf.append((time.perf_counter_ns() - t0) / 1000)
            block_medians[name].append(median(buf[-block:]))
    cleanup(client)
    client.close()
    raw = block_medians[RAW.name]
    per_round = {
        name: [a / b for a, b in zip(block_medians[name], raw, strict=True)] for name in names if name != RAW.name
    }
    per_round["new / old"] = [a / b for a, b in zip(block_medians[NEW], block_medians[OLD], strict=True)]
    return {
        "rounds": rounds,
        "block": block,
        "stats": {
            name: {
                "rtt": counts[name].rtt_each,
                "server": counts[name].server_each,
                "server_us": counts[name].server_us_each,
                "breakdown": counts[name].breakdown(limit=12),
                "median_us": median(samples[name]),
                "p99_us": percentile(samples[name], 99),
            }
            for name in names
        },
        "per_round": per_round,
    }


def _spread(ratios: list[float]) -> str:
    """``1.24 (IQR 1.20-1.29, range 1.15-1.40)``: a per-round ratio's median and spread."""
    return (
        f"{median(ratios):.3f} (IQR {percentile(ratios, 25):.3f}-{percentile(ratios, 75):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f})"
    )


# Part 2: K jobs on N slots -----------------------------------------------------------------------


class _Workers(WorkerGroup):
    """Figure 6's workers with figure 7's actor module (:mod:`bench.limit_app`) loaded after ``bench.app``."""

    def __init__(self, url: str, env: dict[str, str], *, name: str) -> None:
        super().__init__(url, env, processes=2, threads=8, name=name)
        self.args.insert(self.args.index("bench.app") + 1, "bench.limit_app")


@dataclass
class LineRun:
    """One run of part 2: the jobs' log and enqueues (:class:`HoldRun`) read with N slots in mind."""

    mode: str
    hold: HoldRun
    limit: int
    #: The workers' trace events (``BENCH_TRACE=1``, see :mod:`bench.limit_app`); empty otherwise.
    trace: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ideal(self) -> float:
        """K x job / N (s): every slot busy from the first send to the last end."""
        return self.hold.ideal / self.limit

    @property
    def handoffs_ms(self) -> list[float]:
        """From the i-th end to the (N+i)-th start (ms): the grant each release made room for."""
        ends = sorted(r["end"] for r in self.hold.done)
        starts = [r["start"] for r in self.hold.done]  # done is sorted by start
        return [(s - e) * 1000 for e, s in zip(ends, starts[self.limit :], strict=False)]

    def concurrency(self) -> tuple[int, int]:
        """The most jobs running at once, and how many starts found more than N running (themselves included)."""
        events = sorted([(r["start"], 1) for r in self.hold.done] + [(r["end"], -1) for r in self.hold.done])
        running = peak = over = 0
        for _, step in events:  # at a tie, the end (-1) sorts first: a slot freed and retaken is no overlap
            running += step
            peak = max(peak, running)
            over += step > 0 and running > self.limit
        return peak, over

    def excess_ms(self) -> dict[str, float]:
        """Where the makespan beyond K x job / N went (ms of makespan; slot time / N), the three adding up.

        ``first``: from the first send to the first N grants (the slots idle before their first holder);
        ``handoffs``: the slots idle between a release and the grant it made room for; ``tail``: the slots
        idle after their last job, until the last job ends.
        """
        done, n = self.hold.done, self.limit
        if len(done) < n:
            return {"first": math.nan, "handoffs": math.nan, "tail": math.nan}
        last = max(r["end"] for r in done)
        ends = sorted(r["end"] for r in done)
        first = sum(r["start"] - self.hold.t0 for r in done[:n])
        tail = sum(last - e for e in ends[len(ends) - n :])
        handoffs = sum(self.handoffs_ms) / 1000
        return {"first": 1000 * first / n, "handoffs": 1000 * handoffs / n, "tail": 1000 * tail / n}


def _env(mode: str) -> dict[str, str]:
    env = {"BENCH_MODE": mode, "BENCH_LIMIT": str(LIMIT), "BENCH_COUNT_ENQUEUES": "1"}
    if mode == "crl":
        env |= {
            "BENCH_BACKOFF_MIN": str(DEFAULT_BACKOFF[0]),
            "BENCH_BACKOFF_MAX": str(DEFAULT_BACKOFF[1]),
            "BENCH_MAX_RETRIES": str(CRL_MAX_RETRIES),
        }
    return env


def line_run(ctx: Context, mode: str, k: int, env: Mapping[str, str] | None = None) -> LineRun:
    """Start the workers, send K jobs at once once both processes poll, wait for them (bounded).

    ``env``: more settings for the workers (``BENCH_TRACE=1`` to keep a trace, ``dramatiq_*`` ones).
    """
    ideal = k * JOB_MS / 1000 / LIMIT
    timeout = (1.5 * ideal if mode == "leases" else 10 * ideal) + (15 if ctx.quick else 30)
    client = ctx.client()
    reset_broker(client)
    cleanup(client)
    with _Workers(ctx.url, {**_env(mode), **(env or {})}, name=f"fig7-{mode}") as group:
        wait_ready(client, 2, group=group)
        broker = producer(ctx.url, count_enqueues=True)
        t0 = time.time()
        sent = [send(broker, HOLD_QUEUE, HOLD_LIMIT_ACTOR, "limit", JOB_MS) for _ in range(k)]
        records = wait_log_length(client, 2 * k, timeout)  # each job logs its start, then its end
        broker.close()
    enqueues = enqueue_counts(client)
    trace = [json.loads(raw) for raw in client.lrange(TRACE_KEY, 0, -1)]
    cleanup(client)
    client.close()
    done = sorted((r for r in records if r["end"]), key=lambda r: r["start"])
    hold = HoldRun(k=k, job_ms=JOB_MS, t0=t0, sent=sent, done=done, enqueues=enqueues)
    return LineRun(mode, hold, LIMIT, trace)


def _line_summary(run: LineRun) -> dict[str, Any]:
    handoffs, enqueues = run.handoffs_ms, run.hold.enqueues_per_message
    peak, over = run.concurrency()
    return {
        "completed": run.hold.completed,
        "extra_runs": run.hold.extra_runs,
        "makespan": run.hold.makespan,
        "ratio": run.hold.makespan / run.ideal,
        "first_start_ms": run.hold.first_start * 1000,
        "enqueues_mean": sum(enqueues) / len(enqueues),
        "enqueues_max": max(enqueues),
        "handoff_p50": percentile(handoffs, 50),
        "handoff_p99": percentile(handoffs, 99),
        "handoff_max": max(handoffs, default=float("nan")),
        "peak": peak,
        "over": over,
        "excess": run.excess_ms(),
    }


# The figure ----------------------------------------------------------------------------------------


def run(ctx: Context) -> FigureResult:
    """Part 1, then part 2: ours three times (its run-to-run spread), the peer once."""
    cycle = _cycle_part(ctx)
    k = 40 if ctx.quick else K
    plan = ["leases", "crl"] if ctx.quick else ["leases", "crl", "leases", "leases"]
    line: list[tuple[str, dict[str, Any]]] = [(mode, _line_summary(line_run(ctx, mode, k))) for mode in plan]
    return FigureResult(
        key="fig7",
        title=f"7. N holders per key: the cycle at lock_limit=1, and {k} jobs on {LIMIT} slots",
        method=__doc__ or "",
        tables=[_cycle_table(cycle), _line_table(line, k)],
        goals=_goals(cycle, line, k),
        notes=_notes(cycle, k),
        data={
            "cycle": cycle,
            "line": [{"mode": m, "k": k, **v} for m, v in line],
            "goal_ratio": GOAL_RATIO,
            "limit": LIMIT,
            "job_ms": JOB_MS,
        },
    )


def _cycle_table(cycle: dict[str, Any]) -> str:
    stats, per_round = cycle["stats"], cycle["per_round"]
    rows = []
    for name, s in stats.items():
        ratios = per_round.get(name)
        rows.append(
            [
                name,
                s["rtt"],
                s["server"],
                s["server_us"],
                s["median_us"],
                s["p99_us"],
                "1" if ratios is None else _spread(ratios),
                s["breakdown"],
            ]
        )
    return table(
        [
            "cycle",
            "round trips",
            "server cmds",
            "server µs",
            "median µs",
            "p99 µs",
            "per round / raw: median (IQR, range)",
            "server commands per cycle",
        ],
        rows,
    )


def _line_table(line: list[tuple[str, dict[str, Any]]], k: int) -> str:
    rows = [
        [
            MODES[mode],
            f"{v['completed']}/{k}",
            v["makespan"],
            v["ratio"],
            v["enqueues_mean"],
            v["enqueues_max"],
            v["handoff_p50"],
            v["handoff_p99"],
            v["handoff_max"],
            v["first_start_ms"],
            f"{v['excess']['first']:.0f} + {v['excess']['handoffs']:.0f} + {v['excess']['tail']:.0f}",
            v["peak"],
            v["over"],
        ]
        for mode, v in line
    ]
    return table(
        [
            "mode",
            "jobs done",
            "makespan s",
            "x (K x job / N)",
            "enqueues / msg",
            "max",
            "handoff p50 ms",
            "p99 ms",
            "max ms",
            "first start ms",
            "beyond K x job / N: first + handoffs + tail ms",
            "most at once",
            "starts over N",
        ],
        rows,
    )


def _goals(cycle: dict[str, Any], line: list[tuple[str, dict[str, Any]]], k: int) -> list[Goal]:
    per_round = cycle["per_round"]
    old, new = median(per_round[OLD]), median(per_round[NEW])
    ours = [v for mode, v in line if mode == "leases"]
    runs = f"{len(ours)} run{'s' if len(ours) > 1 else ''}"

    def each(measure: str) -> str:
        return ", ".join(measure.format(**v) for v in ours)

    return [
        Goal(
            "7",
            f"at lock_limit=1, the cycle no slower than at {BEFORE} relative to raw SET NX + Lua CAD "
            f"(within {100 * NOISE:g}%)",
            f"new / raw {_spread(per_round[NEW])} vs old / raw {_spread(per_round[OLD])}; "
            f"new / old per round {_spread(per_round['new / old'])}",
            new <= old * (1 + NOISE),
        ),
        Goal(
            "7",
            f"K={k} x {JOB_MS} ms on {LIMIT} slots: makespan within {GOAL_RATIO}x of K x job / N ({runs})",
            each("{ratio:.3f}x"),
            all(v["ratio"] <= GOAL_RATIO and v["completed"] == k for v in ours),
        ),
        Goal(
            "7",
            f"at most {GOAL_ENQUEUES:g} enqueues per message on average (the send included)",
            each("{enqueues_mean:.2f}"),
            all(v["enqueues_mean"] <= GOAL_ENQUEUES for v in ours),
        ),
        Goal(
            "7",
            f"never more than {LIMIT} running at once, no job run twice (ours and the peer)",
            "; ".join(
                f"{MODES[m]}: {sum(v['over'] for mm, v in line if mm == m)} starts over {LIMIT}, "
                f"{sum(v['extra_runs'] for mm, v in line if mm == m)} extra runs"
                for m in dict.fromkeys(mode for mode, _ in line)
            ),
            all(v["over"] == 0 and v["extra_runs"] == 0 for _, v in line),
        ),
    ]


def _notes(cycle: dict[str, Any], k: int) -> list[str]:
    return [
        f"Part 1: {cycle['rounds']} rounds of {cycle['block']} timed cycles per variant, order rotated per round; "
        "each ratio is one round's median over raw's median in the same round. The old core runs its own "
        f"scripts (its ACQUIRE and RELEASE of {BEFORE}) and its own Python, with today's tracer.",
        f"Part 2: fresh workers per run (2 processes x 8 threads), {k} messages sent at once once both processes "
        "poll the broker; one key for all. Ours three times (its spread run to run), the peer once; rows in "
        "the order they ran.",
        f"The peer: Retries' backoff {DEFAULT_BACKOFF[0]} ms..{DEFAULT_BACKOFF[1] / 1000:g} s and "
        f"max_retries={CRL_MAX_RETRIES:,}; each retry is an enqueue (and so is its return from the delay queue).",
        "Handoff: with N slots, the (N+i)-th grant is the one the i-th release (by time) made room for; from "
        "that release's end to that grant's start. Starts over N: jobs that started while N others ran (0 is safe).",
    ]
