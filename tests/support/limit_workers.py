"""The worker fleet of the ``lock_limit`` tests: `dramatiq tests.apps.limit_app` processes on one broker, with
leases and records on a private Redis (:class:`LimitWorkers`; the ``workers`` fixture of tests/conftest.py
gives one per broker), the sends they take (:func:`call`) and how many ran at once (:func:`most_at_once`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import redis

from dramatiq_leases import Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .brokers import RABBITMQ_URL, delete_rabbitmq_queues, redis_dead_letters, unique_queue
from .processes import http_get
from .waiting import wait_for

ROOT = Path(__file__).parents[2]
#: The lease TTL of every actor of tests/apps/limit_app.py (s).
TTL = 2.0
#: How many holder actors the app has, each on a queue of its own.
HOLDERS = 3

T = TypeVar("T")


def call(
    actor: str, *args: Any, pause: float = 0.0, kwargs: dict[str, Any] | None = None, **options: Any
) -> dict[str, Any]:
    """One send for :meth:`LimitWorkers.send`: the actor, its arguments, its message options, a pause after it."""
    return {"actor": actor, "args": args, "kwargs": kwargs or {}, "options": options, "pause": pause}


class LimitWorkers:
    """`dramatiq tests.apps.limit_app` processes on one broker, with leases and records on a private Redis."""

    def __init__(self, broker: str, server: EmbeddedRedis, tmp_path: Path) -> None:
        self.broker = broker
        self.server = server
        self.tmp_path = tmp_path
        self.queue = unique_queue("limit")
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "LIMIT_TEST_BROKER_URL": RABBITMQ_URL if broker == "rabbitmq" else server.url(0),
            "LIMIT_TEST_LEASES_URL": server.url(1),
            "LIMIT_TEST_RECORD_URL": server.url(2),
            "LIMIT_TEST_QUEUE": self.queue,
            "DRAMATIQ_LEASES_METRICS_HOST": "127.0.0.1",
            "DRAMATIQ_LEASES_METRICS_DIR": str(tmp_path / "metrics"),
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.metrics_port = 0  # the endpoint of the last start (all share one metrics directory)
        self.record = redis.Redis.from_url(server.url(2))
        self.leases_client = redis.Redis.from_url(server.url(1))
        self.leases = Leases(self.leases_client)

    def start(
        self, processes: int = 1, threads: int = 4, *, holder: int | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Workers of the jobs' queue, or (``holder``) of that holder's queue only; ``env``: more variables."""
        log = open(self.tmp_path / f"worker-{len(self.procs)}.log", "wb")  # noqa: SIM115 (the child keeps it)
        self.metrics_port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dramatiq",
                "tests.apps.limit_app",
                "--processes",
                str(processes),
                "--threads",
                str(threads),
                "--queues",
                self.queue if holder is None else f"{self.queue}-hold{holder}",
            ],
            cwd=ROOT,
            env={**self.env, **(env or {}), "DRAMATIQ_LEASES_METRICS_PORT": str(self.metrics_port)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def send(self, calls: list[dict[str, Any]]) -> None:
        """Send ``calls`` from one process (see ``limit_app.send_calls``)."""
        code = "import sys, json; from tests.apps.limit_app import send_calls; send_calls(json.loads(sys.argv[1]))"
        subprocess.run([sys.executable, "-c", code, json.dumps(calls)], cwd=ROOT, env=self.env, check=True)

    def hold(self, key: str, count: int, *, limit: int = 1, seconds: float = 60.0) -> list[dict[str, Any]]:
        """Start ``count`` holders of ``key``, each in a worker process of its own; their "holding" records."""
        for i in range(count):
            self.start(threads=1, holder=i)
        self.send([call(f"hold{i}", key, seconds, lock_limit=limit) for i in range(count)])
        return self.wait_runs(count, "holding")

    def wait_runs(
        self, count: int, kind: str = "run", *, where: Callable[[dict[str, Any]], bool] = bool, timeout: float = 30.0
    ) -> list[dict[str, Any]]:
        """Wait until at least ``count`` records of ``kind`` (those ``where`` accepts); all those records."""

        def found() -> list[dict[str, Any]] | None:
            runs = [r for r in self.runs(kind) if where(r)]
            return runs if len(runs) >= count else None

        return self.wait(found, timeout=timeout, what=f"{count} records of kind {kind!r}")

    def wait(self, predicate: Callable[[], T | None], *, timeout: float, what: str, about: Sequence[str] = ()) -> T:
        """Poll ``predicate`` until it answers something truthy; at the deadline, fail with the logs as they are
        then and what was recorded of the messages ``about``."""
        return cast(T, wait_for(predicate, timeout, 0.02, what, details=lambda: f"{self.trail(about)}{self.logs()}"))

    def trail(self, message_ids: Sequence[str]) -> str:
        """What was recorded of each of ``message_ids``: enqueues, first delivery, acks, nacks, log lines."""
        enqueues, delivered, lines = self.enqueues(), self.delivered(), self.log_lines()
        acks, nacks = self.acks(), self.nacks()
        return "".join(
            f"{m}: {enqueues.get(m, 0)} enqueues, delivered at {delivered.get(m)}, acks at "
            f"{[a['at'] for a in acks if a['message_id'] == m]}, nacks at {[a['at'] for a in nacks if a['message_id'] == m]}\n"
            + "".join(f"  {line}\n" for line in lines if m in line)
            for m in message_ids
        )

    def release(self, key: str) -> None:
        """Tell the holders of ``key`` to end."""
        self.record.set(f"release:{key}", 1)

    def runs(self, kind: str = "run") -> list[dict[str, Any]]:
        return [r for r in (json.loads(x) for x in self.record.lrange("runs", 0, -1)) if r["kind"] == kind]

    def _events(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.record.lrange(name, 0, -1)]

    def sent(self) -> list[dict[str, Any]]:
        return self._events("sent")

    def acks(self) -> list[dict[str, Any]]:
        return self._events("acks")

    def nacks(self) -> list[dict[str, Any]]:
        return self._events("nacks")

    def delivered(self) -> dict[str, float]:
        # A client without decode_responses answers bytes, which redis-py's return type does not narrow to.
        return {cast(bytes, k).decode(): float(v) for k, v in self.record.hgetall("delivered").items()}

    def enqueues(self) -> dict[str, int]:
        return {cast(bytes, k).decode(): int(v) for k, v in self.record.hgetall("enqueues").items()}

    def settled(self, message_ids: list[str]) -> bool:
        """Whether each message's every enqueue was delivered and acknowledged (or dead-lettered)."""
        enqueues = self.enqueues()
        done: dict[str, int] = {}
        for event in self.acks() + self.nacks():
            done[event["message_id"]] = done.get(event["message_id"], 0) + 1
        return all(done.get(m, 0) >= enqueues.get(m, 1) for m in message_ids)

    def dead_letters(self, queue: str | None = None) -> list[str]:
        """The ids of the messages in the dead-letter queue of ``queue`` (default the jobs' queue)."""
        queue = queue or self.queue
        if self.broker == "redis":
            return [m.message_id for m in redis_dead_letters(self.server, queue)]
        import dramatiq
        import pika
        import pika.exceptions

        connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
        try:
            channel = connection.channel()
            ids: list[str] = []
            while True:  # unacknowledged: back in the queue when the connection closes
                method, _, body = channel.basic_get(f"{queue}.XQ", auto_ack=False)
                if method is None or body is None:
                    return ids
                ids.append(dramatiq.Message.decode(body).message_id)
        except pika.exceptions.ChannelClosedByBroker:  # NOT_FOUND: nothing was dead-lettered yet
            return []
        finally:
            if connection.is_open:
                connection.close()

    def metrics(self) -> str | None:
        """The exposition of the last started worker's lease metrics endpoint (``None`` until it answers)."""
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def log_lines(self) -> list[str]:
        """Every line of every worker log."""
        return [
            line
            for p in sorted(self.tmp_path.glob("worker-*.log"))
            for line in p.read_text(errors="replace").splitlines()
        ]

    def logs(self) -> str:
        """The end of each worker log (but the stop budget's warnings at boot), for a failure message."""
        return "\n".join(
            "\n".join(line for line in p.read_text(errors="replace").splitlines() if "stop_budget" not in line)[-3000:]
            for p in sorted(self.tmp_path.glob("worker-*.log"))
        )

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.record.close()
        self.leases_client.close()
        if self.broker == "rabbitmq":
            delete_rabbitmq_queues(self.queue, *(f"{self.queue}-hold{i}" for i in range(HOLDERS)))


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most of ``spans`` (start, end) open at one instant; one ending when another starts is not overlap."""
    events = sorted([(end, -1) for _, end in spans] + [(start, 1) for start, _ in spans])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak
