"""Real `dramatiq` worker processes: mutual exclusion across processes, SIGKILL and SIGTERM."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from dramatiq_leases import Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.waiting import wait_for

pytestmark = pytest.mark.system

ROOT = Path(__file__).parents[1]


class Workers:
    """`dramatiq tests.apps.lease_app` instances on a private Redis."""

    def __init__(self, server: EmbeddedRedis, tmp_path: Path) -> None:
        self.server = server
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "LEASES_TEST_BROKER_URL": server.url(0),
            "LEASES_TEST_LEASES_URL": server.url(1),
            "DRAMATIQ_LEASES_METRICS_DIR": str(tmp_path / "metrics"),
        }
        self.record = redis.Redis.from_url(server.url(0))
        self.leases = Leases.from_url(server.url(1))

    def start(self, processes: int, threads: int) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"worker-{len(self.procs)}.log", "wb")  # noqa: SIM115
        env = {**self.env, "DRAMATIQ_LEASES_METRICS_PORT": str(free_port())}
        proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "tests.apps.lease_app", "--processes", str(processes),
             "--threads", str(threads), "--worker-shutdown-timeout", "20000"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def send(self, actor: str, *args: Any) -> None:
        code = f"import sys, json; from tests.apps import lease_app as a; getattr(a, {actor!r}).send(*json.loads(sys.argv[1]))"
        subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=ROOT, env=self.env, check=True)

    def runs(self, kind: str | None = None) -> list[dict[str, Any]]:
        items = [json.loads(x) for x in self.record.lrange("runs", 0, -1)]
        return [i for i in items if kind is None or i["kind"] == kind]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def workers(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(redis_server, tmp_path)
    yield w
    w.stop()


def send_many(workers: Workers, actor: str, calls: list[tuple[Any, ...]]) -> None:
    code = (f"import sys, json; from tests.apps import lease_app as a\n"
            f"for args in json.loads(sys.argv[1]): getattr(a, {actor!r}).send(*args)")
    subprocess.run([sys.executable, "-c", code, json.dumps(calls)], cwd=ROOT, env=workers.env, check=True)


def test_mutual_exclusion_across_processes_and_threads(workers: Workers) -> None:
    workers.start(processes=2, threads=4)
    keys = ["a", "b", "c", "d"]
    send_many(workers, "interval_job", [(key, 0.1) for key in keys for _ in range(6)])
    wait_for(lambda: len(workers.runs("interval")) == 24, timeout=60, what="24 jobs to finish")
    runs = workers.runs("interval")
    for key in keys:
        spans = sorted((r["start"], r["end"], r["fence"]) for r in runs if r["key"] == key)
        for a, b in itertools.pairwise(spans):
            assert a[1] <= b[0], f"two holders of {key!r} at once: {a} and {b}"
            assert a[2] < b[2], f"fences of {key!r} did not rise: {spans}"
    overlaps = [(x, y) for x, y in itertools.combinations(runs, 2)
                if x["key"] != y["key"] and x["start"] < y["end"] and y["start"] < x["end"]]
    assert overlaps, "different keys never ran in parallel"
    assert len({r["pid"] for r in runs}) == 2, "both worker processes took part"
    assert list(workers.leases.scan()) == []


def test_sigkilled_holder_lease_expires_and_the_job_runs_again(workers: Workers) -> None:
    workers.start(processes=1, threads=2)
    workers.start(processes=1, threads=2)
    workers.send("crash_job", "x")
    holder = wait_for(lambda: workers.runs("crash-holding"), timeout=30, what="the job to hold its lease")[0]
    info = workers.leases.inspect("crash:x")
    assert info is not None and int(info.meta["pid"]) == holder["pid"]
    os.kill(holder["pid"], signal.SIGKILL)  # no finally, no release: the seed's chaos test
    # Gone within its 2 s TTL (plus slack), with no manual step.
    wait_for(lambda: workers.leases.inspect("crash:x") is None, timeout=2.0 + 2.0, what="the orphaned lease to expire")
    done = wait_for(lambda: workers.runs("crash-done"), timeout=60, what="the redelivered job to complete")
    assert done[0]["fence"] > holder["fence"] and done[0]["pid"] != holder["pid"]


def test_sigterm_finishes_the_job_and_leaves_no_lease(workers: Workers) -> None:
    proc = workers.start(processes=1, threads=2)
    workers.send("slow_job", "y", 1.5)
    wait_for(lambda: workers.runs("slow-started"), timeout=30, what="the job to start")
    assert workers.leases.inspect("slow:y") is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert workers.runs("slow-done"), "the running job was allowed to finish"
    assert list(workers.leases.scan()) == []  # released on the way out, not left to expire
