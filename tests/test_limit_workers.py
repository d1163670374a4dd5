"""Keys held by several at once (``lock_limit``) across real worker processes, on the Redis and the RabbitMQ broker.

Each test sends its jobs from a separate process and reads what the workers recorded (tests/apps/limit_app.py):
when each job started and ended, under which fence and holder slot, its first attempt, and what the broker did
with each message. Capacity is checked from those records: at no instant more than the limit run at once,
counting a SIGKILLed holder as running until its lease's TTL ended (read from Redis right after the kill).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import redis

from dramatiq_leases import Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.brokers import BROKERS, RABBITMQ_URL, delete_rabbitmq_queues, redis_dead_letters, unique_queue
from .support.processes import http_get

pytestmark = pytest.mark.system

ROOT = Path(__file__).parents[1]
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
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.trail(about)}{self.logs()}")
            time.sleep(0.02)
        return value

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


@pytest.fixture(params=BROKERS)
def workers(request: pytest.FixtureRequest, redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[LimitWorkers]:
    w = LimitWorkers(request.param, redis_server, tmp_path)
    yield w
    w.stop()


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most of ``spans`` (start, end) open at one instant; one ending when another starts is not overlap."""
    events = sorted([(end, -1) for _, end in spans] + [(start, 1) for start, _ in spans])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def lease_ends(w: LimitWorkers, key: str) -> dict[int, float]:
    """Each holder of ``key`` now, by fence: when its lease ends (Unix time, s) if it is not renewed again."""
    return {info.fence: (info.now_ms + info.ttl_left) / 1000 for info in w.leases.holders(key)}


def each_ran(w: LimitWorkers, ns: list[int], key: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Wait until each of ``ns`` has a finished run on ``key``; those runs, by start."""

    def finished() -> list[dict[str, Any]] | None:
        runs = [r for r in w.runs() if r["key"] == key and r["n"] in ns]
        return runs if {r["n"] for r in runs} == set(ns) else None

    runs = w.wait(finished, timeout=timeout, what=f"{len(ns)} jobs of {key!r} to run")
    return sorted(runs, key=lambda r: r["start"])


def test_a_killed_holder_frees_exactly_its_slot(workers: LimitWorkers) -> None:
    """Three holders of a key held by three at once; one is SIGKILLed: its slot, and only it, frees at its TTL."""
    holding = workers.hold("cap", HOLDERS, limit=3)
    workers.start(threads=4)
    workers.send([call("job", "cap", i, 0.1, lock_limit=3) for i in range(6)])
    workers.wait(lambda: workers.leases.inspect_line("cap").length == 6, timeout=30, what="6 waiters in the line")
    victim, survivors = holding[1], [holding[0], holding[2]]
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.time()
    ends = lease_ends(workers, "cap")  # the victim's no longer moves: nobody renews it
    assert victim["fence"] in ends, "the victim's lease ended before it was read"

    runs = each_ran(workers, list(range(6)), "cap")
    assert runs[0]["start"] - killed <= TTL + 1.0, "no waiter started within TTL + 1 s of the kill"
    assert {r["slot"] for r in runs} == {victim["slot"]}, "a waiter ran in a slot other than the freed one"
    assert len({r["message_id"] for r in runs}) == len(runs) == 6, "a job ran twice"
    # The survivors kept theirs: still running, still holding, under the fences they started with.
    assert [r for r in workers.runs() if r["n"] == -1] == []
    assert {f for f in lease_ends(workers, "cap")} >= {s["fence"] for s in survivors}
    workers.release("cap")
    ended = workers.wait_runs(2, where=lambda r: r["n"] == -1)
    spans = [(r["start"], r["end"]) for r in runs + ended] + [(victim["start"], ends[victim["fence"]])]
    assert most_at_once(spans) <= 3, f"more than 3 at once: {sorted(spans)}"


def test_workers_restarted_at_once_wait_for_the_old_leases(workers: LimitWorkers) -> None:
    """All workers SIGKILLed mid-run and started again with 16 idle threads, new jobs waiting for them: the old
    holders' slots stay taken until their leases expire, and at no instant do more than 2 run."""
    # A TTL long enough for the new workers to boot and ask while the old leases still hold.
    jobs = [call("job", "restart", i, 0.3, lock_limit=2, lock_ttl=5_000) for i in range(12)]
    first = workers.start(processes=2, threads=8)
    workers.send(jobs[:6])
    workers.wait_runs(2, "start")
    os.killpg(first.pid, signal.SIGKILL)
    killed = time.time()
    ends = lease_ends(workers, "restart")
    assert len(ends) == 2, f"the key was not held by 2 at the kill: {ends}"
    workers.start(processes=2, threads=8)
    workers.send(jobs[6:])  # in the broker at once, whatever it redelivers of the killed workers' and when

    runs = each_ran(workers, list(range(12)), "restart")
    expired = min(ends.values())
    new_ids = [s["message_id"] for s in workers.sent() if s["args"][1] >= 6]
    asked = [m for m, at in workers.delivered().items() if m in new_ids and at < expired]
    assert asked, "no restarted worker asked before the old leases expired: this test proved nothing"
    finished = {r["fence"] for r in runs}
    cut = [r for r in workers.runs("start") if r["fence"] not in finished]  # the runs the kill cut short
    assert {r["fence"] for r in cut} <= set(ends), f"a run cut short without a lease at the kill: {cut}"
    after = [r for r in runs if r["start"] > killed]
    early = [r for r in after if r["start"] < expired]
    assert early == [], f"{len(early)} jobs started before the old leases expired"
    assert min(r["start"] for r in after) - expired <= 1.0, "no restarted worker took a freed slot within 1 s"
    spans = [(r["start"], r["end"]) for r in runs] + [(r["start"], ends[r["fence"]]) for r in cut]
    assert most_at_once(spans) <= 2, f"more than 2 at once: {sorted(spans)}"


def test_jobs_of_one_key_run_three_at_a_time_in_first_attempt_order(workers: LimitWorkers) -> None:
    # Threads for the 3 running and for the front of the line to wait in place (half of each process's): with
    # fewer, a waiter called forward finds no thread, parks again, and costs two more enqueues.
    workers.start(processes=2, threads=6)
    workers.send([call("job", "fifo", i, 0.1, lock_limit=3) for i in range(30)])
    runs = each_ran(workers, list(range(30)), "fifo")
    assert len({r["message_id"] for r in runs}) == len(runs) == 30, "a job ran twice"
    assert most_at_once([(r["start"], r["end"]) for r in runs]) <= 3
    # Slots freed together go to the first waiters of the line together, and they start at their own pace: a
    # job may start before one that first tried just before it, but never while 3 such still wait.
    for order in ("fence", "start"):
        ranked = sorted(runs, key=lambda r: r[order])
        overtaken = {b["n"]: [a["n"] for a in ranked[i + 1 :] if a["first"] < b["first"]] for i, b in enumerate(ranked)}
        jumps = {n: earlier for n, earlier in overtaken.items() if len(earlier) >= 3}
        assert jumps == {}, f"by {order}, a job went before 3 or more that first tried before it: {jumps}"
    enqueues = workers.enqueues()
    assert sum(enqueues.values()) / 30 <= 3, f"enqueues per message: {sorted(enqueues.values())}"
    assert workers.leases.inspect_line("fifo").length == 0


def test_a_busy_key_does_not_delay_another(workers: LimitWorkers) -> None:
    """A thousand messages wait on key A; one message of key B, sent behind them on the same queue, starts at once."""
    workers.hold("A", 1)
    workers.start(threads=4)
    workers.send([call("job", "A", i, 0.0) for i in range(1_000)])
    workers.wait(lambda: workers.leases.inspect_line("A").length == 1_000, timeout=40, what="1000 waiters on A")
    workers.send([call("job", "B", 0, 0.0)])
    sent = workers.sent()[-1]["at"]
    (run,) = each_ran(workers, [0], "B", timeout=30)
    assert run["start"] - sent <= 1.0, f"B started {run['start'] - sent:.2f}s after it was sent"


def test_waiting_spends_no_retry_and_an_argument_by_name_or_position_is_one_key(workers: LimitWorkers) -> None:
    """``invoice`` has ``max_retries=0``: its messages wait their turn and all run. ``send(7)`` and
    ``send(invoice_id=7)`` render one key, so they never run at once."""
    workers.start(processes=2, threads=4)
    workers.send([call("invoice", 7) if i % 2 else call("invoice", kwargs={"invoice_id": 7}) for i in range(10)])
    runs = workers.wait_runs(10, timeout=60)
    assert {r["key"] for r in runs} == {"invoice:7"}
    assert len({r["message_id"] for r in runs}) == len(runs) == 10, "a message ran twice"
    spans = sorted((r["start"], r["end"]) for r in runs)
    assert most_at_once(spans) == 1, f"two runs of invoice 7 at once: {spans}"
    assert workers.nacks() == [] and workers.dead_letters() == [], "a waiting message was dead-lettered"
