"""Where figure 7's makespan goes: its line run with the workers' trace, read event by event.

``python -m bench.limit_trace [--runs 3] [--k 100] [--env NAME=VALUE ...]`` runs
figure 7's setting (ours, K jobs of 100 ms on 4 slots, 2 x 8 workers) against
a private Redis with ``BENCH_TRACE=1`` (:mod:`bench.limit_app` records every
enqueue and every delivery to a worker thread), and prints per run:

* the makespan beyond K x job / N, split into the slots' idle time before
  their first grant, between a release and the grant it made room for, and
  after their last job (:meth:`bench.fig7_limit.LineRun.excess_ms`);
* how each of those grants was served: by a thread already waiting when
  the release came (woken in place), or by a message delivered only after
  it (a promoted copy back from the delay queue, or a first delivery);
  with, for the latter, the time from that release to its delivery;
* how often a message was parked more than once (each park after the first
  costs two enqueues: the park, the return);
* how long returned copies sat in the queue before a worker took them
  (enqueue to delivery: Dramatiq's consumers poll an empty queue with a
  growing sleep, up to ``dramatiq_worker_timeout``);
* the handoffs over 20 ms, each with the path of the message granted.

``--env dramatiq_worker_timeout=100`` (any worker setting) tries a change
without touching the figure. The trace costs each event an ``RPUSH``.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import redis

from dramatiq_leases.embedded import EmbeddedRedis

from .common import Context, WireCounter, median, percentile
from .fig7_limit import LineRun, _line_summary, line_run

#: A handoff longer than this is listed with its message's path.
SLOW_MS = 20.0


def _path(events: list[dict[str, Any]], t0: float) -> str:
    """``deliver@11 park@97 return@230 deliver@250``: one message's trace, ms from the first send."""
    names = []
    for e in events:
        if e["event"] == "deliver":
            names.append("deliver")
        else:
            names.append("park" if e["q"].endswith(".DQ") else "return")
    return " ".join(f"{n}@{(e['t'] - t0) * 1000:.0f}" for n, e in zip(names, events, strict=True))


def analyse(run: LineRun) -> list[str]:
    """The lines printed for one traced run."""
    t0, n, done = run.hold.t0, run.limit, run.hold.done
    by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in sorted(run.trace, key=lambda e: e["t"]):
        by_id[e["id"]].append(e)
    summary = _line_summary(run)
    excess = summary["excess"]
    out = [
        f"makespan {summary['makespan']:.3f} s = {summary['ratio']:.3f} x (K x job / N); beyond it: "
        f"before the first grants {excess['first']:.0f} ms, handoffs {excess['handoffs']:.0f} ms, "
        f"tail {excess['tail']:.0f} ms (slot time / N); enqueues/msg {summary['enqueues_mean']:.2f}, "
        f"handoff p50/p99 {summary['handoff_p50']:.1f}/{summary['handoff_p99']:.1f} ms"
    ]
    ends = sorted(r["end"] for r in done)
    woken, arrived, late, slow = [], [], [], []
    for i, (released, grant) in enumerate(zip(ends, done[n:], strict=False)):
        handoff = (grant["start"] - released) * 1000
        deliveries = [e["t"] for e in by_id.get(grant["message_id"], []) if e["event"] == "deliver"]
        last = deliveries[bisect.bisect_right(deliveries, grant["start"]) - 1] if deliveries else None
        if last is not None and last <= released:
            woken.append(handoff)
        else:
            arrived.append(handoff)
            if last is not None:
                late.append((last - released) * 1000)
        if handoff > SLOW_MS:
            path = _path(by_id.get(grant["message_id"], []), t0)
            slow.append(f"  handoff {handoff:.0f} ms: release #{i} at {(released - t0) * 1000:.0f} ms; granted: {path}")
    out.append(
        f"grants after a release: {len(woken)} to a thread waiting in place (handoff median "
        f"{median(woken):.1f} ms, max {max(woken, default=float('nan')):.1f}), {len(arrived)} to a message "
        f"delivered after the release (handoff median {median(arrived):.1f} ms, max "
        f"{max(arrived, default=float('nan')):.1f}; release to delivery median {median(late):.1f} ms)"
    )
    held, empty = _idle_split(run, by_id)
    out.append(
        f"slots idle between the first grants and the last start: {held:.0f} ms (slot time / N) while a "
        f"thread held a message it was granted later (waiting in place or asking), {empty:.0f} ms while none did"
    )
    parks = Counter(sum(e["event"] == "enqueue" and e["q"].endswith(".DQ") for e in evs) for evs in by_id.values())
    out.append(f"messages by times parked: {dict(sorted(parks.items()))}")
    waits = []
    for evs in by_id.values():
        for a, b in itertools.pairwise(evs):
            if a["event"] == "enqueue" and not a["q"].endswith(".DQ") and b["event"] == "deliver":
                waits.append((b["t"] - a["t"]) * 1000)
    out.append(
        f"returned copies, enqueue to delivery: {len(waits)} copies, p50 {percentile(waits, 50):.1f} ms, "
        f"p90 {percentile(waits, 90):.1f}, max {max(waits, default=float('nan')):.1f}"
    )
    return out + slow


def _idle_split(run: LineRun, by_id: dict[str, list[dict[str, Any]]]) -> tuple[float, float]:
    """Idle slot time (ms of makespan) from the N-th start to the last start: while a thread held a message
    that it went on to run (waiting in place, or asking: it could have taken the slot), and while none did."""
    n, done = run.limit, run.hold.done
    if len(done) <= n:
        return math.nan, math.nan
    starts = {r["message_id"]: r["start"] for r in done}
    events = [(r["start"], "run", 1) for r in done] + [(r["end"], "run", -1) for r in done]
    for message_id, evs in by_id.items():
        for i, e in enumerate(evs):
            if e["event"] != "deliver":
                continue
            # Only a delivery that ended in the grant (not in a park): a thread that could take a slot.
            later = [x["t"] for x in evs[i + 1 :] if x["event"] == "enqueue"]
            start = starts.get(message_id, math.inf)
            if start < min([*later, math.inf]) and start >= e["t"]:
                events += [(e["t"], "wait", 1), (start, "wait", -1)]
    events.sort(key=lambda e: (e[0], e[2]))  # at a tie, ends first
    begin, end = done[n - 1]["start"], done[-1]["start"]
    running = waiting = 0
    held = empty = 0.0
    last = events[0][0]
    for t, kind, step in events:
        lo, hi = max(last, begin), min(t, end)
        if hi > lo and running < n:
            share = min(n - running, waiting)
            held += share * (hi - lo)
            empty += (n - running - share) * (hi - lo)
        if kind == "run":
            running += step
        else:
            waiting += step
        last = t
    return 1000 * held / n, 1000 * empty / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.limit_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the workers (repeatable)")
    parser.add_argument("--dump", type=Path, help="also write each run's job log and trace here, as JSON")
    args = parser.parse_args(argv)
    env = {"BENCH_TRACE": "1", **dict(item.split("=", 1) for item in args.env)}
    with EmbeddedRedis() as server:
        admin = redis.Redis(port=server.port, socket_timeout=30)
        ctx = Context(url=server.url(0), quick=False, admin=admin, wire=WireCounter())
        for i in range(args.runs):
            print(f"run {i + 1}:")
            run = line_run(ctx, "leases", args.k, env)
            for line in analyse(run):
                print(f"  {line}")
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                raw = {"t0": run.hold.t0, "sent": run.hold.sent, "done": run.hold.done, "trace": run.trace}
                (args.dump / f"run{i + 1}.json").write_text(json.dumps({**raw, "enqueues": run.hold.enqueues}))
        admin.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
