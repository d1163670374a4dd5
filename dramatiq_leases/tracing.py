"""OpenTelemetry spans for lease operations, through ``opentelemetry-api`` only.

Plugged into the core's tracing interface (:mod:`dramatiq_leases.core.tracing`)
when :mod:`dramatiq_leases` is imported. The library never configures an SDK.
Without one, :func:`span` skips the API altogether (its no-op spans still cost ~15 µs each on a hot path); with one,
each acquire, heartbeat round and release is a span, a child of whatever
span is current (Dramatiq's message processing, when it is instrumented).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, ProxyTracerProvider, Span, SpanKind, Status, StatusCode

from .core.tracing import COUNT, FENCE, KEY, OUTCOME, TTL

tracer = trace.get_tracer("dramatiq_leases")

__all__ = ["COUNT", "FENCE", "KEY", "OUTCOME", "TTL", "span"]

_NO_SPAN: AbstractContextManager[Span] = nullcontext(INVALID_SPAN)


def span(name: str, attributes: Mapping[str, str | int]) -> AbstractContextManager[Span]:
    """A client span named ``name``; an exception marks it as an error and propagates."""
    if isinstance(trace.get_tracer_provider(), ProxyTracerProvider):
        return _NO_SPAN  # no SDK configured (yet): nothing would record it
    return _span(name, attributes)


@contextmanager
def _span(name: str, attributes: Mapping[str, str | int]) -> Iterator[Span]:
    with tracer.start_as_current_span(
        name, kind=SpanKind.CLIENT, attributes=dict(attributes), record_exception=True, set_status_on_exception=False
    ) as current:
        try:
            yield current
        except BaseException as e:
            current.set_attribute(OUTCOME, "error")
            current.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
