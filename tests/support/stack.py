"""An in-process Dramatiq stack for tests: a real broker, a real Worker, LeaseMiddleware on a real Redis."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Protocol

import dramatiq
from dramatiq import Worker
from dramatiq.actor import ActorDecorator
from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker
from dramatiq.middleware import Middleware

from dramatiq_leases import LeaseMiddleware, Leases


class Recorder(Middleware):
    """Records what happened to each message id: acks, nacks, enqueues (with their delay).

    Its hooks run on worker threads, where Dramatiq's asynchronous exceptions land: it takes only a plain
    lock, whose ``with`` an interruption cannot leave held (a ``Condition``'s Python-level ``__enter__``
    can), and :meth:`wait_settled` polls.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: list[str] = []
        self.nacked: list[str] = []
        self.enqueues: list[tuple[str, int | None, dict[str, Any]]] = []
        self.events: defaultdict[str, list[str]] = defaultdict(list)

    def after_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        with self.lock:
            self.acked.append(message.message_id)

    def after_nack(self, broker: dramatiq.Broker, message: Any) -> None:
        with self.lock:
            self.nacked.append(message.message_id)

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        with self.lock:
            self.enqueues.append((message.message_id, delay, dict(message.options)))

    def wait_settled(self, message_id: str, timeout: float = 20.0) -> str:
        """Wait until the message's last delivery was acked without a pending re-enqueue, or nacked."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if message_id in self.nacked:
                    return "nacked"
                sent = sum(1 for mid, _, _ in self.enqueues if mid == message_id)
                if sent and self.acked.count(message_id) >= sent:
                    return "acked"
            if time.monotonic() > deadline:
                raise AssertionError(f"message {message_id} not settled after {timeout}s")
            time.sleep(0.005)

    def delays(self, message_id: str) -> list[int]:
        """Delays of the message's re-enqueues, in order (its first send has none)."""
        return [d for mid, d, _ in self.enqueues if mid == message_id and d is not None]


def taking_over_broker(url: str) -> RedisBroker:
    """A broker for a worker taking over from one stopped in the test: it takes back within 3 s what the stopped
    worker's consumers had fetched but not handed out (Dramatiq's RedisBroker leaves that in the stopped worker's
    acks until its ``heartbeat_timeout``, 60 s by default; docs/guarantees.md)."""
    return RedisBroker(url=url, heartbeat_timeout=3_000, maintenance_chance=MAINTENANCE_SCALE)  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated


class Stack:
    """Broker + LeaseMiddleware + Recorder; call :meth:`start` once the actors are declared."""

    def __init__(
        self,
        broker_url: str,
        leases_url: str,
        *,
        threads: int = 4,
        broker: Any = None,
        middleware: LeaseMiddleware | None = None,
        queue: str = "default",
        **lease_options: Any,
    ) -> None:
        #: The queue its actors are declared on by :meth:`actor` unless they name one.
        self.queue = queue
        self.broker = broker or RedisBroker(url=broker_url)  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
        self.recorder = Recorder()
        self.leases_mw = middleware or LeaseMiddleware(redis_url=leases_url, **lease_options)
        self.broker.add_middleware(self.recorder)
        self.broker.add_middleware(self.leases_mw)
        self.leases = self.leases_mw.leases
        self.threads = threads
        self.worker: Worker | None = None

    def actor(self, **options: Any) -> ActorDecorator:
        return dramatiq.actor(broker=self.broker, **{"queue_name": self.queue, **options})

    def not_run(self, actor: str, reason: str) -> float:
        """``dramatiq_lease_not_run_total`` of ``actor`` on this stack's queue for ``reason`` (its middleware's
        metrics must be a ``PrometheusMetrics`` of a registry of its own)."""
        registry = self.leases_mw.metrics._registry  # type: ignore[attr-defined]  # the test's own registry
        labels = {"actor_name": actor, "queue_name": self.queue, "reason": reason}
        return registry.get_sample_value("dramatiq_lease_not_run_total", labels) or 0.0

    def start(self) -> Stack:
        self.broker.emit_after("process_boot")
        self.worker = Worker(self.broker, worker_threads=self.threads, worker_timeout=20)
        self.worker.start()
        return self

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop(timeout=10_000)
        self.broker.close()


class MakeStack(Protocol):
    """The ``make_stack`` fixtures: a started-later :class:`Stack` from its keyword options."""

    def __call__(self, **options: Any) -> Stack: ...


class MakeLeases(Protocol):
    """The ``make_leases`` fixture: a store on database ``db`` of the test's redis-server, from ``Leases`` options."""

    def __call__(self, db: int = 0, **options: Any) -> Leases: ...
