"""The demo's jobs: the messages it sends, and the attempts its workers record in Redis."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import redis

from .console import Console
from .settings import ACTOR_NAME, QUEUE_NAME


@dataclass
class Attempt:
    """One run of a job, as the actor recorded it."""

    key: str
    job: int
    fence: int
    message_id: str
    pid: int
    start_ms: int
    end_ms: int | None = None
    outcome: str = "running"


class Jobs:
    """Every message the demo sent, and every attempt read back from the workers' events list."""

    def __init__(self, events_key: str, per_invoice: int, console: Console) -> None:
        self.events_key = events_key
        self.per_invoice = per_invoice
        self.console = console
        #: Message id -> (invoice, job).
        self.messages: dict[str, tuple[int, int]] = {}
        self.attempts: list[Attempt] = []
        self.events_read = 0

    def send(self, client: redis.Redis, namespace: str, invoices: int, job_seconds: float) -> None:
        """Enqueue ``per_invoice`` jobs of ``job_seconds`` for each of ``invoices`` invoices."""
        from dramatiq import Message
        from dramatiq.brokers.redis import RedisBroker

        broker = RedisBroker(  # type: ignore[no-untyped-call]
            client=client, namespace=namespace, middleware=[]
        )
        for job in range(self.per_invoice):
            for invoice in range(1, invoices + 1):
                message = broker.enqueue(
                    Message(
                        queue_name=QUEUE_NAME,
                        actor_name=ACTOR_NAME,
                        args=(invoice, job, job_seconds),
                        kwargs={},
                        options={},
                    )
                )
                self.messages[message.message_id] = (invoice, job)

    def read(self, client: redis.Redis, label: Callable[[int], str], killed_pid: int | None) -> None:
        """Read the events recorded since the last call, and tell each one.

        ``label`` names a worker process; ``killed_pid`` is the process the demo killed, if any.
        """
        raw = client.lrange(self.events_key, self.events_read, -1)
        self.events_read += len(raw)
        for item in raw:
            e = json.loads(item)
            key = f"invoice:{e['invoice']}"
            job = f"job {e['job'] + 1}/{self.per_invoice}"
            if e["event"] == "start":
                self.attempts.append(Attempt(key, e["job"], e["fence"], e["message_id"], e["pid"], e["t_ms"]))
                again = "  <- a killed job, redelivered" if e["message_id"] in self.killed_messages(killed_pid) else ""
                self.console.say(f"{key}  fence {e['fence']}  {job} started on {label(e['pid'])}{again}")
                continue
            for attempt in self.attempts:
                if attempt.message_id == e["message_id"] and attempt.fence == e["fence"]:
                    attempt.end_ms, attempt.outcome = e["t_ms"], e["event"]
            if e["event"] == "done":
                self.console.say(f"{key}  fence {e['fence']}  {job} done")
            else:
                self.console.say(f"{key}  fence {e['fence']}  {job} FAILED: {e.get('error')}; Dramatiq retries it")

    def killed_messages(self, pid: int | None) -> set[str]:
        """Messages whose job was running in the killed process ``pid``: started there, never ended."""
        if pid is None:
            return set()
        return {a.message_id for a in self.attempts if a.pid == pid and a.end_ms is None}

    def done_ids(self) -> set[str]:
        """Messages of which some attempt completed."""
        return {a.message_id for a in self.attempts if a.outcome == "done"}
