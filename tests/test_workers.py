"""Real `dramatiq` worker processes: mutual exclusion across processes, SIGKILL and SIGTERM, on each broker.

Each test runs on the Redis broker (the test's private redis-server) and on RabbitMQ (a queue of its own on the
shared server, deleted afterwards). What differs: RabbitMQ redelivers a dead worker's unacknowledged messages as
soon as its connection drops (the Redis broker once the worker's heartbeat is 3 s old, see tests/apps/lease_app.py),
and keeps delayed messages (parked or sent-back copies) in a delay queue per queue (``<queue>.DQ``).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from dramatiq_leases import Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.brokers import BROKERS, RABBITMQ_URL, delete_rabbitmq_queues, rabbitmq_consumers, unique_queue
from .support.waiting import wait_for

pytestmark = pytest.mark.system

ROOT = Path(__file__).parents[1]

#: The lease TTL of every actor of tests/apps/lease_app.py, in seconds.
TTL = 2.0
#: How long after a worker's death its broker redelivers its unacknowledged messages, at most (s): RabbitMQ
#: at once, the Redis broker once the dead worker's heartbeat is 3 s old (its survivors look every second).
REDELIVERY = {"redis": 3.0 + 1.0, "rabbitmq": 0.0}


class Workers:
    """`dramatiq tests.apps.lease_app` instances on one broker, with leases and records on a private Redis."""

    def __init__(self, broker: str, server: EmbeddedRedis, tmp_path: Path) -> None:
        self.broker = broker
        self.server = server
        self.tmp_path = tmp_path
        self.queue = unique_queue("leases")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "LEASES_TEST_BROKER_URL": RABBITMQ_URL if broker == "rabbitmq" else server.url(0),
            "LEASES_TEST_LEASES_URL": server.url(1),
            "LEASES_TEST_RECORD_URL": server.url(0),
            "LEASES_TEST_QUEUE": self.queue,
            "DRAMATIQ_LEASES_METRICS_DIR": str(tmp_path / "metrics"),
        }
        self.record = redis.Redis.from_url(server.url(0))
        self.leases = Leases.from_url(server.url(1))

    def start(self, processes: int, threads: int, **env: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"worker-{len(self.procs)}.log", "wb")  # noqa: SIM115
        env = {**self.env, "DRAMATIQ_LEASES_METRICS_PORT": str(free_port()), **env}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dramatiq",
                "tests.apps.lease_app",
                "--processes",
                str(processes),
                "--threads",
                str(threads),
                "--worker-shutdown-timeout",
                "20000",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def consuming(self, processes: int) -> None:
        """Wait until ``processes`` worker processes consume the queue."""

        def count() -> int:
            if self.broker == "rabbitmq":
                return rabbitmq_consumers(self.queue)
            return int(self.record.zcard("dramatiq:__heartbeats__"))  # one broker, one heartbeat per process

        wait_for(
            lambda: count() >= processes,
            timeout=30,
            interval=0.1,
            what=f"{processes} worker processes to consume",
            details=self.logs,
        )

    def send(self, actor: str, *args: Any) -> None:
        code = f"import sys, json; from tests.apps import lease_app as a; getattr(a, {actor!r}).send(*json.loads(sys.argv[1]))"
        subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=ROOT, env=self.env, check=True)

    def runs(self, kind: str | None = None) -> list[dict[str, Any]]:
        items = [json.loads(x) for x in self.record.lrange("runs", 0, -1)]
        return [i for i in items if kind is None or i["kind"] == kind]

    def log(self, index: int) -> str:
        """The log of the ``index``-th :meth:`start`."""
        return (self.tmp_path / f"worker-{index}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.tmp_path.glob("worker-*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.record.close()
        if self.broker == "rabbitmq":
            delete_rabbitmq_queues(self.queue)


@pytest.fixture(params=BROKERS)
def workers(request: pytest.FixtureRequest, redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(request.param, redis_server, tmp_path)
    yield w
    w.stop()


def send_many(workers: Workers, actor: str, calls: list[tuple[Any, ...]]) -> None:
    code = (
        f"import sys, json; from tests.apps import lease_app as a\n"
        f"for args in json.loads(sys.argv[1]): getattr(a, {actor!r}).send(*args)"
    )
    subprocess.run([sys.executable, "-c", code, json.dumps(calls)], cwd=ROOT, env=workers.env, check=True)


def check_one_at_a_time(runs: list[dict[str, Any]], key: str) -> None:
    """The runs of ``key`` never overlap, and each was granted a higher fence than the one before."""
    spans = sorted((r["start"], r["end"], r["fence"]) for r in runs if r["key"] == key)
    for a, b in itertools.pairwise(spans):
        assert a[1] <= b[0], f"two holders of {key!r} at once: {a} and {b}"
        assert a[2] < b[2], f"fences of {key!r} did not rise: {spans}"


def test_mutual_exclusion_across_processes_and_threads(workers: Workers) -> None:
    workers.start(processes=2, threads=4)
    workers.consuming(2)
    # More keys than one process has threads: one process alone cannot take them all at once.
    keys = ["a", "b", "c", "d", "e", "f", "g", "h"]
    send_many(workers, "interval_job", [(key, 0.2) for key in keys for _ in range(3)])
    wait_for(lambda: len(workers.runs("interval")) >= 24, timeout=60, what="24 jobs to finish", details=workers.logs)
    runs = workers.runs("interval")
    assert len({r["message_id"] for r in runs}) == len(runs) == 24, "a message ran twice"
    for key in keys:
        check_one_at_a_time(runs, key)
    overlaps = [
        (x, y)
        for x, y in itertools.combinations(runs, 2)
        if x["key"] != y["key"] and x["start"] < y["end"] and y["start"] < x["end"]
    ]
    assert overlaps, "different keys never ran in parallel"
    assert len({r["pid"] for r in runs}) == 2, "both worker processes took part"
    # A run is recorded before its release, which is sent off the worker thread.
    wait_for(lambda: list(workers.leases.scan()) == [], timeout=5, what="the last leases to be released")
    assert all(workers.leases.inspect_line(f"k:{key}").length == 0 for key in keys)


def test_sigkilled_holder_lease_expires_and_the_job_runs_again(workers: Workers) -> None:
    workers.start(processes=1, threads=2)
    workers.start(processes=1, threads=2)
    workers.consuming(2)
    workers.send("crash_job", "x")
    holder = wait_for(lambda: workers.runs("crash-holding"), timeout=30, what="the job to hold its lease")[0]
    info = workers.leases.inspect("crash:x")
    assert info is not None and int(info.meta["pid"]) == holder["pid"]
    os.kill(holder["pid"], signal.SIGKILL)  # no finally, no release: the seed's chaos test
    killed = time.time()
    # Gone within its 2 s TTL (plus slack), with no manual step: expired, or already granted to the next
    # holder (on RabbitMQ the killed job itself, redelivered at once, waits for it in the key's line).
    wait_for(
        lambda: (i := workers.leases.inspect("crash:x")) is None or i.fence > holder["fence"],
        timeout=TTL + 2.0,
        what="the orphaned lease to expire",
    )
    done = wait_for(
        lambda: workers.runs("crash-done"), timeout=60, what="the redelivered job to complete", details=workers.logs
    )
    assert done[0]["fence"] > holder["fence"] and done[0]["pid"] != holder["pid"]
    assert done[0]["message_id"] == holder["message_id"], "the killed job ran again, not another"
    # Not before the orphaned lease ended (its key lives TTL ms past its last renewal, which preceded `info`
    # at the latest)...
    assert done[0]["acquired"] * 1000 >= info.renewed_ms + info.ttl, "the next holder started beside the killed one"
    # ... and soon after: as soon as the lease expired, or the broker redelivered the job if that is later.
    assert done[0]["start"] - killed <= max(TTL, REDELIVERY[workers.broker]) + 2.0, "the next holder came late"
    assert len(workers.runs("crash-done")) == 1
    wait_for(lambda: list(workers.leases.scan()) == [], timeout=5, what="the lease to be released")


def test_sigterm_finishes_the_job_and_leaves_no_lease(workers: Workers) -> None:
    proc = workers.start(processes=1, threads=2)
    workers.send("slow_job", "y", 1.5)
    wait_for(lambda: workers.runs("slow-started"), timeout=30, what="the job to start")
    assert workers.leases.inspect("slow:y") is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert workers.runs("slow-done"), "the running job was allowed to finish"
    assert list(workers.leases.scan()) == []  # released on the way out, not left to expire


def test_sigterm_with_waiters_releases_the_lease_and_loses_no_waiter(workers: Workers) -> None:
    """SIGTERM while a job holds its lease and others wait: the holder finishes and releases (its lease does
    not expire); the waiters are not lost and run after a restart.

    With 3 threads, one waiter waits in place (at most half the threads do) and the others are parked (delayed
    copies): even the head of the line, as a place past half would take the last thread the holder left free.
    The restarted worker boots slowly (a middleware's ``after_worker_boot`` takes a second): its delay-queue
    consumer receives the parked copies before LeaseMiddleware's ``after_worker_boot`` has run.
    """
    proc = workers.start(processes=1, threads=3)
    workers.send("gated_job", "z")
    holder = wait_for(
        lambda: workers.runs("gated-started"), timeout=30, what="the holder to start", details=workers.logs
    )[0]
    send_many(workers, "gated_job", [("z",)] * 4)
    wait_for(
        lambda: workers.leases.inspect_line("gated:z").length == 4,
        timeout=30,
        what="4 waiters in the line",
        details=lambda: f"{workers.leases.inspect_line('gated:z')}\n{workers.logs()}",
    )
    proc.send_signal(signal.SIGTERM)
    # The holder finishes during the shutdown: once the worker process has begun it, not before.
    wait_for(
        lambda: "Shutting down..." in workers.log(0), timeout=30, what="the shutdown to begin", details=workers.logs
    )
    workers.record.set("gate:z", 1)
    assert proc.wait(timeout=60) == 0, workers.logs()
    assert holder["message_id"] in {r["message_id"] for r in workers.runs("gated-done")}, "the holder did not finish"
    assert list(workers.leases.scan()) == [], "a lease was left to expire"
    fences = workers.leases.fence_state("gated:z")
    assert fences["released"] == fences["fence"] >= holder["fence"], f"the last grant was not released: {fences}"

    workers.start(processes=1, threads=2, LEASES_TEST_SLOW_BOOT="1")
    wait_for(
        lambda: len(workers.runs("gated-done")) >= 5, timeout=60, what="the 4 waiters to run", details=workers.logs
    )
    runs = workers.runs("gated-done")
    assert len({r["message_id"] for r in runs}) == len(runs) == 5, "a waiter was lost or ran twice"
    check_one_at_a_time(runs, "z")
    wait_for(lambda: workers.leases.inspect_line("gated:z").length == 0, timeout=15, what="the line to empty")
    # The last job records its run before it returns, and its release follows: waited for, not assumed.
    wait_for(lambda: not list(workers.leases.scan()), timeout=10, what="the last holder's release")
    assert not workers.leases.fence_state("gated:z").get("expired"), "a grant of the key ended by expiry"
