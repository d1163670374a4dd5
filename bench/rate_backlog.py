"""``python -m bench.rate_backlog``: a key with ``lock_rate`` and a backlog, on real workers.

K messages of one key are sent to a stopped broker, then 2 worker processes of 8 threads start: how fast the
backlog runs against the rate (starts after the first, over the time from the first to the last, divided by
the rate), the most starts in any window of the rate's length (at most its count, exactly), enqueues per
message (the send, each park or retry, each return), and, beside ours, Dramatiq's ``WindowRateLimiter`` on the
same work (its window in whole seconds, its retries spent). One run per line; ``--broker rabbitmq`` for
RabbitMQ. The rate achieved is also given from the first full window on (``steady``): the first window's
starts wait for the backlog's first deliveries, the rest for the rate. Then what a rate costs the lease store
per grant (:func:`grant_cost`). Figures vary with the machine's load; compare lines of one run. ``--trace``:
where the time goes, grant by grant (:func:`trace_report`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis

from dramatiq_leases import Lease, Leases
from dramatiq_leases.core.rates import parse_rate
from dramatiq_leases.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent


def most_in_any_window(times_us: list[int], window_ms: int) -> int:
    """The largest number of ``times_us`` in any half-open window of ``window_ms``."""
    times, most, first = sorted(times_us), 0, 0
    for last, t in enumerate(times):
        while times[first] <= t - window_ms * 1000:
            first += 1
        most = max(most, last - first + 1)
    return most


def server_usec(client: redis.Redis) -> float:
    """The server's total command time so far (µs; scripts' own commands included), ``INFO`` left out."""
    stats = client.info("commandstats")
    return sum(float(stat["usec"]) for name, stat in stats.items() if not name.startswith("cmdstat_info"))


def grant_cost(count: int, *, cycles: int = 2_000, rounds: int = 5) -> str:
    """What a rate of ``count`` starts costs the lease store: its time per grant and release of one key, with the
    rate and without, in interleaved blocks of ``cycles``; the ratio is each round's, then their median. The rate
    is ``count`` per millisecond: its ring holds ``count`` grants as the real rate's does, full after the first
    ``count`` as under a backlog, and one client never reaches it, so no grant is refused (a refusal costs less)."""
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url(0))
        leases = Leases(client)
        per: dict[str, list[float]] = {"none": [], "rate": []}
        for n in range(rounds):
            for row in ("none", "rate") if n % 2 == 0 else ("rate", "none"):
                rate = f"{count}/ms" if row == "rate" else None
                before = server_usec(client)
                for _ in range(cycles):
                    got = leases.try_acquire(f"cost:{row}", 10_000, rate=rate)
                    assert isinstance(got, Lease), got  # a refusal would cost less than a grant: not this figure
                    leases.release(got)
                per[row].append((server_usec(client) - before) / cycles)
    ratio = statistics.median(r / p for r, p in zip(per["rate"], per["none"]))
    return (
        f"grant cost, lock_rate={count}/ms against none: {ratio:.2f}x the lease store's time per grant and release "
        f"({statistics.median(per['rate']):.1f} µs against {statistics.median(per['none']):.1f} µs; median of "
        f"{rounds} rounds of {cycles})"
    )


def trace_report(facts: list[dict[str, int | str]], count: int, window_ms: int) -> str:
    """Where a backlog's time goes: each grant past the first ``count`` against the instant the rate allowed it
    (the grant ``count`` before it, plus a window), by how its delivery reached the worker, and when.

    A grant is late by its allowed instant to its fence. ``present``: its delivery was on a worker before that
    instant (it waited in place); else its delivery arrived after it, moved by Dramatiq's delay queue at its eta
    (``eta``: the park's own eta to the move is the delay queue's lag), sent on by the middleware (``sent_on``:
    promoted, or its eta come, see :mod:`dramatiq_leases.middleware.waiting`), or sent (``send``). The key idles
    by the sum of the lateness: a rate achieved of ``window / (window + mean lateness)``.
    """
    facts = sorted(facts, key=lambda f: int(f["fence"]))
    by: dict[str, list[float]] = {}
    transit: dict[str, list[float]] = {}
    lag: list[float] = []
    for i in range(count, len(facts)):
        fact = facts[i]
        allowed = int(facts[i - count]["fence"]) + window_ms * 1000
        late = (int(fact["fence"]) - allowed) / 1000
        how = "present" if int(fact["arrived"]) <= allowed else str(fact["how"])
        by.setdefault(how, []).append(late)
        if how != "present":
            transit.setdefault(how, []).append((int(fact["arrived"]) - allowed) / 1000)
        if fact["how"] == "eta" and int(fact["parked"]):
            lag.append((int(fact["moved"]) - int(fact["parked"]) - int(fact["park_delay"]) * 1000) / 1000)
    lates = [x for values in by.values() for x in values]
    first = (int(facts[count - 1]["fence"]) - int(facts[0]["fence"])) / 1000
    lines = [
        f"  the first {count} grants, which the rate allowed at once, took {first:.0f} ms",
        f"  {len(lates)} grants past the first {count}: mean lateness {statistics.fmean(lates):.1f} ms",
    ]
    for how, values in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        line = (
            f"  {how:8} {len(values):4} grants, {sum(values) / sum(lates) * 100:5.1f}% of the lateness: "
            f"median {statistics.median(values):.1f} ms, max {max(values):.1f} ms"
        )
        if how in transit:
            line += f"; arrived {statistics.median(transit[how]):.1f} ms (median) after the allowed instant"
        lines.append(line)
    if lag:
        lines.append(
            f"  delay-queue lag past a park's eta (moved by Dramatiq): median {statistics.median(lag):.1f} "
            f"ms, max {max(lag):.1f} ms over {len(lag)} grants"
        )
    return "\n".join(lines)


def run(mode: str, rate: str, k: int, broker: str, timeout: float, *, trace: bool = False) -> str:
    with EmbeddedRedis() as server:
        url = server.url(0)
        env = {**os.environ, "RATE_URL": url, "RATE": rate, "RATE_MODE": mode, "RATE_BROKER": broker}
        env["RATE_TRACE"] = "1" if trace else "0"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.pop("DRAMATIQ_LEASES_CHECK_KEYS", None)
        os.environ.update({"RATE_URL": url, "RATE": rate, "RATE_MODE": mode, "RATE_BROKER": broker})
        from bench import rate_app

        rate_app = importlib.reload(rate_app)  # the app reads its settings when imported: this run's
        rate_app.broker.flush_all()
        for n in range(k):
            rate_app.call_vendor.send("acme", n)
        log = redis.Redis.from_url(url)
        log.set("rate:enqueues", 0)
        worker = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "bench.rate_app", "--processes", "2", "--threads", "8"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + timeout
            while int(log.llen("rate:starts")) < k and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            worker.terminate()
            worker.wait(30)
        starts = sorted(int(x) for x in log.lrange("rate:starts", 0, -1))
        enqueues = int(log.get("rate:enqueues") or 0) + k
        facts = [json.loads(x) for x in log.lrange("rate:trace", 0, -1)]
        rate_app.broker.flush_all()
    parsed = parse_rate(rate)
    span = (starts[-1] - starts[0]) / 1e6 if len(starts) > 1 else float("nan")
    achieved = (len(starts) - 1) / span * parsed.window / 1000 / parsed.count if span else float("nan")
    later = starts[parsed.count :]
    steady = (len(later) - 1) / ((later[-1] - later[0]) / 1e6) * parsed.window / 1000 / parsed.count
    report = "\n" + trace_report(facts, parsed.count, parsed.window) if facts else ""
    return (
        f"{mode:7} {broker:8} ran {len(starts)}/{k}; rate achieved / {rate}: {achieved:.2f} (steady {steady:.2f}); "
        f"most starts in any {parsed.window} ms: {most_in_any_window(starts, parsed.window)} "
        f"(limit {parsed.count}); enqueues per message: {enqueues / k:.2f}{report}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="50/s")
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--trace", action="store_true", help="where the time goes (ours only; costs a little)")
    args = parser.parse_args()
    for mode in ("leases",) if args.trace else ("leases", "window"):
        print(run(mode, args.rate, args.messages, args.broker, args.timeout, trace=args.trace), flush=True)
    if not args.trace:
        print(grant_cost(parse_rate(args.rate).count), flush=True)


if __name__ == "__main__":
    main()
