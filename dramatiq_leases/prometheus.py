"""Metrics: the core's :class:`LeaseMetrics` interface, implemented for Prometheus and OpenTelemetry.

The interface lives in :mod:`dramatiq_leases.core.metrics` (re-exported here,
with the histogram buckets both implementations share);
:class:`PrometheusMetrics` implements it with ``prometheus_client``, and
:class:`OTelMetrics` (:mod:`dramatiq_leases.otel_metrics`, re-exported here)
with an OpenTelemetry meter, under the same names. Labels
are ``actor_name`` and ``queue_name`` (taken from a lease's ``actor`` and
``queue`` metadata), never the lease key: keys are unbounded and often carry
user ids.

``prometheus_client`` is imported on first use, not at import time: in
Dramatiq's multiprocess mode the choice between in-process and shared-file
values is made when ``prometheus_client`` is imported, and that must happen
after ``PROMETHEUS_MULTIPROC_DIR`` is set at process boot.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from .core.metrics import (
    DURATION_BUCKETS,
    ERROR_OPERATIONS,
    LATENCY_BUCKETS,
    LOST_REASONS,
    NOT_RUN_REASONS,
    NULL_METRICS,
    RENEWAL_OUTCOMES,
    LeaseMetrics,
    Meta,
    labels_of,
)
from .otel_metrics import OTelMetrics

__all__ = [
    "DURATION_BUCKETS",
    "LATENCY_BUCKETS",
    "LOST_REASONS",
    "NOT_RUN_REASONS",
    "NULL_METRICS",
    "LeaseMetrics",
    "Meta",
    "OTelMetrics",
    "PrometheusMetrics",
    "labels_of",
]


def _enable_multiprocess_values() -> None:
    """Make metrics created from now on use shared files when ``PROMETHEUS_MULTIPROC_DIR`` is set.

    Someone may have imported ``prometheus_client`` before the variable was
    set (an app module importing it at the top); its value class was then
    fixed to in-process values, which the exposition would never see.
    """
    from prometheus_client import values

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and values.ValueClass.__name__ == "MutexValue":
        values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


_created: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_created_lock = threading.Lock()


def _create(reg: Any) -> dict[str, Any]:
    _enable_multiprocess_values()
    from prometheus_client import Counter, Gauge, Histogram

    actor = ["actor_name", "queue_name"]
    return {
        "acquire": Histogram(
            "dramatiq_lease_acquire_duration_seconds",
            "Time to ask Redis for a lease, by outcome (acquired, busy, error).",
            [*actor, "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ),
        "wait": Histogram(
            "dramatiq_lease_wait_duration_seconds",
            "Time from a message's first acquire attempt to acquisition: time lost to contention.",
            actor,
            buckets=DURATION_BUCKETS,
            registry=reg,
        ),
        "busy": Counter(
            "dramatiq_lease_busy_retries_total",
            "Messages sent back to the queue because their lease was busy.",
            actor,
            registry=reg,
        ),
        "handoff": Histogram(
            "dramatiq_lease_handoff_duration_seconds",
            "Time from a release to the grant of the same key to the next message waiting in its line.",
            actor,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ),
        "gave_up": Counter(
            "dramatiq_lease_gave_up_total",
            "Messages that exhausted their wait budget for a lease.",
            actor,
            registry=reg,
        ),
        "not_run": Counter(
            "dramatiq_lease_not_run_total",
            "Messages acknowledged or dead-lettered without running, by reason "
            "(skipped, failed, superseded, gave_up, duplicate).",
            [*actor, "reason"],
            registry=reg,
        ),
        "held": Gauge(
            "dramatiq_lease_held",
            "Leases held now.",
            actor,
            registry=reg,
            multiprocess_mode="livesum",
        ),
        "hold": Histogram(
            "dramatiq_lease_hold_duration_seconds",
            "How long leases were held.",
            actor,
            buckets=DURATION_BUCKETS,
            registry=reg,
        ),
        "renewals": Counter(
            "dramatiq_lease_renewals_total",
            "Lease renewals by outcome (ok, lost, error).",
            [*actor, "outcome"],
            registry=reg,
        ),
        "round": Histogram(
            "dramatiq_lease_renew_duration_seconds",
            "Duration of one heartbeat round renewing all due leases of a process.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ),
        "lost": Counter(
            "dramatiq_lease_lost_total",
            "Held leases lost, by reason (gone, stolen, unreachable, max_hold).",
            [*actor, "reason"],
            registry=reg,
        ),
        "redis_errors": Counter(
            "dramatiq_lease_redis_errors_total",
            "Redis errors by operation (acquire, renew, release, scan).",
            ["operation"],
            registry=reg,
        ),
    }


class PrometheusMetrics(LeaseMetrics):
    """:class:`LeaseMetrics` on ``prometheus_client`` (the names are listed in docs/reference.md).

    Parameters:
      registry: where to register; ``None`` for the default registry. In
        multiprocess mode values go to ``PROMETHEUS_MULTIPROC_DIR`` and any
        exposition that reads that directory serves them.
    """

    def __init__(self, registry: Any = None) -> None:
        self._registry = registry
        self._m: dict[str, Any] | None = None
        # Labelled children by (metric, *labels): labels() takes a lock and builds a key on every call,
        # and these are called per message. A lost race only looks one up twice (dict get/set are atomic).
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, name: str, *labels: str) -> Any:
        key = (name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._metrics()[name].labels(*labels)
        return child

    def _metrics(self) -> dict[str, Any]:
        if self._m is None:
            with _created_lock:
                if self._registry is None:
                    from prometheus_client import REGISTRY

                    self._registry = REGISTRY
                # A registry takes each name once: every instance on it shares the same metrics.
                if self._registry not in _created:
                    _created[self._registry] = _create(self._registry)
                self._m = _created[self._registry]
        return self._m

    def acquire(self, meta: Meta, outcome: str, seconds: float) -> None:
        self._child("acquire", *labels_of(meta), outcome).observe(seconds)

    def wait(self, meta: Meta, seconds: float) -> None:
        self._child("wait", *labels_of(meta)).observe(seconds)

    def busy_retry(self, meta: Meta) -> None:
        self._child("busy", *labels_of(meta)).inc()

    def gave_up(self, meta: Meta) -> None:
        self._child("gave_up", *labels_of(meta)).inc()

    def not_run(self, meta: Meta, reason: str) -> None:
        self._child("not_run", *labels_of(meta), reason).inc()

    def held(self, meta: Meta, delta: int) -> None:
        self._child("held", *labels_of(meta)).inc(delta)

    def handoff(self, meta: Meta, seconds: float) -> None:
        self._child("handoff", *labels_of(meta)).observe(seconds)

    def hold(self, meta: Meta, seconds: float) -> None:
        self._child("hold", *labels_of(meta)).observe(seconds)

    def renewal(self, meta: Meta, outcome: str) -> None:
        self._child("renewals", *labels_of(meta), outcome).inc()

    def renew_round(self, seconds: float) -> None:
        self._metrics()["round"].observe(seconds)

    def lost(self, meta: Meta, reason: str) -> None:
        self._child("lost", *labels_of(meta), reason).inc()

    def redis_error(self, operation: str) -> None:
        self._child("redis_errors", operation).inc()

    def declare(self, meta: Meta) -> None:
        m, labels = self._metrics(), labels_of(meta)
        for name in ("busy", "gave_up", "held"):
            m[name].labels(*labels)
        for outcome in RENEWAL_OUTCOMES:
            m["renewals"].labels(*labels, outcome)
        for reason in LOST_REASONS:
            m["lost"].labels(*labels, reason)
        for reason in NOT_RUN_REASONS:
            m["not_run"].labels(*labels, reason)
        self.declare_process()

    def declare_process(self) -> None:
        m = self._metrics()
        for operation in ERROR_OPERATIONS:
            m["redis_errors"].labels(operation)
