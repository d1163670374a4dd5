"""Dramatiq's own Prometheus middleware next to LeaseMiddleware: a busy lease is not a processed message.

A message whose lease is busy is skipped and comes back later (sent back, or parked in the key's
line). Dramatiq's ``Prometheus`` counts every skip as a processed message (``after_skip_message =
after_process_message``); LeaseMiddleware adjusts that instance so its requeues are invisible there.

Real ``dramatiq`` worker processes (``tests.apps.obs_app``, Dramatiq's middleware added before or
after LeaseMiddleware) run contended messages on one key, and Dramatiq's endpoint is scraped.
The other tests here drive a ``Prometheus`` instance directly, with metrics in a private registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Middleware
from dramatiq.middleware.prometheus import Prometheus
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dramatiq_leases import LeaseMiddleware
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.middleware.busy import REQUEUED_MARK, SKIP_MARK
from dramatiq_leases.middleware.options import ATTEMPTS_OPTION
from dramatiq_leases.middleware.waiting import LINE_OPTION

from .support.processes import (
    WORK_ACTOR,
    WORK_QUEUE,
    Processes,
    clean_env,
    dramatiq_argv,
    events,
    http_get,
    send,
    value,
    values,
    wait_until,
    worker_processes,
)

# --- real workers -----------------------------------------------------------------------------------


@pytest.mark.system
@pytest.mark.parametrize("placement", ["before", "after"], ids=["prometheus-added-first", "prometheus-added-last"])
def test_busy_skips_are_not_counted_as_processed_messages(
    placement: str, tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    total = 16
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    env = clean_env(
        OBS_BROKER_URL=redis_server.url(0),
        OBS_LEASES_URL=redis_server.url(1),
        OBS_PROMETHEUS=placement,
        dramatiq_prom_host="127.0.0.1",
        dramatiq_prom_port=str(port),
        dramatiq_prom_db=str(tmp_path / "dramatiq-prometheus"),
    )
    broker = RedisBroker(url=redis_server.url(0), middleware=[])  # type: ignore[no-untyped-call]
    client = redis.Redis.from_url(redis_server.url(0))
    leases_client = redis.Redis.from_url(redis_server.url(1))
    actor = {"actor_name": WORK_ACTOR, "queue_name": WORK_QUEUE}
    try:
        with Processes(tmp_path / "logs") as procs:
            procs.start("worker", dramatiq_argv(processes=2, threads=4, queues=[WORK_QUEUE]), env=env)
            wait_until(
                lambda: worker_processes(client) == 2 and http_get(url) is not None,
                timeout=30,
                what="2 worker processes and Dramatiq's metrics endpoint",
                procs=procs,
            )

            # All on one key at once: one runs, a few wait in place, the others are parked or sent back.
            for _ in range(total):
                send(broker, WORK_ACTOR, WORK_QUEUE, "invoice:1", 0.05)
            wait_until(
                lambda: sum(e["event"] == "done" for e in events(leases_client)) == total,
                timeout=60,
                what=f"{total} messages to run",
                procs=procs,
            )
            assert [e for e in events(leases_client) if e["event"] != "start" and e["event"] != "done"] == []

            def counted() -> str | None:
                # Dramatiq counts a message after it ran (after_process_message): wait until all
                # are in. Without the fix, the skips alone reach the total long before.
                text = http_get(url)
                if text and value(text, "dramatiq_messages_total", **actor) >= total:
                    return text
                return None

            text = wait_until(counted, timeout=20, what=f"{total} messages counted on {url}", procs=procs)
            # Dramatiq logs a failing hook and goes on: none may fail (critical: "Unexpected failure in ...").
            log = (tmp_path / "logs" / "worker.log").read_text(errors="replace")
            assert "Unexpected failure" not in log, procs.report()
    finally:
        broker.close()
        client.close()
        leases_client.close()

    busy_retries = value(text, "dramatiq_lease_busy_retries_total", **actor)
    assert busy_retries > 0, "the messages must have contended (skips sent back or parked)"
    # Each message counted once, when it ran; the busy skips were not.
    assert value(text, "dramatiq_messages_total", **actor) == total
    assert value(text, "dramatiq_message_duration_milliseconds_count", **actor) == total
    assert value(text, "dramatiq_message_errors_total", **actor) == 0
    # Nothing is left in progress (Prometheus after LeaseMiddleware: never decremented below zero).
    assert value(text, "dramatiq_messages_inprogress", **actor) == 0
    # Every parked or sent-back copy left the delay queue of the process that held it: no series is
    # left above zero (a copy run by the other process) or below it (Dramatiq's label mismatch).
    delayed = values(text, "dramatiq_delayed_messages_inprogress", actor_name=WORK_ACTOR)
    assert delayed and all(v == 0 for v in delayed), delayed


# --- the adjusted hooks, driven directly -------------------------------------------------------------


class Message:
    """What Dramatiq's Prometheus hooks read of a message."""

    def __init__(self, message_id: str, queue_name: str = "q", options: dict[str, Any] | None = None) -> None:
        self.message_id = message_id
        self.queue_name = queue_name
        self.actor_name = "a"
        self.options = options or {}


class Later(Middleware):
    """Another middleware: its after_skip_message must still run."""

    def __init__(self) -> None:
        self.skipped: list[str] = []

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        self.skipped.append(message.message_id)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def prometheus(registry: CollectorRegistry) -> Prometheus:
    """Dramatiq's middleware with its metrics as after_process_boot makes them, in a private registry
    (its own hook would switch this test process to multiprocess mode)."""
    prom = Prometheus()
    labels = ["queue_name", "actor_name"]
    prom.total_messages = Counter("dramatiq_messages_total", "", labels, registry=registry)
    prom.total_errored_messages = Counter("dramatiq_message_errors_total", "", labels, registry=registry)
    prom.total_retried_messages = Counter("dramatiq_message_retries_total", "", labels, registry=registry)
    prom.total_rejected_messages = Counter("dramatiq_message_rejects_total", "", labels, registry=registry)
    prom.inprogress_messages = Gauge("dramatiq_messages_inprogress", "", labels, registry=registry)
    prom.inprogress_delayed_messages = Gauge("dramatiq_delayed_messages_inprogress", "", labels, registry=registry)
    prom.message_durations = Histogram("dramatiq_message_duration_milliseconds", "", labels, registry=registry)
    return prom


@pytest.fixture
def lease_mw(redis_server: EmbeddedRedis) -> Iterator[LeaseMiddleware]:
    yield LeaseMiddleware(redis_url=redis_server.url(0), metrics_endpoint=False)


def sample(registry: CollectorRegistry, name: str, queue_name: str = "q") -> float:
    got = registry.get_sample_value(name, {"queue_name": queue_name, "actor_name": "a"})
    return 0.0 if got is None else got


def booted(order: list[Middleware]) -> StubBroker:
    broker = StubBroker(middleware=[])
    for middleware in order:
        broker.add_middleware(middleware)
    for middleware in order:
        if isinstance(middleware, LeaseMiddleware):
            middleware.dramatiq_prometheus.adjust(broker)
    return broker


def skip(broker: StubBroker, message: Message, *, prometheus_before: bool) -> None:
    """One skipped delivery as Dramatiq's worker runs it: the before-hooks up to the one that skips."""
    if prometheus_before:
        for middleware in broker.middleware:
            if isinstance(middleware, Prometheus):
                middleware.before_process_message(broker, message)  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    broker.emit_after("skip_message", message)


@pytest.mark.parametrize("prometheus_first", [True, False])
def test_a_requeue_is_neither_counted_nor_left_in_progress(
    registry: CollectorRegistry, lease_mw: LeaseMiddleware, prometheus_first: bool
) -> None:
    prom, later = prometheus(registry), Later()
    broker = booted([prom, lease_mw, later] if prometheus_first else [lease_mw, prom, later])
    message = Message("m1", options={SKIP_MARK: True, REQUEUED_MARK: True})
    skip(broker, message, prometheus_before=prometheus_first)
    assert sample(registry, "dramatiq_messages_total") == 0
    assert sample(registry, "dramatiq_message_duration_milliseconds_count") == 0
    assert sample(registry, "dramatiq_messages_inprogress") == 0
    assert prom.message_start_times == {}
    assert later.skipped == ["m1"], "the other middlewares' after_skip_message still run"


@pytest.mark.parametrize("prometheus_first", [True, False])
def test_a_final_skip_is_counted_once_and_not_left_in_progress(
    registry: CollectorRegistry, lease_mw: LeaseMiddleware, prometheus_first: bool
) -> None:
    # Dropped (given up, or a copy of a message that ran): done, so counted, as Dramatiq counts skips.
    prom = prometheus(registry)
    broker = booted([prom, lease_mw] if prometheus_first else [lease_mw, prom])
    skip(broker, Message("m1", options={SKIP_MARK: True}), prometheus_before=prometheus_first)
    assert sample(registry, "dramatiq_messages_total") == 1
    assert sample(registry, "dramatiq_message_duration_milliseconds_count") == 1
    assert sample(registry, "dramatiq_messages_inprogress") == 0
    assert prom.message_start_times == {}


def test_skips_of_other_middleware_are_left_to_dramatiq(registry: CollectorRegistry, lease_mw: LeaseMiddleware) -> None:
    prom = prometheus(registry)
    broker = booted([prom, lease_mw])
    skip(broker, Message("m1"), prometheus_before=True)
    assert sample(registry, "dramatiq_messages_total") == 1
    assert sample(registry, "dramatiq_messages_inprogress") == 0


def test_adjusting_twice_wraps_once(registry: CollectorRegistry, lease_mw: LeaseMiddleware) -> None:
    prom = prometheus(registry)
    broker = booted([prom, lease_mw])
    hook = prom.after_skip_message
    lease_mw.dramatiq_prometheus.adjust(broker)
    assert prom.after_skip_message == hook


def test_a_copy_of_ours_leaves_the_delay_queue_where_it_entered(
    registry: CollectorRegistry, lease_mw: LeaseMiddleware
) -> None:
    prom = prometheus(registry)
    broker = booted([prom, lease_mw])

    @dramatiq.actor(broker=broker, lock_key="k")
    def leased() -> None:
        pass

    def delayed(queue_name: str) -> float | None:
        return registry.get_sample_value(
            "dramatiq_delayed_messages_inprogress", {"queue_name": queue_name, "actor_name": "leased"}
        )

    ours = {ATTEMPTS_OPTION: 1, LINE_OPTION: "k"}
    parked = Message("m1", queue_name="q.DQ", options={**ours, "eta": 1})
    parked.actor_name = "leased"
    prom.before_delay_message(broker, parked)  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    assert delayed("q.DQ") == 1
    # Sent on to its queue (as Dramatiq does when its eta passes), to be run by any process: this
    # one no longer holds it, whoever runs it.
    fresh: dramatiq.Message[Any] = dramatiq.Message(
        queue_name="q", actor_name="leased", args=(), kwargs={}, options=dict(ours), message_id="m1"
    )
    broker.emit_before("enqueue", fresh, None)
    assert delayed("q.DQ") == 0
    assert prom.delayed_messages == set()
    # Run here after all: nothing more to take off (Dramatiq would take it off under label "q").
    prom.before_process_message(broker, fresh)  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    assert delayed("q") is None

    # A parked copy dropped by the line (its message ran): taken off too.
    prom.before_delay_message(broker, parked)  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    assert delayed("q.DQ") == 1
    assert lease_mw.waiting.on_drop is not None
    lease_mw.waiting.on_drop(parked)
    assert delayed("q.DQ") == 0

    # Someone else's delayed message is left to Dramatiq.
    other = Message("m2", queue_name="q.DQ", options={"eta": 1})
    other.actor_name = "leased"
    prom.before_delay_message(broker, other)  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    broker.emit_before(
        "enqueue",
        dramatiq.Message(queue_name="q", actor_name="leased", args=(), kwargs={}, options={}, message_id="m2"),
        None,
    )
    assert delayed("q.DQ") == 1


def test_our_copies_are_not_counted_as_retries(registry: CollectorRegistry, lease_mw: LeaseMiddleware) -> None:
    prom = prometheus(registry)
    broker = booted([prom, lease_mw])
    # A message retried once (Retries) then sent back by the lease: a copy, not a retry.
    broker.emit_after("enqueue", Message("m1", options={"retries": 1, ATTEMPTS_OPTION: 1}), 100)
    assert sample(registry, "dramatiq_message_retries_total") == 0
    broker.emit_after("enqueue", Message("m1", options={"retries": 1}), 100)
    assert sample(registry, "dramatiq_message_retries_total") == 1
