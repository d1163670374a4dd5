"""Heartbeat rounds on a Redis Cluster: this package's per-node fan-out against redis-py's cluster pipeline.

``python -m bench.cluster_rounds [--leases N] [--rounds R]`` starts a 3-master cluster (no replicas;
``tests/support/cluster.py``), holds N leases on unrelated keys (spread over ~N slots), and times
``Leases.renew_many`` rounds two ways in alternation: as the package sends them (:mod:`dramatiq_leases.core.cluster`:
every node's calls written, then every node's replies read) and as redis-py's ``ClusterPipeline`` would (the
baseline, the package's previous code). Prints the median round of each. Then it stops one master with
``SIGSTOP`` (a hung node: its connections time out after the client's 0.5 s) and times one round each way; the
baseline's round is timed with 6 leases only (2 per master), as it retries the hung master slot by slot.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import statistics
import time
from collections.abc import Sequence
from typing import Any

from dramatiq_leases import Lease, Leases
from dramatiq_leases.core import cluster as fan_out
from tests.support.cluster import RedisClusterNodes


def pipeline_run(client: Any, script: Any, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
    """The baseline: the same calls as one redis-py cluster pipeline."""
    pipe = client.pipeline()
    for keys, args in calls:
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    replies: list[Any] = list(pipe.execute(raise_on_error=False))
    failures = [r for r in replies if isinstance(r, Exception)]
    if failures and len(failures) == len(replies):
        raise failures[0]
    return [None if isinstance(r, Exception) else r for r in replies]


def timed_round(leases: Leases, held: Sequence[Lease], baseline: bool) -> float:
    original = fan_out.run
    if baseline:
        fan_out.run = pipeline_run  # type: ignore[assignment]
    try:
        started = time.perf_counter()
        with contextlib.suppress(Exception):  # every node failed: still a round, timed
            leases.renew_many(held)
        return time.perf_counter() - started
    finally:
        fan_out.run = original  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_rounds", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    opts = parser.parse_args(argv)
    with RedisClusterNodes(masters=3, replicas=0) as nodes:
        for port in nodes.masters():  # the healthy masters keep serving once the hung one is marked FAIL
            nodes.node(port).config_set("cluster-require-full-coverage", "no")
        leases = Leases(nodes.client(socket_timeout=0.5, socket_connect_timeout=0.5))
        held = [leases.try_acquire(f"bench:{i}", 60_000) for i in range(opts.leases)]
        assert all(isinstance(lease, Lease) for lease in held)
        held_leases = [lease for lease in held if isinstance(lease, Lease)]
        times: dict[bool, list[float]] = {False: [], True: []}
        for n in range(opts.rounds):
            for baseline in (n % 2 == 0, n % 2 == 1):
                times[baseline].append(timed_round(leases, held_leases, baseline))
        ours, theirs = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"{opts.leases} leases, median of {opts.rounds} rounds: fan-out {ours * 1000:.1f} ms, "
            f"cluster pipeline {theirs * 1000:.1f} ms ({theirs / ours:.2f}x)"
        )

        victim = nodes.masters()[0]
        few = nodes.spread(leases.lease_name, 2, (f"few:{i}" for i in itertools.count()))
        few_held = [leases.try_acquire(key, 60_000) for key in itertools.chain(*few.values())]
        server = next(node for node in nodes.nodes if node.port == victim)
        assert server.process is not None
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            hung_ours = timed_round(leases, held_leases, baseline=False)
            hung_theirs = timed_round(leases, [lease for lease in few_held if isinstance(lease, Lease)], baseline=True)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        print(
            f"one master hung (socket timeout 0.5 s): fan-out, {opts.leases} leases: {hung_ours:.2f} s; "
            f"cluster pipeline, 6 leases: {hung_theirs:.2f} s"
        )
        leases.client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
