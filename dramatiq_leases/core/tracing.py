"""Spans around lease operations: the interface the core calls, plugged in from outside.

The core never imports a tracing library. It calls :func:`span` and
:func:`current_context`, which do nothing until an integration registers a
tracer with :func:`set_tracer`; importing :mod:`dramatiq_leases` registers
the OpenTelemetry one (:mod:`dramatiq_leases.otel_tracing`).

Each span is one Redis call (or one pipeline) and follows OpenTelemetry's
semantic conventions for database client spans, for Redis: kind ``CLIENT``,
named ``{db.operation.name} {db.stored_procedure.name}`` (for example
``EVALSHA lease.acquire``). Span names and attribute names are an API:
trace queries and dashboards use them.

Span names:
  ``EVALSHA lease.acquire``: one acquire attempt (:meth:`Leases.try_acquire`).
  ``EVALSHA lease.renew``: one renewal round of many leases in one script
  call; ``PIPELINE EVALSHA lease.renew`` when the round is several script
  calls pipelined in one round trip (leases of several TTLs, or more than
  :data:`~dramatiq_leases.core.rounds.RENEW_BATCH`). On a Redis Cluster, a
  round spanning several hash slots is one ``EVALSHA`` per slot, under one
  ``EVALSHA lease.renew`` span.
  ``EVALSHA lease.release``: one release.

Attributes of the conventions (set when the span starts):
  ``db.system.name``: always ``"redis"``.
  ``db.operation.name``: the Redis command: ``EVALSHA``, or
  ``PIPELINE EVALSHA`` for a pipeline of them.
  ``db.stored_procedure.name``: which of the library's Lua scripts ran:
  ``lease.acquire``, ``lease.renew`` or ``lease.release``.
  ``db.operation.batch.size``: the number of script calls in a pipeline
  (set only on pipelines, so never 1).
  ``db.namespace``: the database index the client was configured with, as a
  string (``"0"``); absent on a Redis Cluster.
  ``server.address``, ``server.port``: the host and port the client was
  configured with (``server.address`` is the socket path for a Unix socket,
  without a port). Absent when the client does not say: Sentinel (the
  server is found at connection time), or a cluster configured with several
  startup nodes.
  ``error.type``: on failure, the fully qualified class of the error Redis
  or the client raised (``redis.exceptions.ConnectionError``), not the
  library's wrapper; the span's status is then ``ERROR``.

The library's own attributes:
  ``lease.outcome``: ``acquired`` or ``busy`` (acquire), ``ok`` or ``lost``
  (renew: ``lost`` if any lease of the round was), ``released`` or
  ``not_held`` (release), ``error`` for any of them on failure.
  ``lease.fence``: the fence of the grant acquired, of the holder found busy,
  or of the lease released (when known).
  ``lease.ttl_ms``: the TTL asked for, in milliseconds (acquire).
  ``lease.count``: how many leases the round renews; ``lease.lost_count``:
  how many of them were not confirmed (renew).
  ``lease.key``: the lease key. Opt-in, since keys often carry user ids:
  off unless :func:`record_keys` turned it on or the environment variable
  ``DRAMATIQ_LEASES_TRACE_KEYS`` is ``1`` (or ``true``, ``yes``) at import.

Links: a renewal round span links to the span that was current when each of
its leases was tracked for renewal (the message's run, when Dramatiq is
instrumented), at most :data:`MAX_LINKS` per round; it is otherwise a root
span of its own trace, as it runs on the heartbeat thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

# Attribute names of OpenTelemetry's semantic conventions for database client spans.
DB_SYSTEM = "db.system.name"
DB_OPERATION = "db.operation.name"
DB_PROCEDURE = "db.stored_procedure.name"
DB_BATCH_SIZE = "db.operation.batch.size"
DB_NAMESPACE = "db.namespace"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"

# The library's own attribute names.
KEY = "lease.key"
FENCE = "lease.fence"
OUTCOME = "lease.outcome"
TTL = "lease.ttl_ms"
COUNT = "lease.count"
LOST_COUNT = "lease.lost_count"

#: Most links one renewal round span carries: a round may renew thousands of leases.
MAX_LINKS = 32

Attributes = Mapping[str, "str | int"]


class Span(Protocol):
    """What the core does with a span: set attributes on it."""

    def set_attribute(self, key: str, value: str | int) -> object:
        """Set one attribute."""

    def set_attributes(self, attributes: Attributes) -> object:
        """Set several attributes."""


class Tracer(Protocol):
    """Opens a span named ``name`` with ``attributes``, linked to ``links`` (objects from a
    :data:`ContextGetter` of the same integration); an exception inside marks it as an error and propagates."""

    def __call__(
        self, name: str, attributes: Attributes, links: Sequence[object] = ...
    ) -> AbstractContextManager[Span]:
        """Open the span."""


class ContextGetter(Protocol):
    """Returns the current span's context as an opaque object to link to later, or ``None`` without one."""

    def __call__(self) -> object | None:
        """Capture the current span context."""


class _NullSpan:
    def set_attribute(self, key: str, value: str | int) -> None:
        pass

    def set_attributes(self, attributes: Attributes) -> None:
        pass


_NO_SPAN: AbstractContextManager[Span] = nullcontext(_NullSpan())


def _no_tracer(name: str, attributes: Attributes, links: Sequence[object] = ()) -> AbstractContextManager[Span]:
    return _NO_SPAN


def _no_context() -> object | None:
    return None


_tracer: Tracer = _no_tracer
_context: ContextGetter = _no_context
_record_keys = os.environ.get("DRAMATIQ_LEASES_TRACE_KEYS", "").strip().lower() in {"1", "true", "yes"}


def set_tracer(tracer: Tracer | None, current_context: ContextGetter | None = None) -> None:
    """Make the core open its spans with ``tracer`` and capture contexts to link to with
    ``current_context``; ``None`` turns spans (or links) off."""
    global _tracer, _context
    _tracer = tracer or _no_tracer
    _context = current_context or _no_context


def span(name: str, attributes: Attributes, links: Sequence[object] = ()) -> AbstractContextManager[Span]:
    """A span around one lease operation, from the registered tracer (a no-op without one)."""
    return _tracer(name, attributes, links)


def current_context() -> object | None:
    """The current span's context, to pass later in ``links``; ``None`` when there is nothing to link to."""
    return _context()


def record_keys(on: bool = True) -> None:
    """Record lease keys in spans (``lease.key``) from now on, or stop. Off by default: keys often carry user ids."""
    global _record_keys
    _record_keys = bool(on)


def keys_recorded() -> bool:
    """Whether spans record lease keys."""
    return _record_keys
