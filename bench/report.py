"""Writes ``docs/benchmarks.md`` and the chart it shows, from one run's results."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import common
from .common import FigureResult, table, verdict

#: Hand-written findings (profile reading, suggested fixes), included verbatim after the figures.
FINDINGS = Path(__file__).with_name("findings.md")

HEADER = """# Benchmarks

```
pip install -e . -r bench/requirements.txt  # the peer libraries, matplotlib, py-spy
python -m bench             # full run, ~{minutes} min here: prints the tables, rewrites this file and the PNG
python -m bench --quick     # smoke run, < 60 s: prints the tables, writes nothing (--docs to write)
python -m bench --only 1,4  # some figures only (1-7, profile); --json FILE keeps the raw results
python -m bench --only 1 --merge  # re-run a figure that load disturbed, into the last full run's doc
```

Every figure below comes from one run of `python -m bench` on one machine
(a figure re-run alone with `--merge` says so), against a private
`redis-server` the harness starts on a free port
(`dramatiq_leases.embedded.EmbeddedRedis`). Ratios compare libraries
measured in the same run, interleaved, so load from other work on the
machine falls on all of them alike. Counts (round trips, commands) are exact
and do not depend on the machine's load; times do.
"""


def _machine(
    info: dict[str, str], seconds: float, quick: bool, load: tuple[str, str], results: Sequence[FigureResult]
) -> str:
    rows = [[k, v] for k, v in info.items()]
    rows.append(["load average (1 min) before / after", f"{load[0]} / {load[1]}"])
    # When the run started (its first figure), not when the doc was rendered (``--rerender``).
    started = results[0].measured_at if results and results[0].measured_at else "time not recorded"
    rows.append(["run", f"{'quick' if quick else 'full'}, {seconds:.0f} s, started {started}"])
    return table(["machine", ""], rows)


def _label(r: FigureResult) -> str:
    """``figure 3`` for ``3. Dramatiq throughput...``; ``the profile`` for ``Profile``."""
    number = r.title.split(".", 1)[0]
    return f"figure {number}" if number.isdigit() else f"the {r.title.lower()}"


def _package_tree(revision: str) -> str | None:
    """The git tree of ``dramatiq_leases/`` at a measured revision; ``None`` if unknown or dirty."""
    if not revision or " " in revision:  # "abc1234 + uncommitted changes ...", "unknown (no git)"
        return None
    try:
        return subprocess.run(
            ["git", "rev-parse", f"{revision}:dramatiq_leases"],
            cwd=FINDINGS.parent.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _measured(results: Sequence[FigureResult], info: dict[str, str]) -> str:
    """Which package commit was measured, and which figures were re-run alone (``--merge``)."""

    def revision(r: FigureResult) -> str:
        return r.revision or info.get("dramatiq-leases source", "unknown")

    revisions = list(dict.fromkeys(revision(r) for r in results))
    if len(revisions) == 1:
        line = f"**Package measured: dramatiq-leases at commit `{revisions[0]}`** (`git rev-parse --short HEAD`)."
    else:
        per = "; ".join(f"{_label(r)}: `{revision(r)}`" for r in results)
        line = f"**Package measured: dramatiq-leases at several commits** ({per})."
        # Commits that changed nothing under dramatiq_leases/ measured the same package: say so.
        trees = {rev: _package_tree(rev) for rev in revisions}
        clean = [rev for rev, tree in trees.items() if tree]
        if len(clean) > 1 and len({trees[rev] for rev in clean}) == 1:
            line += (
                f" `dramatiq_leases/` is the same tree at {', '.join(f'`{rev}`' for rev in clean)} "
                "(`git rev-parse <commit>:dramatiq_leases`)"
            )
            unclean = [_label(r) for r in results if not trees[revision(r)]]
            line += f"; {', '.join(unclean)} ran with uncommitted changes in it." if unclean else "."
    merged = [r for r in results if r.merged]
    if merged:
        names = ", ".join(_label(r) for r in merged)
        line += (
            f" Re-run alone after the full run (`python -m bench --only ... --merge`), because load from other "
            f"work disturbed them: {names}. Each figure below says when and at which commit it was measured."
        )
    return line + "\n"


def _provenance(r: FigureResult) -> str:
    if not r.measured_at:
        return ""
    how = "re-run alone and merged into the full run" if r.merged else "part of the full run"
    busy, steal = getattr(r, "cpu", (math.nan, math.nan))
    cpu = "" if math.isnan(busy) else f"; CPUs {busy:.0f}% busy, {steal:.0f}% stolen by the VM's host"
    return (
        f"*Measured {r.measured_at} at commit `{r.revision}`, {how}; load average (1 min) "
        f"{r.load[0]} before, {r.load[1]} after{cpu}; {r.seconds:.0f} s.*\n"
    )


def _goals(results: Sequence[FigureResult]) -> str:
    rows = [[g.figure, g.goal, g.measured, f"**{verdict(g.met)}**"] for r in results for g in r.goals]
    return table(["figure", "goal", "measured", ""], rows)


def render(
    results: Sequence[FigureResult],
    info: dict[str, str],
    seconds: float,
    quick: bool,
    load: tuple[str, str],
    chart: str | None,
) -> str:
    """The whole Markdown document."""
    parts = [
        HEADER.format(minutes=max(1, math.ceil(seconds / 60))),
        _measured(results, info),
        "## Machine\n",
        _machine(info, seconds, quick, load, results),
        "\n## Goals\n",
        _goals(results),
        "",
    ]
    if chart:
        parts += [f"![libraries compared]({chart})\n"]
    for r in results:
        parts += [f"## {r.title}\n", _provenance(r), r.method.strip(), ""]
        for t in r.tables:
            parts += [t, ""]
        parts += [f"- {n}" for n in r.notes]
        parts += [""]
    if FINDINGS.exists():
        parts += [FINDINGS.read_text().strip(), ""]
    parts += ["## How counts are taken\n", (common.__doc__ or "").split("\n\n", 1)[1].strip(), ""]
    return "\n".join(parts)


def chart(results: Sequence[FigureResult], path: Path) -> bool:
    """A PNG with one panel per figure; ``False`` (and no file) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by_key = {r.key: r for r in results}
    panels = [k for k in ("fig1", "fig2", "fig3", "fig4", "fig5", "fig6", "fig7") if k in by_key]
    if not panels:
        return False
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels, strict=False):
        _PANELS[key](ax, by_key[key].data)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _hbar(ax: Any, labels: list[str], values: list[float], highlight: str, xlabel: str, title: str) -> None:
    colors = ["#d62728" if label == highlight else "#7f7f7f" for label in labels]
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    for y, v in enumerate(values[::-1]):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)


def _fig1(ax: Any, data: dict[str, Any]) -> None:
    stats = data["stats"]
    names = data["order"]
    _hbar(
        ax,
        names,
        [stats[n]["median_us"] for n in names],
        "dramatiq-leases",
        "µs (median)",
        "1. Uncontended acquire+release, median latency",
    )
    ax.scatter(
        [stats[n]["p99_us"] for n in names][::-1],
        range(len(names)),
        marker="|",
        color="black",
        s=80,
        label="p99",
        zorder=3,
    )
    ax.legend(loc="lower right", fontsize=8)


def _fig2(ax: Any, data: dict[str, Any]) -> None:
    # Peers take colours from a palette without red, which is ours alone.
    palette = iter(["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"])
    for name, by_n in data["results"].items():
        ns = sorted(int(n) for n in by_n)
        ours = name.startswith("dramatiq-leases")
        ax.plot(
            ns,
            [by_n[str(n)]["ms"] for n in ns],
            marker="o",
            label=name,
            linewidth=3 if ours else 1,
            color="#d62728" if ours else next(palette),
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("leases held (N)")
    ax.set_ylabel("ms per renewal round")
    ax.set_title("2. Heartbeat: one renewal round over N leases", fontsize=10)
    ax.legend(fontsize=7)


def _fig3(ax: Any, data: dict[str, Any]) -> None:
    runs = data["runs"]
    modes = list(runs)
    values = [sorted(x["rate"] for x in runs[m])[len(runs[m]) // 2] for m in modes]
    _hbar(
        ax,
        modes,
        values,
        "leases",
        "messages/s (median)",
        "3. Dramatiq throughput, no-op actor (2 x 8 workers)",
    )


def _fig4(ax: Any, data: dict[str, Any]) -> None:
    summary = data["summary"]
    labels = list(summary)
    short = [
        lbl.replace("dramatiq-leases", "ours")
        .replace("ConcurrentRateLimiter + Retries", "CRL")
        .replace("worker timeout", "wt")
        for lbl in labels
    ]
    values = [summary[lbl]["makespan"] for lbl in labels]
    colors = ["#d62728" if lbl.startswith("dramatiq-leases") else "#7f7f7f" for lbl in labels]
    ax.barh(short[::-1], values[::-1], color=colors[::-1])
    ideal = data["k"] * data["job_ms"] / 1000
    ax.axvline(ideal, color="black", linestyle="--", linewidth=1, label=f"K x job = {ideal:g} s")
    ax.axvline(ideal * 1.3, color="green", linestyle=":", linewidth=1, label="goal 1.3x")
    ax.set_xlabel("makespan s")
    ax.set_title(f"4. Handoff: {data['k']} jobs x {data['job_ms']} ms on one key", fontsize=10)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7)


def _fig5(ax: Any, data: dict[str, Any]) -> None:
    groups = {
        "ours via Dramatiq": data["dramatiq"],
        "ours, core": data["core"],
        "python-redis-lock": data["prl"],
    }
    labels = list(groups)
    values = [sorted(r["recovery_ms"] for r in runs)[len(runs) // 2] for runs in groups.values()]
    _hbar(
        ax,
        labels,
        values,
        "ours via Dramatiq",
        "ms from SIGKILL to the next holder (bar: median; ticks: each kill)",
        "5. Crash recovery",
    )
    # The goal bounds every kill, not the median: show each one, and the largest bound.
    for y, runs in enumerate(list(groups.values())[::-1]):
        ax.scatter([r["recovery_ms"] for r in runs], [y] * len(runs), marker="|", color="black", s=80, zorder=3)
    ax.axvline(data["ttl_ms"], color="black", linestyle="--", linewidth=1, label=f"TTL {data['ttl_ms']} ms")
    bounds = [r["bound_ms"] for r in data["dramatiq"] if not math.isnan(r.get("bound_ms", math.nan))]
    if bounds:
        ax.axvline(
            max(bounds),
            color="green",
            linestyle=":",
            linewidth=1,
            label=f"goal: TTL + backoff cap, {max(bounds):.0f} ms",
        )
    ax.legend(fontsize=8, loc="lower right")


def _fig6(ax: Any, data: dict[str, Any]) -> None:
    short = [r for r in data["runs"] if r["job_ms"] < 1000]
    job_ms = short[0]["job_ms"] if short else 0
    for mode, name, color in (("leases", "ours", "#d62728"), ("crl", "CRL + Retries", "#7f7f7f")):
        runs = sorted((r for r in short if r["mode"] == mode), key=lambda r: r["k"])
        if not runs:
            continue
        ks = [r["k"] for r in runs]
        ax.plot(
            ks,
            [r["ratio"] for r in runs],
            marker="o",
            color=color,
            linewidth=3 if mode == "leases" else 1,
            label=f"{name} ({job_ms} ms jobs)",
        )
        for r in runs:  # how often the broker carried each message, beside its point
            ax.annotate(
                f"{r['enqueues_mean']:.1f} enq/msg",
                (r["k"], r["ratio"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 4),
            )
    for r in data["runs"]:
        if r["job_ms"] >= 1000:
            ax.scatter(
                [r["k"]],
                [r["ratio"]],
                marker="s",
                color="#d62728" if r["mode"] == "leases" else "#7f7f7f",
                label=f"{'ours' if r['mode'] == 'leases' else 'CRL + Retries'} ({r['job_ms'] / 1000:g} s jobs)",
            )
    ax.axhline(data["goal_ratio"], color="green", linestyle=":", linewidth=1, label=f"goal {data['goal_ratio']}x")
    ax.set_xscale("log")
    ax.set_xlabel("jobs on one key (K)")
    ax.set_ylabel("makespan / (K x job)")
    ax.set_title("6. Wait line: K jobs on one key, sent at once (2 x 8 workers)", fontsize=10)
    ax.legend(fontsize=7)


def _fig7(ax: Any, data: dict[str, Any]) -> None:
    runs = data["line"]
    labels = [f"{'ours' if r['mode'] == 'leases' else 'CRL + Retries'} #{i + 1}" for i, r in enumerate(runs)]
    values = [r["ratio"] for r in runs]
    colors = ["#d62728" if r["mode"] == "leases" else "#7f7f7f" for r in runs]
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    for y, r in enumerate(runs[::-1]):  # how often the broker carried each message, beside its bar
        ax.text(r["ratio"], y, f" {r['ratio']:.2f}x, {r['enqueues_mean']:.1f} enq/msg", va="center", fontsize=7)
    ax.axvline(1, color="black", linestyle="--", linewidth=1, label="K x job / N")
    ax.axvline(data["goal_ratio"], color="green", linestyle=":", linewidth=1, label=f"goal {data['goal_ratio']}x")
    ax.set_xlabel("makespan / (K x job / N)")
    title = f"7. {runs[0]['k']} jobs x {data['job_ms']} ms on one key of {data['limit']} slots (2 x 8 workers)"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")


_PANELS = {"fig1": _fig1, "fig2": _fig2, "fig3": _fig3, "fig4": _fig4, "fig5": _fig5, "fig6": _fig6, "fig7": _fig7}
