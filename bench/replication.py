"""The cost of ``min_replicas``: one acquire+release cycle with and without ``WAIT``, on a local primary and replica.

``python -m bench.replication [--rounds R] [--block B]`` starts a primary and a replica (``redis-server`` on
free ports, on this machine), then times acquire+release cycles of one key for four variants: pooled
connections (a web request's :class:`Leases`) and per-thread connections (LeaseMiddleware's), each without
and with ``min_replicas=1``. The variants run in interleaved blocks whose order rotates every round, so drift
from other work on the machine lands on all of them alike; each cycle is timed alone. Prints the median and
the 99th percentile in microseconds, and the median's extra cost of ``WAIT``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import redis

from dramatiq_leases import Lease, Leases
from dramatiq_leases.embedded import EmbeddedRedis

VARIANTS = [("pooled", False, 0), ("pooled", False, 1), ("per-thread", True, 0), ("per-thread", True, 1)]


def _in_sync(primary: redis.Redis, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        primary.incr("bench:replication-probe")
        if int(primary.execute_command("WAIT", 1, 100)) >= 1:
            return
    raise RuntimeError("the replica did not catch up")


def _cycle(leases: Leases) -> int:
    started = time.perf_counter_ns()
    lease = leases.try_acquire("bench:replication", 30_000)
    assert isinstance(lease, Lease), lease
    leases.release(lease)
    return time.perf_counter_ns() - started


def run(rounds: int, block: int) -> dict[str, list[int]]:
    """Timings (ns) per variant name."""
    primary = EmbeddedRedis(extra_args=("--repl-diskless-sync-delay", "0")).start()
    replica = EmbeddedRedis(extra_args=("--replicaof", "127.0.0.1", str(primary.port))).start()
    try:
        client = redis.Redis(port=primary.port, socket_timeout=2)
        _in_sync(client)
        stores = {
            f"{name}, min_replicas={n}": Leases(client, thread_connections=threads, min_replicas=n)
            for name, threads, n in VARIANTS
        }
        timings: dict[str, list[int]] = {name: [] for name in stores}
        for leases in stores.values():  # warm up: scripts loaded, connections open
            for _ in range(50):
                _cycle(leases)
        names = list(stores)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                timings[name].extend(_cycle(stores[name]) for _ in range(block))
        client.close()
        return timings
    finally:
        replica.close()
        primary.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=250)
    args = parser.parse_args()
    timings = run(args.rounds, args.block)
    medians = {name: statistics.median(ns) / 1000 for name, ns in timings.items()}
    print(f"{'variant':<32} {'median µs':>10} {'p99 µs':>10} {'cycles':>8}")
    for name, ns in timings.items():
        p99 = statistics.quantiles(ns, n=100)[98] / 1000
        print(f"{name:<32} {medians[name]:>10.1f} {p99:>10.1f} {len(ns):>8}")
    for name in ("pooled", "per-thread"):
        extra = medians[f"{name}, min_replicas=1"] - medians[f"{name}, min_replicas=0"]
        print(f"WAIT adds {extra:.1f} µs to the median cycle ({name} connections)")


if __name__ == "__main__":
    main()
