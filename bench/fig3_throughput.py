"""Figure 3: how fast real workers drain a pre-filled queue of no-op jobs, with and without the middleware.

Each run: a clean broker, M messages for ``noop(n)`` (distinct keys) put on
the queue, then ``dramatiq bench.app --processes 2 --threads 8`` started.
The harness polls the queue's message hash (``HLEN``: messages not yet
acknowledged) every 5 ms and takes the rate over the middle 80% of the
drain (from 10% done to 90% done), so worker boot and the tail do not
count. Modes alternate run by run, so drift hits them alike; the median of
the repeats is reported. Redis commands per message come from
``commandstats`` over the whole run (the harness's own ``HLEN`` and ``INFO``
left out): exact, and independent of the machine's load.
"""

from __future__ import annotations

import time
from typing import Any

from .common import Context, FigureResult, Goal, command_stats, median, table
from .names import THROUGHPUT_QUEUE
from .peers import cleanup
from .workers import NAMESPACE, WorkerGroup, producer, reset_broker, send

MODES = {
    "bare": "no lock",
    "raw": "SET NX + Lua CAD in the actor (2-round-trip floor)",
    "leases": "LeaseMiddleware (default Prometheus metrics)",
    "leases-nometrics": "LeaseMiddleware (null metrics)",
    "crl": "ConcurrentRateLimiter(limit=1) in the actor",
}
GOAL_OVERHEAD = 0.15


def _drain(ctx: Context, mode: str, messages: int) -> dict[str, Any]:
    client = ctx.client()
    reset_broker(client)
    cleanup(client)
    broker = producer(ctx.url)
    for i in range(messages):
        send(broker, THROUGHPUT_QUEUE, "noop", i)
    broker.close()
    pending_key = f"{NAMESPACE}:{THROUGHPUT_QUEUE}.msgs"
    if client.hlen(pending_key) != messages:
        raise RuntimeError("the queue was not filled")
    before = command_stats(ctx.admin)
    lo, hi = messages * 0.9, messages * 0.1
    t_lo = t_hi = None
    started = time.monotonic()
    with WorkerGroup(ctx.url, {"BENCH_MODE": mode}, processes=2, threads=8, name=f"fig3-{mode}"):
        while True:
            left = client.hlen(pending_key)
            now = time.monotonic()
            if t_lo is None and left <= lo:
                t_lo = now
            if t_hi is None and left <= hi:
                t_hi = now
            if left == 0:
                drained = now
                break
            if now - started > 600:
                raise RuntimeError(f"{mode}: {left} messages left after 10 minutes")
            time.sleep(0.005)
        after = command_stats(ctx.admin)
    diff = after - before
    for harness_cmd in ("hlen",):
        diff.pop(harness_cmd, None)
    assert t_lo is not None and t_hi is not None
    cleanup(client)
    client.close()
    return {
        "rate": (lo - hi) / (t_hi - t_lo),
        "total_s": drained - started,
        "commands_per_msg": sum(diff.values()) / messages,
        "breakdown": {k: v / messages for k, v in diff.most_common(10)},
    }


def run(ctx: Context) -> FigureResult:
    """Drain the queue ``repeats`` times per mode, alternating modes; report medians and overhead."""
    messages, repeats = (1_000, 1) if ctx.quick else (5_000, 3)
    modes = ["bare", "leases"] if ctx.quick else list(MODES)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(repeats):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            runs[mode].append(_drain(ctx, mode, messages))

    bare = median([x["rate"] for x in runs["bare"]])
    rows = []
    for mode in modes:
        rate = median([x["rate"] for x in runs[mode]])
        rows.append(
            [
                mode,
                MODES[mode],
                rate,
                ", ".join(f"{x['rate']:.0f}" for x in runs[mode]),
                1 - rate / bare,
                runs[mode][0]["commands_per_msg"],
                median([x["total_s"] for x in runs[mode]]),
            ]
        )
    main = table(
        [
            "mode",
            "middleware",
            "msg/s (median)",
            "runs",
            "overhead vs bare",
            "Redis cmds / msg",
            "wall s incl. boot",
        ],
        rows,
    )
    detail = table(
        ["mode", "commands per message (commandstats, incl. inside Lua)"],
        [[m, ", ".join(f"{k} {v:.2f}" for k, v in runs[m][0]["breakdown"].items())] for m in modes],
    )
    overhead = 1 - median([x["rate"] for x in runs["leases"]]) / bare
    goals = [
        Goal(
            "3",
            f"middleware costs under {GOAL_OVERHEAD:.0%} of bare throughput",
            f"{overhead:.1%} ({median([x['rate'] for x in runs['leases']]):.0f} vs {bare:.0f} msg/s)",
            overhead < GOAL_OVERHEAD,
        )
    ]
    notes = [
        f"{messages:,} messages per run, {repeats} run(s) per mode, 2 processes x 8 threads, "
        "the RedisBroker on the same Redis as the leases."
    ]
    return FigureResult(
        key="fig3",
        title="3. Dramatiq throughput: no-op actor, distinct keys",
        method=__doc__ or "",
        tables=[main, detail],
        goals=goals,
        notes=notes,
        data={"runs": runs, "messages": messages},
    )
