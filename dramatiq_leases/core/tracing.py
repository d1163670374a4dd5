"""Spans around lease operations: the interface the core calls, plugged in from outside.

The core never imports a tracing library. It calls :func:`span`, which does
nothing until an integration registers a tracer with :func:`set_tracer`;
importing :mod:`dramatiq_leases` registers the OpenTelemetry one
(:mod:`dramatiq_leases.tracing`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

#: Span attribute names (an API: dashboards and queries use them).
KEY = "lease.key"
FENCE = "lease.fence"
OUTCOME = "lease.outcome"
TTL = "lease.ttl_ms"
COUNT = "lease.count"

Attributes = Mapping[str, "str | int"]


class Span(Protocol):
    """What the core does with a span: set attributes on it."""

    def set_attribute(self, key: str, value: str | int) -> object:
        """Set one attribute."""

    def set_attributes(self, attributes: Attributes) -> object:
        """Set several attributes."""


#: Opens a span named by its first argument, with the attributes given; an
#: exception inside marks it as an error and propagates.
Tracer = Callable[[str, Attributes], AbstractContextManager[Span]]


class _NullSpan:
    def set_attribute(self, key: str, value: str | int) -> None:
        pass

    def set_attributes(self, attributes: Attributes) -> None:
        pass


_NO_SPAN: AbstractContextManager[Span] = nullcontext(_NullSpan())


def _no_tracer(name: str, attributes: Attributes) -> AbstractContextManager[Span]:
    return _NO_SPAN


_tracer: Tracer = _no_tracer


def set_tracer(tracer: Tracer | None) -> None:
    """Make the core open its spans with ``tracer``; ``None`` turns spans off."""
    global _tracer
    _tracer = tracer or _no_tracer


def span(name: str, attributes: Attributes) -> AbstractContextManager[Span]:
    """A span around one lease operation, from the registered tracer (a no-op without one)."""
    return _tracer(name, attributes)
