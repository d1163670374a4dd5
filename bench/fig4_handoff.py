"""Figure 4: K jobs on one key, each holding it for a fixed time, through real workers (2 x 8).

All K messages are sent at once to idle workers (both processes have polled
the broker first). Every job logs when it got the key and when it let go;
from those: the makespan (first send to last release), the idle gaps
between one holder's end and the next holder's start, the busy retries
each job went through, and any overlap (two holders at once: a safety
violation). Ours is compared, with the same backoff bounds, with
``ConcurrentRateLimiter(limit=1)`` retried by Retries.

Dramatiq delivers a delayed (backed-off) message only when a worker's
delay-queue consumer next polls, and an idle consumer polls less and less
often, up to ``dramatiq_worker_timeout`` (1 s by default). So each handoff
waits for our backoff *and* for that poll; rows with a shorter worker
timeout show how much of the gap is Dramatiq's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common import Context, FigureResult, Goal, median, percentile, table
from .defaults import DEFAULT_BACKOFF, PREVIOUS_BACKOFF, fmt_ms
from .holds import run_holds

GOAL_RATIO = 1.3


@dataclass(frozen=True)
class Setting:
    """One configuration to run: mode, backoff bounds (ms) and Dramatiq's worker timeout (ms)."""

    mode: str
    backoff: tuple[int, int] = DEFAULT_BACKOFF
    worker_timeout: int = 1000

    @property
    def label(self) -> str:
        name = "dramatiq-leases" if self.mode == "leases" else "ConcurrentRateLimiter + Retries"
        low, high = self.backoff
        # Only ours has these defaults; Retries (crl) is merely given the same bounds.
        tags = {DEFAULT_BACKOFF: " (default)", PREVIOUS_BACKOFF: " (old default)"} if self.mode == "leases" else {}
        tag = tags.get(self.backoff, "")
        return f"{name}, backoff {low}..{high} ms{tag}, worker timeout {self.worker_timeout} ms"


def _once(ctx: Context, setting: Setting, k: int, job_ms: int, timeout: float) -> dict[str, Any]:
    env = {
        "BENCH_MODE": setting.mode,
        "BENCH_BACKOFF_MIN": str(setting.backoff[0]),
        "BENCH_BACKOFF_MAX": str(setting.backoff[1]),
        "dramatiq_worker_timeout": str(setting.worker_timeout),
    }
    run = run_holds(ctx, env, k, job_ms, timeout, name=f"fig4-{setting.mode}")
    return {
        "completed": len(run.done),
        "makespan": run.makespan,
        "first_start": run.first_start,
        "gaps_ms": run.gaps_ms,
        "overlaps": run.overlaps,
        "retries": [r["attempts"] for r in run.done],
    }


def _settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting("leases"), Setting("crl")]
    settings = [
        Setting("leases"),
        Setting("crl"),
        Setting("leases", PREVIOUS_BACKOFF),  # the defaults before cf6e0a1, for comparison
        Setting("leases", (100, 1_000)),
        Setting("leases", (50, 400)),
        Setting("leases", (20, 200)),
        Setting("crl", (20, 200)),
        Setting("leases", DEFAULT_BACKOFF, 100),
        Setting("leases", (20, 200), 100),
        Setting("crl", (20, 200), 100),
    ]
    return list(dict.fromkeys(settings))  # a default may coincide with a listed setting: run it once


def run(ctx: Context) -> FigureResult:
    """Run every setting; the default of each mode is repeated to pool more gaps."""
    k, job_ms = (4, 200) if ctx.quick else (10, 200)
    ideal = k * job_ms / 1000
    timeout = 60.0 if ctx.quick else 180.0
    results: dict[Setting, list[dict[str, Any]]] = {}
    for setting in _settings(ctx.quick):
        repeats = 3 if not ctx.quick and setting.backoff == DEFAULT_BACKOFF and setting.worker_timeout == 1000 else 1
        results[setting] = [_once(ctx, setting, k, job_ms, timeout) for _ in range(repeats)]

    rows = []
    summary: dict[str, dict[str, Any]] = {}
    for setting, runs in results.items():
        gaps = [g for r in runs for g in r["gaps_ms"]]
        makespan = median([r["makespan"] for r in runs])
        s = {
            "makespan": makespan,
            "ratio": makespan / ideal,
            "gap_median": median(gaps),
            "gap_p95": percentile(gaps, 95),
            "retries": sum(sum(r["retries"]) for r in runs) / max(1, sum(r["completed"] for r in runs)),
            "completed": f"{sum(r['completed'] for r in runs)}/{k * len(runs)}",
            "overlaps": sum(r["overlaps"] for r in runs),
            "runs": len(runs),
        }
        summary[setting.label] = s
        rows.append(
            [
                setting.label,
                s["completed"],
                s["makespan"],
                s["ratio"],
                s["gap_median"],
                s["gap_p95"],
                s["retries"],
                s["overlaps"],
                s["runs"],
            ]
        )
    main = table(
        [
            "setting",
            "jobs done",
            "makespan s",
            f"x ideal ({ideal:g} s)",
            "gap median ms",
            "gap p95 ms",
            "busy retries / job",
            "overlaps",
            "runs",
        ],
        rows,
    )

    ours_default = summary[Setting("leases").label]
    meeting = [
        label for label, s in summary.items() if label.startswith("dramatiq-leases") and s["ratio"] <= GOAL_RATIO
    ]
    goals = [
        Goal(
            "4",
            f"makespan within {GOAL_RATIO}x of K x job time "
            f"(defaults {fmt_ms(DEFAULT_BACKOFF[0])}..{fmt_ms(DEFAULT_BACKOFF[1])})",
            f"{ours_default['ratio']:.2f}x ({ours_default['makespan']:.2f} s vs {ideal:g} s)",
            ours_default["ratio"] <= GOAL_RATIO,
        ),
        Goal(
            "4",
            "no two holders at once",
            f"{sum(s['overlaps'] for s in summary.values())} overlaps",
            all(s["overlaps"] == 0 for s in summary.values()),
        ),
    ]
    notes = [
        f"K = {k} jobs x {job_ms} ms on one key; the ideal makespan is {ideal:g} s.",
        "Settings of ours that meet the goal in this run: " + ("; ".join(meeting) if meeting else "none") + ".",
    ]
    return FigureResult(
        key="fig4",
        title="4. Contention handoff: K jobs on one key",
        method=__doc__ or "",
        tables=[main],
        goals=goals,
        notes=notes,
        data={"summary": summary, "k": k, "job_ms": job_ms},
    )
