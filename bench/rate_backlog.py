"""``python -m bench.rate_backlog``: a key with ``lock_rate`` and a backlog, on real workers.

K messages of one key are sent to a stopped broker, then 2 worker processes of 8 threads start: how fast the
backlog runs against the rate (starts after the first, over the time from the first to the last, divided by
the rate), the most starts in any window of the rate's length (at most its count, exactly), enqueues per
message (the send, each park or retry, each return), and, beside ours, Dramatiq's ``WindowRateLimiter`` on the
same work (its window in whole seconds, its retries spent). One run per line; ``--broker rabbitmq`` for
RabbitMQ. Figures vary with the machine's load; compare lines of one run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import redis

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


def run(mode: str, rate: str, k: int, broker: str, timeout: float) -> str:
    with EmbeddedRedis() as server:
        url = server.url(0)
        env = {**os.environ, "RATE_URL": url, "RATE": rate, "RATE_MODE": mode, "RATE_BROKER": broker}
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
        rate_app.broker.flush_all()
    parsed = parse_rate(rate)
    span = (starts[-1] - starts[0]) / 1e6 if len(starts) > 1 else float("nan")
    achieved = (len(starts) - 1) / span * parsed.window / 1000 / parsed.count if span else float("nan")
    return (
        f"{mode:7} {broker:8} ran {len(starts)}/{k}; rate achieved / {rate}: {achieved:.2f}; "
        f"most starts in any {parsed.window} ms: {most_in_any_window(starts, parsed.window)} "
        f"(limit {parsed.count}); enqueues per message: {enqueues / k:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="50/s")
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis")
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    for mode in ("leases", "window"):
        print(run(mode, args.rate, args.messages, args.broker, args.timeout), flush=True)


if __name__ == "__main__":
    main()
