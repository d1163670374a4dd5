"""Figure 6: the wait line: K jobs on one key sent at once, through real workers (2 x 8).

All K ``hold`` messages are sent at once to idle workers (2 processes x 8
threads, Redis broker, Dramatiq's defaults otherwise), for short jobs
(100 ms) at growing K and for long ones (5 s). Ours lets the first waiters
of the key wait in place (a worker thread blocked until the release wakes
it) and parks the rest in Dramatiq's delay queue until promoted; the peer is
``ConcurrentRateLimiter(limit=1)`` retried by Retries (backoff 50 ms..2 s,
as ours had before the line, and enough ``max_retries`` never to drop a
message).

From the jobs' log and an enqueue counter on every broker (the producer's
and the workers'): the makespan over K x job (first send to last end),
how often the broker carried each message (its send included: a message
that waited in place is enqueued once, a parked one three times: the send,
the park, the return), the handoffs (from one job's end to the next one's
start), the pairs of jobs that started in the opposite order to their
sends (inversions: the line orders waiters by their first attempt, which
prefetching and thread scheduling shuffle a little against the send order)
and any overlap (two holders at once: a safety violation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common import Context, FigureResult, Goal, percentile, table
from .defaults import DEFAULT_BACKOFF
from .holds import HoldRun, run_holds

GOAL_RATIO = 1.1
GOAL_ENQUEUES = 3.0
GOAL_P50_MS = 50.0
GOAL_P99_MS = 250.0

#: The peer retries every busy attempt; it is run up to this K only (beyond, a run takes minutes);
#: in a quick run, at the smallest K of short jobs only, to stay within a minute.
CRL_MAX_K = 100
#: Retries' ``max_retries`` for the peer: every busy attempt is a retry, and it must not drop a job.
CRL_MAX_RETRIES = 10_000

MODES = {"leases": "dramatiq-leases", "crl": "ConcurrentRateLimiter + Retries"}


@dataclass(frozen=True)
class Setting:
    """One run: mode (``leases`` or ``crl``), K jobs, each holding the key ``job_ms``."""

    mode: str
    k: int
    job_ms: int

    @property
    def job(self) -> str:
        """``100 ms``, ``5 s``."""
        return f"{self.job_ms / 1000:g} s" if self.job_ms >= 1000 else f"{self.job_ms} ms"

    @property
    def short(self) -> str:
        """How a goal names the run: ``K=100 x 100 ms``."""
        return f"K={self.k:,} x {self.job}"

    @property
    def ideal(self) -> float:
        """K x job (s)."""
        return self.k * self.job_ms / 1000

    def env(self) -> dict[str, str]:
        """The workers' ``BENCH_*`` settings: ours with its defaults; the peer with the backoff and retries above."""
        if self.mode == "leases":
            return {"BENCH_MODE": "leases"}
        return {
            "BENCH_MODE": "crl",
            "BENCH_BACKOFF_MIN": str(DEFAULT_BACKOFF[0]),
            "BENCH_BACKOFF_MAX": str(DEFAULT_BACKOFF[1]),
            "BENCH_MAX_RETRIES": str(CRL_MAX_RETRIES),
        }

    def timeout(self, quick: bool) -> float:
        """How long to wait for the jobs (s): generous, bounded (the peer's backoff needs more)."""
        factor = 1.5 if self.mode == "leases" else 4.0
        return factor * self.ideal + (15 if quick else 30)


def _settings(quick: bool) -> list[Setting]:
    """Ours at every K; the peer after it where it applies (see :data:`CRL_MAX_K`)."""
    shorts, longs = ([10, 50], [3]) if quick else ([10, 100, 1_000], [6])
    runs = [(k, 100) for k in shorts] + [(k, 5_000) for k in longs]
    peer = {runs[0]} if quick else {(k, job_ms) for k, job_ms in runs if k <= CRL_MAX_K}
    return [Setting(mode, k, job_ms) for k, job_ms in runs for mode in MODES if mode == "leases" or (k, job_ms) in peer]


def _summary(run: HoldRun) -> dict[str, Any]:
    gaps = run.gaps_ms
    enqueues = run.enqueues_per_message
    pairs = run.completed * (run.completed - 1) // 2
    return {
        "completed": run.completed,
        "extra_runs": run.extra_runs,
        "makespan": run.makespan,
        "ratio": run.makespan / run.ideal,
        "first_start_ms": run.first_start * 1000,
        "enqueues_mean": sum(enqueues) / len(enqueues),
        "enqueues_max": max(enqueues),
        "handoff_p50": percentile(gaps, 50),
        "handoff_p99": percentile(gaps, 99),
        "handoff_max": max(gaps, default=float("nan")),
        "inversions": run.inversions,
        "inversions_share": run.inversions / pairs if pairs else 0.0,
        "overlaps": run.overlaps,
    }


def _ours(summary: dict[Setting, dict[str, Any]], measure: str) -> str:
    """``K=10 x 100 ms: 1.02, ...``: one measure of ours in every setting."""
    return ", ".join(f"{s.short}: {measure.format(**v)}" for s, v in summary.items() if s.mode == "leases")


def _goals(summary: dict[Setting, dict[str, Any]]) -> list[Goal]:
    ours = {s: v for s, v in summary.items() if s.mode == "leases"}
    return [
        Goal(
            "6",
            f"makespan within {GOAL_RATIO}x of K x job (100 ms jobs at every K; 5 s jobs)",
            _ours(summary, "{ratio:.2f}x"),
            all(v["ratio"] <= GOAL_RATIO and v["completed"] == s.k for s, v in ours.items()),
        ),
        Goal(
            "6",
            f"at most {GOAL_ENQUEUES:g} enqueues per message on average (the send included), flat in K",
            _ours(summary, "{enqueues_mean:.2f}"),
            all(v["enqueues_mean"] <= GOAL_ENQUEUES for v in ours.values()),
        ),
        Goal(
            "6",
            f"handoff p50 at most {GOAL_P50_MS:g} ms and p99 at most {GOAL_P99_MS:g} ms",
            _ours(summary, "{handoff_p50:.0f}/{handoff_p99:.0f} ms") + " (p50/p99)",
            all(v["handoff_p50"] <= GOAL_P50_MS and v["handoff_p99"] <= GOAL_P99_MS for v in ours.values()),
        ),
        Goal(
            "6",
            "no two holders at once, no job run twice",
            f"{sum(v['overlaps'] for v in summary.values())} overlaps, "
            f"{sum(v['extra_runs'] for v in summary.values())} extra runs",
            all(v["overlaps"] == 0 and v["extra_runs"] == 0 for v in summary.values()),
        ),
    ]


def run(ctx: Context) -> FigureResult:
    """Run every setting once, ours and the peer's interleaved."""
    summary: dict[Setting, dict[str, Any]] = {}
    for setting in _settings(ctx.quick):
        hold_run = run_holds(
            ctx,
            setting.env(),
            setting.k,
            setting.job_ms,
            setting.timeout(ctx.quick),
            name=f"fig6-{setting.mode}",
            key="line",
            count_enqueues=True,
        )
        summary[setting] = _summary(hold_run)

    rows = [
        [
            s.job,
            s.k,
            MODES[s.mode],
            f"{v['completed']}/{s.k}",
            v["makespan"],
            v["ratio"],
            v["enqueues_mean"],
            v["enqueues_max"],
            v["handoff_p50"],
            v["handoff_p99"],
            v["handoff_max"],
            v["first_start_ms"],
            f"{v['inversions']:,} ({100 * v['inversions_share']:.1f}%)",
            v["overlaps"],
        ]
        for s, v in summary.items()
    ]
    main = table(
        [
            "job",
            "K",
            "mode",
            "jobs done",
            "makespan s",
            "x (K x job)",
            "enqueues / msg",
            "max",
            "handoff p50 ms",
            "p99 ms",
            "max ms",
            "first start ms",
            "inversions (of pairs)",
            "overlaps",
        ],
        rows,
    )
    peer = {(s.k, s.job_ms) for s in summary if s.mode == "crl"}
    skipped = [s.short for s in summary if s.mode == "leases" and (s.k, s.job_ms) not in peer]
    notes = [
        "Each row is one run: fresh workers (2 processes x 8 threads, Redis broker), K messages sent at once "
        "once both processes poll the broker; one key for all.",
        "Ours runs with LeaseMiddleware's defaults; the peer with Retries' backoff "
        f"{DEFAULT_BACKOFF[0]} ms..{DEFAULT_BACKOFF[1] / 1000:g} s and max_retries={CRL_MAX_RETRIES:,} "
        "(Dramatiq's default of 20 would drop jobs that wait long).",
        "Enqueues per message count every broker enqueue of its id: the producer's send, each send back "
        "(ours: a park; the peer: a retry) and each return from a delay queue.",
        "Handoff: from one job's end to the next job's start (jobs ordered by start). Inversions: pairs of jobs "
        "that started in the opposite order to their sends; reported, no goal.",
    ]
    if skipped:
        why = (
            "a quick run runs the peer at its first setting only, to stay within a minute"
            if ctx.quick
            else f"the peer runs up to K = {CRL_MAX_K} only: it retries every busy attempt, so larger runs take minutes"
        )
        notes.append(f"Ours alone at {', '.join(skipped)}: {why}.")
    return FigureResult(
        key="fig6",
        title="6. Wait line: K jobs on one key, sent at once",
        method=__doc__ or "",
        tables=[main],
        goals=_goals(summary),
        notes=notes,
        data={
            "runs": [
                {"mode": s.mode, "k": s.k, "job_ms": s.job_ms, "ideal_s": s.ideal, **v} for s, v in summary.items()
            ],
            "goal_ratio": GOAL_RATIO,
        },
    )
