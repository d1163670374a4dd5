"""The same figures through an OpenTelemetry meter, for applications that export OTel metrics.

Through OpenTelemetry's Prometheus exporter they must come out as PrometheusMetrics' own: same names,
label sets, buckets and values for the same lease operations, so that the bundled alerts hold. The
alerts are checked on them with ``promtool test rules``, on series made of the exporter's scrapes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import dramatiq_leases.prometheus
from dramatiq_leases import LeaseMetrics, OTelMetrics, PrometheusMetrics
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.prometheus import DURATION_BUCKETS, LATENCY_BUCKETS

from .support.promtool import run_rule_tests, scrape_series
from .support.stack import Stack
from .support.waiting import wait_for


def test_otel_metrics_is_importable_from_both_places() -> None:
    assert dramatiq_leases.prometheus.OTelMetrics is OTelMetrics


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None  # for mypy: None only from a reader no MeterProvider collects for
    out: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


def test_a_contended_run_is_recorded_on_an_otel_meter(redis_server: EmbeddedRedis) -> None:
    reader = InMemoryMetricReader()
    metrics = OTelMetrics(meter_provider=MeterProvider(metric_readers=[reader]))
    stack = Stack(redis_server.url(0), redis_server.url(1), metrics=metrics, lock_min_backoff=20, lock_max_backoff=50)
    holding, go = threading.Event(), threading.Event()

    @stack.actor(lock_key="inv:{n}", lock_ttl=600)
    def work(n: int, hold: bool) -> None:
        if hold:
            holding.set()
            go.wait(10)

    try:
        stack.start()
        first = work.send(1, True)
        assert holding.wait(10)
        # More waiters than may wait in place (half of 4 threads): one is parked, a busy retry.
        second, *others = [work.send(1, False) for _ in range(3)]
        wait_for(lambda: any(stack.recorder.delays(m.message_id) for m in [second, *others]), what="a busy retry")
        wait_for(lambda: "dramatiq.lease.renewals" in points(reader), what="a renewal of the held lease")
        go.set()
        assert stack.recorder.wait_settled(first.message_id) == "acked"
        for m in [second, *others]:
            assert stack.recorder.wait_settled(m.message_id) == "acked"
    finally:
        stack.stop()

    seen = points(reader)
    outcomes = {p.attributes["outcome"]: p.count for p in seen["dramatiq.lease.acquire.duration"]}
    assert outcomes["acquired"] == 4 and outcomes["busy"] >= 1
    assert all(
        p.attributes["actor_name"] == "work" and p.attributes["queue_name"] == "default"
        for p in seen["dramatiq.lease.acquire.duration"]
    )
    assert sum(p.value for p in seen["dramatiq.lease.busy_retries"]) >= 1
    assert sum(p.value for p in seen["dramatiq.lease.held"]) == 0  # both released
    assert sum(p.count for p in seen["dramatiq.lease.hold.duration"]) == 4
    assert sum(p.count for p in seen["dramatiq.lease.handoff.duration"]) == 3  # each waiter, after a release
    assert any(p.attributes["outcome"] == "ok" for p in seen["dramatiq.lease.renewals"])


# --- the same series as PrometheusMetrics, through OpenTelemetry's Prometheus exporter ----------------

ROOT = Path(__file__).resolve().parent.parent
ALERT_RULES = ROOT / "alerts" / "dramatiq-leases.rules.yml"
#: The labels Prometheus adds when it scrapes a worker (the job of deploy/prometheus/prometheus.yml).
WORKER_TARGET = {"job": "dramatiq", "instance": "worker-1:9191"}
#: The OpenTelemetry SDK's default histogram buckets, meant for milliseconds: what OTelMetrics had.
SDK_DEFAULT_BUCKETS = (
    0.0,
    5.0,
    10.0,
    25.0,
    50.0,
    75.0,
    100.0,
    250.0,
    500.0,
    750.0,
    1000.0,
    2500.0,
    5000.0,
    7500.0,
    10000.0,
)
#: Each histogram and its buckets, as PrometheusMetrics declares them.
HISTOGRAM_BUCKETS = {
    "dramatiq_lease_acquire_duration_seconds": LATENCY_BUCKETS,
    "dramatiq_lease_wait_duration_seconds": DURATION_BUCKETS,
    "dramatiq_lease_handoff_duration_seconds": LATENCY_BUCKETS,
    "dramatiq_lease_hold_duration_seconds": DURATION_BUCKETS,
    "dramatiq_lease_renew_duration_seconds": LATENCY_BUCKETS,
}
WORK = {"actor_name": "work", "queue_name": "default"}


class Both(LeaseMetrics):
    """Reports every figure to several implementations: the same operations, one exposition each."""

    def __init__(self, *targets: LeaseMetrics) -> None:
        self.targets = targets


def _fan_out(name: str) -> Any:
    def method(self: Both, *args: Any) -> None:
        for target in self.targets:
            getattr(target, name)(*args)

    return method


for _name in [name for name in vars(LeaseMetrics) if not name.startswith("_")]:
    setattr(Both, _name, _fan_out(_name))


def otel_metrics(views: Sequence[View] = ()) -> tuple[OTelMetrics, CollectorRegistry]:
    """OTelMetrics on a real SDK whose Prometheus exporter renders into a registry of its own."""
    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)], views=list(views))
    return OTelMetrics(meter_provider=provider), registry


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def series(text: str) -> Series:
    """The dramatiq_lease_* samples of an exposition by (name, labels), without what only one side has:
    prometheus_client's ``_created`` samples, the OTel exporter's ``otel_scope_*`` labels."""
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("dramatiq_lease_") and not sample.name.endswith("_created"):
                labels = frozenset((k, v) for k, v in sample.labels.items() if not k.startswith("otel_scope_"))
                out[(sample.name, labels)] = sample.value
    return out


def types(text: str) -> dict[str, str]:
    """The type of each dramatiq_lease_* family (without prometheus_client's ``_created`` ones)."""
    return {
        f.name: f.type
        for f in text_string_to_metric_families(text)
        if f.name.startswith("dramatiq_lease_") and not f.name.endswith("_created")
    }


@dataclass
class Scrapes:
    """Expositions of one real run, by PrometheusMetrics and by OTelMetrics: after contention, after a loss."""

    prometheus: list[str]
    otel: list[str]


@pytest.fixture(scope="module")
def scrapes() -> Iterator[Scrapes]:
    """Real lease operations reported to both implementations at once: a held lease renewed, waiters
    bouncing off it then handed it in turn; then a lease deleted under its holder (lost, gone)."""
    server = EmbeddedRedis().start()
    otel, otel_registry = otel_metrics()
    prometheus_registry = CollectorRegistry()
    prometheus = PrometheusMetrics(registry=prometheus_registry)
    stack = Stack(
        server.url(0),
        server.url(1),
        metrics=Both(otel, prometheus),
        metrics_endpoint=False,
        lock_min_backoff=20,
        lock_max_backoff=50,
    )
    holding, go = threading.Event(), threading.Event()
    out = Scrapes([], [])

    def value(name: str, **labels: str) -> float:
        return prometheus_registry.get_sample_value(name, labels) or 0.0

    def snapshot(holds: int) -> None:
        # Hold times and the held gauge are reported by the heartbeat threads, after the acks.
        wait_for(
            lambda: (
                value("dramatiq_lease_hold_duration_seconds_count", **WORK) == holds
                and value("dramatiq_lease_held", **WORK) == 0
            ),
            what=f"{holds} holds reported",
        )
        out.prometheus.append(exposition(prometheus_registry))
        out.otel.append(exposition(otel_registry))

    @stack.actor(lock_key="inv:{n}", lock_ttl=600, max_retries=0)
    def work(n: int, hold: bool) -> None:
        if hold:
            holding.set()
            while not go.wait(0.01):  # short waits: a LeaseLost is raised between two of them
                pass

    try:
        stack.start()
        first = work.send(1, True)
        assert holding.wait(10)
        waiters = [work.send(1, False) for _ in range(3)]
        wait_for(lambda: any(stack.recorder.delays(m.message_id) for m in waiters), what="a busy retry")
        wait_for(lambda: value("dramatiq_lease_renewals_total", **WORK, outcome="ok"), what="a renewal")
        go.set()
        for message in [first, *waiters]:
            assert stack.recorder.wait_settled(message.message_id) == "acked"
        snapshot(holds=4)

        holding.clear()
        go.clear()
        doomed = work.send(2, True)
        assert holding.wait(10)
        stack.leases.client.delete(stack.leases.lease_name("inv:2"))
        assert stack.recorder.wait_settled(doomed.message_id) == "nacked"
        wait_for(lambda: value("dramatiq_lease_lost_total", **WORK, reason="gone"), what="the loss reported")
        snapshot(holds=5)
    finally:
        go.set()
        stack.stop()
        server.close()
    yield out


def test_otel_exposes_the_series_of_prometheus_metrics(scrapes: Scrapes) -> None:
    for prometheus, otel in zip(scrapes.prometheus, scrapes.otel):
        assert types(otel) == types(prometheus)
        expected, seen = series(prometheus), series(otel)
        assert sorted(seen) == sorted(expected)  # names and label sets, declared series included
        assert seen == pytest.approx(expected)  # and the values, bucket by bucket
    first, last = series(scrapes.otel[0]), series(scrapes.otel[1])
    # Declared at zero before any loss (so increase() sees the first one), then counted.
    lost = ("dramatiq_lease_lost_total", frozenset({**WORK, "reason": "gone"}.items()))
    assert (first[lost], last[lost]) == (0.0, 1.0)
    assert first[("dramatiq_lease_gave_up_total", frozenset(WORK.items()))] == 0.0
    assert first[("dramatiq_lease_redis_errors_total", frozenset({"operation": "renew"}.items()))] == 0.0


def test_otel_histograms_have_the_prometheus_buckets(scrapes: Scrapes) -> None:
    buckets: dict[str, set[tuple[float, ...]]] = {}
    for family in text_string_to_metric_families(scrapes.otel[-1]):
        if family.type == "histogram":
            by_series: dict[frozenset[tuple[str, str]], list[float]] = {}
            for sample in family.samples:
                if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                    key = frozenset((k, v) for k, v in sample.labels.items() if k != "le")
                    by_series.setdefault(key, []).append(float(sample.labels["le"]))
            buckets[family.name] = {tuple(les) for les in by_series.values()}
    assert buckets == {name: {expected} for name, expected in HISTOGRAM_BUCKETS.items()}


@pytest.mark.system
def test_a_first_lost_lease_fires_the_lost_alert(scrapes: Scrapes, tmp_path: Path) -> None:
    """The OTel worker scraped for 10 minutes with its series declared at zero, then with one lease lost."""
    timeline = [scrapes.otel[0]] * 10 + [scrapes.otel[1]] * 20
    run_rule_tests(
        [ALERT_RULES],
        [
            {
                "name": "a first lost lease, declared beforehand",
                "interval": "1m",
                "input_series": scrape_series(timeline, WORKER_TARGET),
                "alert_rule_test": [{"eval_time": "9m", "alertname": "DramatiqLeaseLost", "exp_alerts": []}],
                "promql_expr_test": [
                    {
                        "expr": 'group(ALERTS{alertname="DramatiqLeaseLost", alertstate="firing"})',
                        "eval_time": "15m",
                        "exp_samples": [{"labels": "{}", "value": 1}],
                    }
                ],
            }
        ],
        tmp_path,
    )


def acquire_scrapes(views: Sequence[View] = ()) -> list[str]:
    """30 minutes of one OTel worker scraped every minute, acquiring 100 leases a minute in 2 ms each."""
    metrics, registry = otel_metrics(views)
    meta = {"actor": "work", "queue": "default"}
    metrics.declare(meta)
    out = []
    for _ in range(30):
        for _ in range(100):
            metrics.acquire(meta, "acquired", 0.002)
        out.append(exposition(registry))
    return out


@pytest.mark.system
def test_fast_acquires_do_not_fire_the_latency_alert(tmp_path: Path) -> None:
    firing = 'group(ALERTS{alertname="DramatiqLeaseAcquireLatencyHigh", alertstate="firing"})'
    millisecond_buckets = View(
        instrument_type=Histogram, aggregation=ExplicitBucketHistogramAggregation(SDK_DEFAULT_BUCKETS)
    )
    run_rule_tests(
        [ALERT_RULES],
        [
            {
                "name": "2 ms acquires, 100 a minute, on the buckets of PrometheusMetrics",
                "interval": "1m",
                "input_series": scrape_series(acquire_scrapes(), WORKER_TARGET),
                "alert_rule_test": [
                    {"eval_time": "29m", "alertname": "DramatiqLeaseAcquireLatencyHigh", "exp_alerts": []}
                ],
            },
            {
                # The control, so the silence above means something: the SDK's default buckets (0, 5, 10...,
                # meant for ms) put every 2 ms acquire under le="5", a p99 of ~4.95 s, and the alert fires.
                "name": "the same acquires on the SDK's default buckets (the bug)",
                "interval": "1m",
                "input_series": scrape_series(acquire_scrapes([millisecond_buckets]), WORKER_TARGET),
                "promql_expr_test": [
                    {"expr": firing, "eval_time": "29m", "exp_samples": [{"labels": "{}", "value": 1}]}
                ],
            },
        ],
        tmp_path,
    )
