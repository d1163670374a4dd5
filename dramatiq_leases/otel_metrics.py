""":class:`OTelMetrics`: the core's :class:`LeaseMetrics` interface on an OpenTelemetry meter.

For applications that export OpenTelemetry metrics rather than scrape
``prometheus_client``. Through OpenTelemetry's Prometheus exporter (or an
OTLP pipeline into Prometheus) the figures come out under exactly the names,
labels and histogram buckets of :class:`~dramatiq_leases.prometheus.PrometheusMetrics`,
so the bundled alerts and dashboards work on either:

============================================  ================  ================================================
instrument (unit)                             kind              Prometheus name
============================================  ================  ================================================
``dramatiq.lease.acquire.duration`` (s)       histogram         ``dramatiq_lease_acquire_duration_seconds``
``dramatiq.lease.wait.duration`` (s)          histogram         ``dramatiq_lease_wait_duration_seconds``
``dramatiq.lease.busy_retries``               counter           ``dramatiq_lease_busy_retries_total``
``dramatiq.lease.handoff.duration`` (s)       histogram         ``dramatiq_lease_handoff_duration_seconds``
``dramatiq.lease.gave_up``                    counter           ``dramatiq_lease_gave_up_total``
``dramatiq.lease.not_run``                    counter           ``dramatiq_lease_not_run_total``
``dramatiq.lease.held``                       up-down counter   ``dramatiq_lease_held`` (a gauge)
``dramatiq.lease.hold.duration`` (s)          histogram         ``dramatiq_lease_hold_duration_seconds``
``dramatiq.lease.renewals``                   counter           ``dramatiq_lease_renewals_total``
``dramatiq.lease.renew.duration`` (s)         histogram         ``dramatiq_lease_renew_duration_seconds``
``dramatiq.lease.lost``                       counter           ``dramatiq_lease_lost_total``
``dramatiq.lease.redis_errors``               counter           ``dramatiq_lease_redis_errors_total``
============================================  ================  ================================================

Attributes are those labels: ``actor_name``, ``queue_name``, and ``outcome``,
``reason`` or ``operation`` where the Prometheus metric has them. The
exporter adds its own ``otel_scope_*`` labels (and a ``target_info``
metric) unless told not to; aggregations by the labels above ignore them.

Histograms ask for the buckets of :data:`~dramatiq_leases.prometheus.LATENCY_BUCKETS`
and :data:`~dramatiq_leases.prometheus.DURATION_BUCKETS` through
``explicit_bucket_boundaries_advisory``: the SDK's default buckets (0 to
10 000) are meant for milliseconds and would put every latency in seconds in
the first few. A ``View`` configured in the application still overrides them.
"""

from __future__ import annotations

from typing import Any

from .core.metrics import (
    DURATION_BUCKETS,
    ERROR_OPERATIONS,
    LATENCY_BUCKETS,
    LOST_REASONS,
    NOT_RUN_REASONS,
    RENEWAL_OUTCOMES,
    LeaseMetrics,
    Meta,
    labels_of,
)

__all__ = ["OTelMetrics"]


class OTelMetrics(LeaseMetrics):
    """:class:`LeaseMetrics` on an OpenTelemetry meter, instead of ``prometheus_client``.

    Pass ``LeaseMiddleware(metrics=OTelMetrics())`` and configure a
    ``MeterProvider`` in your application. Instruments are named
    ``dramatiq.lease.*`` with unit ``s`` for durations; OpenTelemetry's
    Prometheus exporter turns them into the same names as
    :class:`~dramatiq_leases.prometheus.PrometheusMetrics`
    (``dramatiq.lease.acquire.duration`` becomes
    ``dramatiq_lease_acquire_duration_seconds``; the module docstring lists
    them all). Use one or the other, never both: two sources under one name
    would double every figure.

    Parameters:
      meter_provider: the provider to use; the global one by default.
    """

    def __init__(self, meter_provider: Any = None) -> None:
        from opentelemetry import metrics

        meter = metrics.get_meter("dramatiq_leases", meter_provider=meter_provider)

        def histogram(name: str, buckets: tuple[float, ...], description: str) -> Any:
            return meter.create_histogram(
                name, unit="s", description=description, explicit_bucket_boundaries_advisory=buckets
            )

        self._acquire = histogram(
            "dramatiq.lease.acquire.duration",
            LATENCY_BUCKETS,
            "Time to ask Redis for a lease, by outcome (acquired, busy, error).",
        )
        self._wait = histogram(
            "dramatiq.lease.wait.duration",
            DURATION_BUCKETS,
            "Time from a message's first acquire attempt to acquisition: time lost to contention.",
        )
        self._busy = meter.create_counter(
            "dramatiq.lease.busy_retries", description="Messages sent back to the queue because their lease was busy."
        )
        self._handoff = histogram(
            "dramatiq.lease.handoff.duration",
            LATENCY_BUCKETS,
            "Time from a release to the grant of the same key to the next message waiting in its line.",
        )
        self._gave_up = meter.create_counter(
            "dramatiq.lease.gave_up", description="Messages that exhausted their wait budget for a lease."
        )
        self._not_run = meter.create_counter(
            "dramatiq.lease.not_run",
            description="Messages acknowledged or dead-lettered without running, by reason "
            "(skipped, failed, superseded, gave_up, duplicate).",
        )
        self._held = meter.create_up_down_counter("dramatiq.lease.held", description="Leases held now.")
        self._hold = histogram("dramatiq.lease.hold.duration", DURATION_BUCKETS, "How long leases were held.")
        self._renewals = meter.create_counter(
            "dramatiq.lease.renewals", description="Lease renewals by outcome (ok, lost, error)."
        )
        self._round = histogram(
            "dramatiq.lease.renew.duration",
            LATENCY_BUCKETS,
            "Duration of one heartbeat round renewing all due leases of a process.",
        )
        self._lost = meter.create_counter(
            "dramatiq.lease.lost", description="Held leases lost, by reason (gone, stolen, unreachable, max_hold)."
        )
        self._errors = meter.create_counter(
            "dramatiq.lease.redis_errors", description="Redis errors by operation (acquire, renew, release, scan)."
        )

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

    def not_run(self, meta: Meta, reason: str) -> None:
        self._not_run.add(1, self._attrs(meta, reason=reason))

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

    def declare(self, meta: Meta) -> None:
        # Adding 0 creates the series (a data point at 0) without counting anything: the same
        # series PrometheusMetrics.declare pre-creates, so increase() sees the first real event.
        attrs = self._attrs(meta)
        for counter in (self._busy, self._gave_up, self._held):
            counter.add(0, attrs)
        for outcome in RENEWAL_OUTCOMES:
            self._renewals.add(0, self._attrs(meta, outcome=outcome))
        for reason in LOST_REASONS:
            self._lost.add(0, self._attrs(meta, reason=reason))
        for reason in NOT_RUN_REASONS:
            self._not_run.add(0, self._attrs(meta, reason=reason))
        self.declare_process()

    def declare_process(self) -> None:
        for operation in ERROR_OPERATIONS:
            self._errors.add(0, {"operation": operation})
