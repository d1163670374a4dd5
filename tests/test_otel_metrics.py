"""The same figures through an OpenTelemetry meter, for applications that export OTel metrics."""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from dramatiq_leases import OTelMetrics
from dramatiq_leases.embedded import EmbeddedRedis

from .support.stack import Stack
from .support.waiting import wait_for


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
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
    assert all(p.attributes["actor_name"] == "work" and p.attributes["queue_name"] == "default"
               for p in seen["dramatiq.lease.acquire.duration"])
    assert sum(p.value for p in seen["dramatiq.lease.busy_retries"]) >= 1
    assert sum(p.value for p in seen["dramatiq.lease.held"]) == 0  # both released
    assert sum(p.count for p in seen["dramatiq.lease.hold.duration"]) == 4
    assert sum(p.count for p in seen["dramatiq.lease.handoff.duration"]) == 3  # each waiter, after a release
    assert any(p.attributes["outcome"] == "ok" for p in seen["dramatiq.lease.renewals"])
