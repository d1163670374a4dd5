"""``python -m bench``: run the figures against a private Redis, print the tables, write the doc."""

from __future__ import annotations

import argparse
import datetime
import json
import pickle
import sys
import time
from pathlib import Path
from types import ModuleType

import redis

from dramatiq_leases.embedded import EmbeddedRedis

from . import (
    fig1_uncontended,
    fig2_heartbeat,
    fig3_throughput,
    fig4_handoff,
    fig5_crash,
    fig6_line,
    fig7_limit,
    fig8_cost,
    profiling,
    report,
)
from .common import (
    Context,
    FigureResult,
    WireCounter,
    cpu_share,
    cpu_ticks,
    load_average,
    machine_info,
    package_revision,
    verdict,
)
from .workers import LOG_DIR

FIGURES: dict[str, ModuleType] = {
    "1": fig1_uncontended,
    "2": fig2_heartbeat,
    "3": fig3_throughput,
    "4": fig4_handoff,
    "5": fig5_crash,
    "6": fig6_line,
    "7": fig7_limit,
    "8": fig8_cost,
    "profile": profiling,
}

DOCS = Path(__file__).resolve().parent.parent / "docs"

#: The last full run's results (with figures merged into it), so ``--rerender`` can rewrite the doc
#: (after editing ``bench/findings.md``) and ``--merge`` can replace a disturbed figure.
LAST_RUN = LOG_DIR / "last-run.pickle"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer samples, < 60 s")
    parser.add_argument("--only", default="", help="comma-separated figures to run: 1,2,3,4,5,6,7,8,profile")
    parser.add_argument(
        "--docs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write docs/benchmarks.md and docs/benchmarks.png (default: on for a full run)",
    )
    parser.add_argument("--json", type=Path, help="also write the raw results to this file")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --only: put these figures into the last full run's results in place of the old ones "
        "and rewrite the docs (to re-run a figure that load on the machine disturbed)",
    )
    parser.add_argument(
        "--rerender",
        action="store_true",
        help="rewrite the docs from the last full run's results (with any --merge), measuring nothing "
        "(after editing findings.md)",
    )
    args = parser.parse_args(argv)
    if args.merge and (not args.only or args.quick):
        parser.error("--merge needs --only and a full (not --quick) run")
    if args.docs is None:
        args.docs = (not args.quick and not args.only) or args.merge
    return args


def load_full_run() -> tuple[list[FigureResult], dict[str, str], float, bool, tuple[str, str]]:
    """The last full run's results, for ``--merge`` (checked before anything is measured)."""
    if not LAST_RUN.exists():
        raise SystemExit(f"--merge: no last run in {LAST_RUN}; run `python -m bench` first")
    run: tuple[list[FigureResult], dict[str, str], float, bool, tuple[str, str]] = pickle.loads(LAST_RUN.read_bytes())
    if run[3]:
        raise SystemExit("--merge: the last run was a --quick one; run `python -m bench` first")
    return run


def merge(
    full: tuple[list[FigureResult], dict[str, str], float, bool, tuple[str, str]], new: list[FigureResult]
) -> tuple[list[FigureResult], dict[str, str], float, bool, tuple[str, str]]:
    """The full run with ``new`` in place of its figures of the same keys (in the full run's order)."""
    results, info, seconds, quick, load = full
    by_key = {r.key: r for r in new}
    for r in new:
        r.merged = True
    return [by_key.pop(r.key, r) for r in results] + list(by_key.values()), info, seconds, quick, load


def write_docs(
    results: list[FigureResult], info: dict[str, str], seconds: float, quick: bool, load: tuple[str, str]
) -> None:
    """Write ``docs/benchmarks.md`` and ``docs/benchmarks.png``."""
    png = DOCS / "benchmarks.png"
    has_chart = report.chart(results, png)
    doc = report.render(results, info, seconds, quick, load, png.name if has_chart else None)
    (DOCS / "benchmarks.md").write_text(doc)
    print(f"Wrote {DOCS / 'benchmarks.md'}" + (f" and {png}" if has_chart else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.rerender:
        write_docs(*pickle.loads(LAST_RUN.read_bytes()))
        return 0
    wanted = [k.strip() for k in args.only.split(",") if k.strip()] or list(FIGURES)
    if args.quick and not args.only:
        wanted = [k for k in wanted if k != "profile"]  # the smoke run checks the harness, not our code
    unknown = set(wanted) - set(FIGURES)
    if unknown:
        raise SystemExit(f"unknown figure(s): {', '.join(sorted(unknown))}; choose from {', '.join(FIGURES)}")

    full_run = load_full_run() if args.merge else None
    started = time.monotonic()
    load_before = load_average()
    results: list[FigureResult] = []
    with EmbeddedRedis() as server:
        admin = redis.Redis(port=server.port, socket_timeout=30)
        ctx = Context(url=server.url(0), quick=args.quick, admin=admin, wire=WireCounter())
        info = machine_info(admin)
        print(" · ".join(f"{k} {v}" for k, v in info.items()), flush=True)
        for key in wanted:
            t0 = time.monotonic()
            figure_load, ticks = load_average(), cpu_ticks()
            measured_at = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
            result = FIGURES[key].run(ctx)
            result.seconds = time.monotonic() - t0
            result.revision = package_revision()
            result.measured_at = measured_at
            result.load = (figure_load, load_average())
            result.cpu = cpu_share(ticks, cpu_ticks())
            results.append(result)
            busy, steal = result.cpu
            print(
                f"\n## {result.title}  ({result.seconds:.1f} s; load {result.load[0]} -> {result.load[1]}, "
                f"CPUs {busy:.0f}% busy, {steal:.0f}% stolen by the VM's host)\n",
                flush=True,
            )
            for t in result.tables:
                print(t, "\n")
            for note in result.notes:
                print(f"- {note}")
            for goal in result.goals:
                print(f"GOAL [{verdict(goal.met)}] {goal.goal}: {goal.measured}")
        admin.close()
    seconds = time.monotonic() - started
    load = (load_before, load_average())
    print(f"\nTotal: {seconds:.1f} s (load average {load[0]} -> {load[1]})")

    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "seconds": seconds,
                    "results": [
                        {
                            "key": r.key,
                            "goals": [g.__dict__ for g in r.goals],
                            "data": r.data,
                            "seconds": r.seconds,
                        }
                        for r in results
                    ],
                },
                indent=1,
                default=str,
            )
        )
    LOG_DIR.mkdir(exist_ok=True)
    run = merge(full_run, results) if full_run else (results, info, seconds, args.quick, load)
    # Only a full run (or one merged into it) replaces the results that --merge and --rerender work from.
    keep = LAST_RUN if args.merge or not (args.quick or args.only) else LAST_RUN.with_name("last-partial-run.pickle")
    keep.write_bytes(pickle.dumps(run))
    if args.docs:
        write_docs(*run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
