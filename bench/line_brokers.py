"""The wait line on both brokers: handoff and enqueues per message through real workers.

``python -m bench.line_brokers`` (needs RabbitMQ on 127.0.0.1:5672, guest/guest, and redis-server): 2
worker processes x 8 threads of ``tests/apps/line_app.py`` (Dramatiq's defaults otherwise) run K jobs on
one key, sent at once, on the Redis and on the RabbitMQ broker; one JSON line per run. Figure 6 measures
the Redis broker inside the harness; this is the RabbitMQ side of the same question, kept outside the
harness because the harness's workers run on the Redis broker only.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from dramatiq_leases.embedded import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parents[1]
RABBITMQ_URL = os.environ.get("LEASES_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
#: (K, job seconds) of each run, per broker.
RUNS = ((50, 0.1), (200, 0.1), (6, 5.0))


def _delete_queues(queue: str) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    channel = connection.channel()
    for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
        channel.queue_delete(name)
    connection.close()


def run(broker: str, k: int, seconds: float) -> dict[str, Any]:
    """K jobs of ``seconds`` on one key through 2 x 8 workers on ``broker``; the figures of the run."""
    server = EmbeddedRedis().start()
    queue = f"line-brokers-{uuid.uuid4().hex[:6]}"
    tmp = Path(tempfile.gettempdir())
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LINE_TEST_BROKER_URL": RABBITMQ_URL if broker == "rabbitmq" else server.url(0),
        "LINE_TEST_LEASES_URL": server.url(1),
        "LINE_TEST_RECORD_URL": server.url(2),
        "LINE_TEST_QUEUE": queue,
        "DRAMATIQ_LEASES_METRICS_PORT": str(free_port()),
        "DRAMATIQ_LEASES_METRICS_DIR": str(tmp / queue),
    }
    with open(tmp / f"{queue}.log", "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dramatiq",
                "tests.apps.line_app",
                "--processes",
                "2",
                "--threads",
                "8",
                "--queues",
                queue,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    record = redis.Redis.from_url(server.url(2))
    try:
        time.sleep(3)  # both processes up and polling, as in figure 6
        code = "import sys, json; from tests.apps.line_app import job\nfor a in json.loads(sys.argv[1]): job.send(*a)"
        calls = json.dumps([("hot", i, seconds) for i in range(k)])
        subprocess.run([sys.executable, "-c", code, calls], cwd=ROOT, env=env, check=True)
        deadline = time.time() + k * seconds * 3 + 60
        while time.time() < deadline and record.llen("runs") < k:
            time.sleep(0.2)
        runs = sorted((json.loads(x) for x in record.lrange("runs", 0, -1)), key=lambda r: r["start"])
        gaps = sorted((b["start"] - a["end"]) * 1000 for a, b in itertools.pairwise(runs))
        enqueues = [int(v) for v in record.hgetall("enqueues").values()]
        firsts = [r["first"] for r in runs]
        return {
            "broker": broker,
            "k": k,
            "job_s": seconds,
            "done": len(runs),
            "makespan_ratio": round((runs[-1]["end"] - runs[0]["start"]) / (k * seconds), 3),
            "handoff_p50_ms": round(statistics.median(gaps), 2),
            "handoff_p99_ms": round(gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))], 2),
            "handoff_max_ms": round(max(gaps), 2),
            "enqueues_per_message": round(sum(enqueues) / k, 2),
            "first_attempt_inversions": sum(1 for a, b in itertools.combinations(firsts, 2) if a > b),
        }
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        record.close()
        server.close()
        if broker == "rabbitmq":
            _delete_queues(queue)


if __name__ == "__main__":
    for broker_name in ("redis", "rabbitmq"):
        for k_jobs, job_seconds in RUNS:
            print(json.dumps(run(broker_name, k_jobs, job_seconds)), flush=True)
