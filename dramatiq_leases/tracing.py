"""OpenTelemetry spans for lease operations, through ``opentelemetry-api`` only.

The library never configures an SDK: without one, spans are no-ops that cost
a few hundred nanoseconds. With one, each acquire, heartbeat round and
release is a span, a child of whatever span is current (Dramatiq's message
processing, when it is instrumented).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

tracer = trace.get_tracer("dramatiq_leases")

#: Span attribute names (an API: dashboards and queries use them).
KEY = "lease.key"
FENCE = "lease.fence"
OUTCOME = "lease.outcome"
TTL = "lease.ttl_ms"
COUNT = "lease.count"


@contextmanager
def span(name: str, attributes: Mapping[str, str | int]) -> Iterator[Span]:
    """A client span named ``name``; an exception marks it as an error and propagates."""
    with tracer.start_as_current_span(
        name, kind=SpanKind.CLIENT, attributes=dict(attributes), record_exception=True, set_status_on_exception=False
    ) as current:
        try:
            yield current
        except BaseException as e:
            current.set_attribute(OUTCOME, "error")
            current.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
