"""OpenTelemetry spans for lease operations, through ``opentelemetry-api`` only.

Plugged into the core's tracing interface (:mod:`dramatiq_leases.core.tracing`)
when :mod:`dramatiq_leases` is imported. The library never configures an SDK.
Without one, :func:`span` and :func:`current_context` skip the API altogether
(its no-op spans still cost ~15 µs each on a hot path); with one, each
acquire, heartbeat round and release is a ``CLIENT`` span following
OpenTelemetry's database conventions for Redis.

Acquires and releases are children of whatever span is current (Dramatiq's
message processing, when it is instrumented). Heartbeat rounds run on the
heartbeat's own thread, so each is the root of a trace of its own, linked
(at most :data:`MAX_LINKS` links) to the spans that were current when the
leases it renews were tracked: the runs holding them.

Span names and attributes (an API: every name is listed, with its meaning,
in :mod:`dramatiq_leases.core.tracing`):

* span names ``EVALSHA lease.acquire``, ``EVALSHA lease.renew``,
  ``PIPELINE EVALSHA lease.renew``, ``EVALSHA lease.release``;
* conventions: ``db.system.name`` (``redis``), ``db.operation.name``,
  ``db.stored_procedure.name``, ``db.operation.batch.size``,
  ``db.namespace``, ``server.address``, ``server.port``, ``error.type``;
* the library's: ``lease.outcome``, ``lease.fence``, ``lease.ttl_ms``,
  ``lease.count``, ``lease.lost_count``, and ``lease.key`` only when opted in
  with :func:`record_keys` (or ``DRAMATIQ_LEASES_TRACE_KEYS=1``): keys often
  carry user ids.

An exception inside a span sets ``error.type`` to the class of the original
error (the Redis error under the library's ``LeaseUnavailableError``),
``lease.outcome`` to ``error`` and the span's status to ``ERROR``, and
records the exception as an event.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Link, ProxyTracerProvider, Span, SpanContext, SpanKind, Status, StatusCode

from .core.tracing import (
    COUNT,
    DB_BATCH_SIZE,
    DB_NAMESPACE,
    DB_OPERATION,
    DB_PROCEDURE,
    DB_SYSTEM,
    ERROR_TYPE,
    FENCE,
    KEY,
    LOST_COUNT,
    MAX_LINKS,
    OUTCOME,
    SERVER_ADDRESS,
    SERVER_PORT,
    TTL,
    keys_recorded,
    record_keys,
)

tracer = trace.get_tracer("dramatiq_leases")

__all__ = [
    "COUNT",
    "DB_BATCH_SIZE",
    "DB_NAMESPACE",
    "DB_OPERATION",
    "DB_PROCEDURE",
    "DB_SYSTEM",
    "ERROR_TYPE",
    "FENCE",
    "KEY",
    "LOST_COUNT",
    "MAX_LINKS",
    "OUTCOME",
    "SERVER_ADDRESS",
    "SERVER_PORT",
    "TTL",
    "current_context",
    "keys_recorded",
    "record_keys",
    "span",
]

_NO_SPAN: AbstractContextManager[Span] = nullcontext(INVALID_SPAN)


def _no_sdk() -> bool:
    # Until an SDK provider is set, the global one is a proxy and nothing would record a span.
    return isinstance(trace.get_tracer_provider(), ProxyTracerProvider)


def span(name: str, attributes: Mapping[str, str | int], links: Sequence[object] = ()) -> AbstractContextManager[Span]:
    """A ``CLIENT`` span named ``name``, linked to ``links`` (from :func:`current_context`); an exception
    marks it as an error and propagates."""
    if _no_sdk():
        return _NO_SPAN
    return _span(name, attributes, links)


def current_context() -> object | None:
    """The current span's context (a ``SpanContext``), or ``None`` without an SDK or a current span."""
    if _no_sdk():
        return None
    context = trace.get_current_span().get_span_context()
    return context if context.is_valid else None


def _error_type(e: BaseException) -> str:
    # The conventions want the original error: LeaseUnavailableError wraps the Redis one.
    cause = e.__cause__ if e.__cause__ is not None else e
    kind = type(cause)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


@contextmanager
def _span(name: str, attributes: Mapping[str, str | int], links: Sequence[object]) -> Iterator[Span]:
    span_links = [Link(c) for c in links if isinstance(c, SpanContext)] if links else None
    with tracer.start_as_current_span(
        name,
        kind=SpanKind.CLIENT,
        attributes=dict(attributes),
        links=span_links,
        record_exception=True,
        set_status_on_exception=False,
    ) as current:
        try:
            yield current
        except BaseException as e:
            current.set_attributes({OUTCOME: "error", ERROR_TYPE: _error_type(e)})
            current.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
