"""Metrics: the core's :class:`LeaseMetrics` interface, implemented for Prometheus and OpenTelemetry.

The interface lives in :mod:`dramatiq_leases.core.metrics` (re-exported here);
:class:`PrometheusMetrics` implements it with ``prometheus_client``. Labels
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

from .core.metrics import LOST_REASONS, NULL_METRICS, LeaseMetrics, Meta, labels_of

#: Buckets (seconds) for acquire, release and renewal round trips.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

#: Buckets (seconds) for waits and holds, which last as long as jobs do.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

__all__ = ["LOST_REASONS", "NULL_METRICS", "LeaseMetrics", "Meta", "OTelMetrics", "PrometheusMetrics", "labels_of"]


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
            [*actor, "outcome"], buckets=LATENCY_BUCKETS, registry=reg,
        ),
        "wait": Histogram(
            "dramatiq_lease_wait_duration_seconds",
            "Time from a message's first acquire attempt to acquisition: time lost to contention.",
            actor, buckets=DURATION_BUCKETS, registry=reg,
        ),
        "busy": Counter(
            "dramatiq_lease_busy_retries_total",
            "Messages sent back to the queue because their lease was busy.", actor, registry=reg,
        ),
        "handoff": Histogram(
            "dramatiq_lease_handoff_duration_seconds",
            "Time from a release to the grant of the same key to the next message waiting in its line.",
            actor, buckets=LATENCY_BUCKETS, registry=reg,
        ),
        "gave_up": Counter(
            "dramatiq_lease_gave_up_total",
            "Messages that exhausted their wait budget for a lease.", actor, registry=reg,
        ),
        "held": Gauge(
            "dramatiq_lease_held", "Leases held now.", actor, registry=reg, multiprocess_mode="livesum",
        ),
        "hold": Histogram(
            "dramatiq_lease_hold_duration_seconds",
            "How long leases were held.", actor, buckets=DURATION_BUCKETS, registry=reg,
        ),
        "renewals": Counter(
            "dramatiq_lease_renewals_total",
            "Lease renewals by outcome (ok, lost, error).", [*actor, "outcome"], registry=reg,
        ),
        "round": Histogram(
            "dramatiq_lease_renew_duration_seconds",
            "Duration of one heartbeat round renewing all due leases of a process.",
            buckets=LATENCY_BUCKETS, registry=reg,
        ),
        "lost": Counter(
            "dramatiq_lease_lost_total",
            "Held leases lost, by reason (gone, stolen, unreachable, max_hold).",
            [*actor, "reason"], registry=reg,
        ),
        "redis_errors": Counter(
            "dramatiq_lease_redis_errors_total",
            "Redis errors by operation (acquire, renew, release, scan).", ["operation"], registry=reg,
        ),
    }


class PrometheusMetrics(LeaseMetrics):
    """:class:`LeaseMetrics` on ``prometheus_client`` (the names are listed in the README).

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
        for outcome in ("ok", "lost", "error"):
            m["renewals"].labels(*labels, outcome)
        for reason in LOST_REASONS:
            m["lost"].labels(*labels, reason)
        for operation in ("acquire", "renew", "release"):
            m["redis_errors"].labels(operation)


class OTelMetrics(LeaseMetrics):
    """:class:`LeaseMetrics` on an OpenTelemetry meter, instead of ``prometheus_client``.

    Pass ``LeaseMiddleware(metrics=OTelMetrics())`` and configure a
    ``MeterProvider`` in your application. Instruments are named
    ``dramatiq.lease.*`` with unit ``s`` for durations; OpenTelemetry's
    Prometheus exporter turns them into the same names as
    :class:`PrometheusMetrics` (``dramatiq.lease.acquire.duration`` becomes
    ``dramatiq_lease_acquire_duration_seconds``). Use one or the other, never
    both: two sources under one name would double every figure.

    Parameters:
      meter_provider: the provider to use; the global one by default.
    """

    def __init__(self, meter_provider: Any = None) -> None:
        from opentelemetry import metrics

        meter = metrics.get_meter("dramatiq_leases", meter_provider=meter_provider)
        self._acquire = meter.create_histogram("dramatiq.lease.acquire.duration", unit="s",
                                               description="Time to ask Redis for a lease, by outcome.")
        self._wait = meter.create_histogram("dramatiq.lease.wait.duration", unit="s",
                                            description="Time from a message's first acquire attempt to acquisition.")
        self._busy = meter.create_counter("dramatiq.lease.busy_retries",
                                          description="Messages sent back to the queue because their lease was busy.")
        self._handoff = meter.create_histogram(
            "dramatiq.lease.handoff.duration", unit="s",
            description="Time from a release to the grant of the same key to the next waiter of its line.")
        self._gave_up = meter.create_counter("dramatiq.lease.gave_up",
                                             description="Messages that exhausted their wait budget.")
        self._held = meter.create_up_down_counter("dramatiq.lease.held", description="Leases held now.")
        self._hold = meter.create_histogram("dramatiq.lease.hold.duration", unit="s",
                                            description="How long leases were held.")
        self._renewals = meter.create_counter("dramatiq.lease.renewals", description="Lease renewals by outcome.")
        self._round = meter.create_histogram("dramatiq.lease.renew.duration", unit="s",
                                             description="Duration of one heartbeat round.")
        self._lost = meter.create_counter("dramatiq.lease.lost", description="Held leases lost, by reason.")
        self._errors = meter.create_counter("dramatiq.lease.redis_errors", description="Redis errors by operation.")

    @staticmethod
    def _attrs(meta: Meta, **extra: str) -> dict[str, str]:
        actor, queue = labels_of(meta)
        return {"actor_name": actor, "queue_name": queue, **extra}

    def acquire(self, meta: Meta, outcome: str, seconds: float) -> None:
        self._acquire.record(seconds, self._attrs(meta, outcome=outcome))

    def wait(self, meta: Meta, seconds: float) -> None:
        self._wait.record(seconds, self._attrs(meta))

    def busy_retry(self, meta: Meta) -> None:
        self._busy.add(1, self._attrs(meta))

    def gave_up(self, meta: Meta) -> None:
        self._gave_up.add(1, self._attrs(meta))

    def held(self, meta: Meta, delta: int) -> None:
        self._held.add(delta, self._attrs(meta))

    def handoff(self, meta: Meta, seconds: float) -> None:
        self._handoff.record(seconds, self._attrs(meta))

    def hold(self, meta: Meta, seconds: float) -> None:
        self._hold.record(seconds, self._attrs(meta))

    def renewal(self, meta: Meta, outcome: str) -> None:
        self._renewals.add(1, self._attrs(meta, outcome=outcome))

    def renew_round(self, seconds: float) -> None:
        self._round.record(seconds)

    def lost(self, meta: Meta, reason: str) -> None:
        self._lost.add(1, self._attrs(meta, reason=reason))

    def redis_error(self, operation: str) -> None:
        self._errors.add(1, {"operation": operation})
