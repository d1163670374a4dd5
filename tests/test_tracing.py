"""OpenTelemetry spans of lease operations on a real Redis: database conventions, opt-in keys, renewal links.

Spans are recorded by the OpenTelemetry SDK (a global tracer provider, set once per session) into an
in-memory exporter. Each test tells its spans from others' by its own Redis server's port
(``server.port``), since every test starts its own server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage, Middleware
from opentelemetry import context, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, SpanContext, SpanKind, StatusCode

from dramatiq_leases import LeaseMetrics, Leases, LeaseUnavailableError, current_lease, otel_tracing
from dramatiq_leases.core import Heartbeat, Lease, Renewal
from dramatiq_leases.core import tracing as core_tracing
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.processes import wait_until
from .support.stack import Stack
from .support.waiting import wait_for

#: The conventions' attributes every Redis span starts with.
CONVENTIONS = (
    "db.system.name",
    "db.operation.name",
    "db.stored_procedure.name",
    "db.namespace",
    "server.address",
    "server.port",
)


@pytest.fixture(scope="session")
def finished_spans() -> InMemorySpanExporter:
    """Spans recorded by the OpenTelemetry SDK for the rest of the session.

    A tracer provider can be set globally only once per process: set one unless an SDK provider is
    already set (by another test), and add this exporter to whichever it is.
    """
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), f"a non-SDK tracer provider is set globally: {provider!r}"
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def spans(finished_spans: InMemorySpanExporter) -> InMemorySpanExporter:
    """The session's span exporter, emptied for this test."""
    finished_spans.clear()
    return finished_spans


@pytest.fixture
def keys_in_spans() -> Iterator[None]:
    """Lease keys recorded in spans for one test (the opt-in), then back to how it was."""
    before = otel_tracing.keys_recorded()
    otel_tracing.record_keys(True)
    yield
    otel_tracing.record_keys(before)


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def redis_spans(
    exporter: InMemorySpanExporter, server: EmbeddedRedis | int, name: str | None = None
) -> list[ReadableSpan]:
    """The finished Redis spans of the server (by port), optionally only those named ``name``."""
    port = server if isinstance(server, int) else server.port
    return [
        s
        for s in exporter.get_finished_spans()
        if attrs(s).get("server.port") == port and (name is None or s.name == name)
    ]


def test_redis_spans_follow_the_database_conventions(redis_server: EmbeddedRedis, spans: InMemorySpanExporter) -> None:
    leases = Leases(redis.Redis.from_url(redis_server.url(3), socket_timeout=2))
    lease = leases.try_acquire("conv:1", ttl=5_000)
    assert isinstance(lease, Lease)
    assert not leases.try_acquire("conv:1", ttl=5_000)
    assert leases.renew_many([lease])
    assert leases.release(lease)

    seen = redis_spans(spans, redis_server)
    assert [s.name for s in seen] == [
        "EVALSHA lease.acquire",
        "EVALSHA lease.acquire",
        "EVALSHA lease.renew",
        "EVALSHA lease.release",
    ]
    for span in seen:
        assert span.kind is SpanKind.CLIENT
        assert span.status.status_code is not StatusCode.ERROR
        assert {name: attrs(span)[name] for name in CONVENTIONS} == {
            "db.system.name": "redis",
            "db.operation.name": "EVALSHA",
            "db.stored_procedure.name": span.name.removeprefix("EVALSHA "),
            "db.namespace": "3",
            "server.address": "127.0.0.1",
            "server.port": redis_server.port,
        }
        assert "db.operation.batch.size" not in attrs(span)  # one script call: not a batch
    acquired, busy, renewed, released = map(attrs, seen)
    fence = acquired["lease.fence"]
    assert (acquired["lease.outcome"], acquired["lease.ttl_ms"]) == ("acquired", 5_000) and fence > 0
    assert (busy["lease.outcome"], busy["lease.fence"]) == ("busy", fence)
    assert (renewed["lease.outcome"], renewed["lease.count"], renewed["lease.lost_count"]) == ("ok", 1, 0)
    assert (released["lease.outcome"], released["lease.fence"]) == ("released", fence)


def test_lease_keys_stay_out_of_spans_by_default(redis_server: EmbeddedRedis, spans: InMemorySpanExporter) -> None:
    assert not otel_tracing.keys_recorded()
    leases = Leases(redis.Redis.from_url(redis_server.url(0), socket_timeout=2))
    lease = leases.try_acquire("user:alice@example.com", ttl=5_000)
    assert isinstance(lease, Lease)
    leases.release(lease)
    seen = redis_spans(spans, redis_server)
    assert len(seen) == 2
    assert all("lease.key" not in attrs(s) for s in seen)
    assert all("alice" not in str(value) for s in seen for value in attrs(s).values())


def test_lease_keys_are_recorded_when_opted_in(
    redis_server: EmbeddedRedis, spans: InMemorySpanExporter, keys_in_spans: None
) -> None:
    leases = Leases(redis.Redis.from_url(redis_server.url(0), socket_timeout=2))
    lease = leases.try_acquire("user:alice@example.com", ttl=5_000)
    assert isinstance(lease, Lease)
    leases.release(lease)
    assert [(s.name, attrs(s)["lease.key"]) for s in redis_spans(spans, redis_server)] == [
        ("EVALSHA lease.acquire", "user:alice@example.com"),
        ("EVALSHA lease.release", "user:alice@example.com"),
    ]


@pytest.mark.parametrize("value, recorded", [("1", True), ("true", True), ("", False), ("0", False)])
def test_the_environment_variable_opts_in_to_keys(value: str, recorded: bool) -> None:
    code = "import dramatiq_leases.otel_tracing as t; print(t.keys_recorded())"
    env = {**os.environ, "DRAMATIQ_LEASES_TRACE_KEYS": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(recorded)


def test_without_an_sdk_spans_cost_nothing() -> None:
    """No SDK configured: no span is opened and no context captured (the API is never entered)."""
    code = (
        "import dramatiq_leases\n"
        "from dramatiq_leases import otel_tracing as tracing\n"
        "from dramatiq_leases.core import tracing as core\n"
        "assert tracing.span('x', {}, [object()]) is tracing._NO_SPAN\n"
        "assert tracing.current_context() is None and core.current_context() is None\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_a_renewal_of_several_script_calls_is_a_pipeline_span(
    redis_server: EmbeddedRedis, spans: InMemorySpanExporter
) -> None:
    leases = Leases(redis.Redis.from_url(redis_server.url(0), socket_timeout=2))
    held = [leases.try_acquire(f"pipe:{n}", ttl=ttl) for n, ttl in enumerate([5_000, 5_000, 6_000])]
    # Two TTLs: two script calls, pipelined in one round trip.
    assert leases.renew_many(held) == [Renewal.OK] * 3  # type: ignore[arg-type]
    (span,) = redis_spans(spans, redis_server, "PIPELINE EVALSHA lease.renew")
    assert span.kind is SpanKind.CLIENT
    assert {
        k: attrs(span)[k]
        for k in (
            "db.operation.name",
            "db.stored_procedure.name",
            "db.operation.batch.size",
            "lease.count",
            "lease.outcome",
        )
    } == {
        "db.operation.name": "PIPELINE EVALSHA",
        "db.stored_procedure.name": "lease.renew",
        "db.operation.batch.size": 2,
        "lease.count": 3,
        "lease.outcome": "ok",
    }


def test_a_failed_call_records_the_redis_error(spans: InMemorySpanExporter) -> None:
    port = free_port()  # nothing listens there
    leases = Leases(redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5))
    with pytest.raises(LeaseUnavailableError):
        leases.try_acquire("down:1", ttl=5_000)
    (span,) = redis_spans(spans, port)
    assert span.name == "EVALSHA lease.acquire"
    assert span.status.status_code is StatusCode.ERROR
    # The original error, not the library's wrapper (the conventions' error.type).
    assert attrs(span)["error.type"] == "redis.exceptions.ConnectionError"
    assert attrs(span)["lease.outcome"] == "error"
    assert any(event.name == "exception" for event in span.events)


def test_renewal_rounds_link_to_the_runs_they_renew(redis_server: EmbeddedRedis, spans: InMemorySpanExporter) -> None:
    leases = Leases(redis.Redis.from_url(redis_server.url(0), socket_timeout=2))
    heartbeat = Heartbeat(leases)
    tracer = trace.get_tracer("tests.runs")
    runs: dict[str, SpanContext] = {}
    count = core_tracing.MAX_LINKS + 8  # more than one round may link to
    try:
        for n in range(count):
            # Each lease tracked inside its own run, as a worker thread tracks its message's lease.
            with tracer.start_as_current_span(f"run {n}") as run:
                lease = leases.try_acquire(f"link:{n}", ttl=600)
                assert isinstance(lease, Lease)
                heartbeat.track(lease, lambda lease, reason: None)
                runs[lease.key] = run.get_span_context()
        rounds = wait_for(
            lambda: [
                s for s in redis_spans(spans, redis_server, "EVALSHA lease.renew") if attrs(s)["lease.count"] == count
            ],
            what="a round renewing every lease",
        )
    finally:
        heartbeat.stop()

    run_ids = {(c.trace_id, c.span_id) for c in runs.values()}
    for span in redis_spans(spans, redis_server, "EVALSHA lease.renew"):
        assert span.parent is None  # the heartbeat thread has no current span: a root, related by its links
        assert len(span.links) <= core_tracing.MAX_LINKS
        assert {(link.context.trace_id, link.context.span_id) for link in span.links} <= run_ids
    assert len(rounds[0].links) == core_tracing.MAX_LINKS


# --- under a Dramatiq worker -----------------------------------------------------------------------


class MessageSpans(Middleware):
    """A span around each delivery, current in the worker thread from the first hook to the last.

    This is what a Dramatiq instrumentation does; the lease spans must nest under it.
    """

    NAME = "dramatiq.process"

    def __init__(self) -> None:
        self.tracer = trace.get_tracer("tests.message-spans")
        self.active: dict[int, tuple[Span, object]] = {}

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        span = self.tracer.start_span(self.NAME, attributes={"messaging.message.id": message.message_id})
        self.active[threading.get_ident()] = (span, context.attach(trace.set_span_in_context(span)))

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        span, token = self.active.pop(threading.get_ident())
        context.detach(token)  # type: ignore[arg-type]
        span.end()

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        self.after_process_message(broker, message)


def test_lease_spans_nest_under_the_message_span(redis_server: EmbeddedRedis, spans: InMemorySpanExporter) -> None:
    broker = RedisBroker(url=redis_server.url(0))  # type: ignore[no-untyped-call]
    broker.add_middleware(MessageSpans())  # before LeaseMiddleware, as an instrumentation would be
    broker.add_middleware(CurrentMessage())
    stack = Stack(
        redis_server.url(0),
        redis_server.url(1),
        threads=2,
        broker=broker,
        metrics=LeaseMetrics(),
        metrics_endpoint=False,
        lock_min_backoff=20,
        lock_max_backoff=100,
    )
    suffix = uuid.uuid4().hex[:8]
    key = f"otel:{suffix}"
    fences: dict[str, int] = {}

    @stack.actor(actor_name=f"otel_job_{suffix}", lock_key="otel:{suffix}", lock_ttl=600, max_retries=0)
    def job(suffix: str, seconds: float) -> None:
        message = CurrentMessage.get_current_message()
        fences[message.message_id if message else ""] = current_lease().fence
        time.sleep(seconds)

    stack.start()
    try:
        holder = job.send(suffix, 0.8).message_id
        wait_until(lambda: stack.leases.inspect(key), timeout=10, what="the first message to hold the lease")
        waiter = job.send(suffix, 0.0).message_id  # finds the lease busy at least once
        assert stack.recorder.wait_settled(holder) == "acked"
        assert stack.recorder.wait_settled(waiter) == "acked"
    finally:
        stack.stop()

    finished = spans.get_finished_spans()
    messages = {span.context.span_id: span for span in finished if span.name == MessageSpans.NAME}

    def message_of(span: ReadableSpan) -> str:
        """The id of the message in whose span ``span`` ran."""
        assert span.parent is not None, f"{span.name} has no parent span"
        parent = messages.get(span.parent.span_id)
        assert parent is not None, f"{span.name}'s parent is not a message span"
        assert parent.context.trace_id == span.context.trace_id
        return str(attrs(parent)["messaging.message.id"])

    def of(name: str, **match: Any) -> list[ReadableSpan]:
        return [span for span in redis_spans(spans, redis_server, name) if match.items() <= attrs(span).items()]

    acquired, busy, released = (
        of("EVALSHA lease.acquire", **{"lease.outcome": "acquired"}),
        of("EVALSHA lease.acquire", **{"lease.outcome": "busy"}),
        of("EVALSHA lease.release"),
    )
    assert all(span.kind is SpanKind.CLIENT for span in acquired + busy + released)
    assert all(
        attrs(span)["db.namespace"] == "1" and "lease.key" not in attrs(span) for span in acquired + busy + released
    )
    # Each message acquired once, in its own message span, with the fence the actor saw...
    assert {message_of(s): attrs(s)["lease.fence"] for s in acquired} == fences
    assert len(acquired) == 2 and fences[waiter] > fences[holder]
    assert all(attrs(s)["lease.ttl_ms"] == 600 for s in acquired)
    # ... after the waiter bounced off the holder's grant: its busy spans name the holder's fence...
    assert busy and {message_of(s) for s in busy} == {waiter}
    assert {attrs(s)["lease.fence"] for s in busy} == {fences[holder]}
    # ... and each released its own grant, in its own message span.
    assert sorted((message_of(s), attrs(s)["lease.fence"], attrs(s)["lease.outcome"]) for s in released) == sorted(
        (mid, fence, "released") for mid, fence in fences.items()
    )

    # The heartbeat renewed the holder's lease (600 ms TTL, every 200 ms) while it ran, in rounds
    # linked to the holder's message span: the run whose lease they kept alive.
    (hold_start,) = [s.end_time for s in acquired if attrs(s)["lease.fence"] == fences[holder]]
    (hold_end,) = [s.start_time for s in released if attrs(s)["lease.fence"] == fences[holder]]
    assert hold_start is not None and hold_end is not None
    renewals = [s for s in of("EVALSHA lease.renew") if hold_start <= (s.start_time or 0) <= hold_end]
    assert len(renewals) >= 2
    assert all(attrs(s)["lease.outcome"] == "ok" and attrs(s)["lease.count"] >= 1 for s in renewals)
    (holder_span,) = [s for s in messages.values() if attrs(s)["messaging.message.id"] == holder]
    for renewal in renewals:
        assert renewal.parent is None
        assert [(link.context.trace_id, link.context.span_id) for link in renewal.links] == [
            (holder_span.context.trace_id, holder_span.context.span_id)
        ]


def test_the_middleware_parameter_opts_in_to_keys(redis_server: EmbeddedRedis) -> None:
    from dramatiq_leases import LeaseMiddleware

    before = otel_tracing.keys_recorded()
    try:
        otel_tracing.record_keys(False)
        LeaseMiddleware(redis_server.url(0))
        assert not otel_tracing.keys_recorded(), "off unless asked for"
        LeaseMiddleware(redis_server.url(0), trace_keys=True)
        assert otel_tracing.keys_recorded()
        LeaseMiddleware(redis_server.url(0), trace_keys=False)
        assert not otel_tracing.keys_recorded()
    finally:
        otel_tracing.record_keys(before)
