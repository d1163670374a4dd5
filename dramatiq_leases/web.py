"""Helpers for web handlers that start a job only if none is running for the same key.

The flow: the handler calls :func:`try_acquire` on the job's key, with the
ticket the client sent back, if any (header :data:`TICKET_HEADER`). If it
gets :class:`Locked`, it answers ``423 Locked`` at once, with
``Retry-After`` and the ticket; otherwise it sends the message with
``send_with_options(lease=lease)``, so the worker adopts that very lease,
and answers ``202 Accepted``. These helpers build the parts of those
answers; they use no web framework, so any of them can use them (see
``examples/flask_app.py`` and ``examples/fastapi_app.py``).

Why a ticket: a free key goes to the head of its line only, so a caller
that holds no place in it (``Leases.try_acquire`` without a waiter) is
answered busy for as long as workers queue on the key, for ever under steady
contention. A ticket is such a place for a web client: the first busy answer
hands one out (and takes no place, so a client that never sends it back
leaves nothing behind); asked with it, the client joins the line, ordered by
the time it first came with the ticket, keeps its place by asking again
within ``Retry-After`` (at most :data:`KEEP_PLACE_S` seconds), and is granted
the key when its turn comes, before the workers that queued after it. A
ticket not sent back for 10 s (13 s far back in the line) loses its place,
as a vanished waiter does, after holding the key free for the workers behind
it for at most that long; a client that comes back later joins at the end.
A ticket is spent by its 202: the client drops it then, and sends one request
at a time with it, since a request that comes with it after its grant (a
double submit, a retry of a 202 that was lost) takes a new place, for a
second job.

``Retry-After`` says when asking again can change the answer:

* no place, nobody waiting: when the holder's lease ends at the latest
  (its TTL left, which a heartbeat may extend);
* no place, waiters in the line: 1 s, to come back with the ticket and take
  a place (without one, the key is never this caller's while the line is
  non-empty);
* a place in the line: the holder's TTL left, at most :data:`KEEP_PLACE_S`
  (the key may be released, and go to this caller, at any moment; it must
  ask again within ten seconds of its turn to keep it).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .core import Busy, Lease, LeaseError, LeaseInfo, Leases
from .core.protocol import Wait

#: ``423 Locked`` (RFC 4918): the resource is locked; here, a job for it is running.
HTTP_423_LOCKED: Final = 423

#: ``202 Accepted``: the job was queued.
HTTP_202_ACCEPTED: Final = 202

#: The header of a 423 answer carrying the caller's ticket, and of the request that sends it back.
TICKET_HEADER: Final = "Lease-Ticket"

#: The longest ``Retry-After`` (s) of a caller with a place in the line: well inside the time a waiter
#: whose turn came has to show up (``PROMOTE_MS``, 10 s), so a slow request still keeps its place.
KEEP_PLACE_S: Final = 3

#: How long a web caller's place far back in the line stays parked between two of its asks (ms): it
#: comes back within ``KEEP_PLACE_S``; the line keeps the place this long plus ``PROMOTE_MS``.
WEB_PARK_MS: Final = KEEP_PLACE_S * 1000

# A ticket is ours (32 hex digits) and its waiter id has a prefix no message's waiter id has
# ("<message id>:<retries>"): a client can neither forge a worker's place nor send anything odd to Redis.
_TICKET = re.compile(r"[0-9a-f]{32}")
_WAITER_PREFIX = "web:"


def new_ticket() -> str:
    """A fresh ticket: 128 random bits, as 32 lowercase hex digits."""
    return secrets.token_hex(16)


def valid_ticket(ticket: str | None) -> str | None:
    """The ticket a client sent, if it is one of ours (surrounding spaces dropped), else ``None``."""
    if ticket is None or not _TICKET.fullmatch(ticket.strip()):
        return None
    return ticket.strip()


def waiter_of(ticket: str) -> str:
    """The waiter id of a (valid) ticket in the key's line."""
    return _WAITER_PREFIX + ticket


@dataclass(frozen=True)
class Locked:
    """The busy answer of :func:`try_acquire`: the key is taken, and the ticket to send back.

    Attributes:
      busy: the :class:`Busy` answer of the acquire.
      ticket: what the client sends back in :data:`TICKET_HEADER` (the same one while it keeps its place).
      place: the place the ticket holds in the key's line (0: next; -1: none).
    """

    busy: Busy
    ticket: str
    place: int = -1

    @property
    def key(self) -> str:
        """The lease key."""
        return self.busy.key

    def __bool__(self) -> bool:
        return False  # as Busy: ``if web.try_acquire(...):`` reads as "if acquired"


def try_acquire(
    leases: Leases,
    key: str,
    ttl: int,
    *,
    ticket: str | None = None,
    max_hold: int | None = None,
    meta: Mapping[str, str] | None = None,
    token: str | None = None,
) -> Lease | Locked:
    """Acquire ``key`` for a web request, with a place in its line if the client sent its ``ticket`` back.

    Without a ticket (or with one that is not ours), this is
    :meth:`Leases.try_acquire` without a waiter: it takes the key if it is
    free and nobody waits, and changes nothing otherwise; a busy answer
    carries a new ticket. With a ticket, the caller joins the key's line
    (or keeps its place) and never waits in place: the key is its when free
    and its turn has come.

    Parameters:
      leases: the lease store the workers use (same prefix).
      key: the job's lease key.
      ttl: the lease's TTL in ms: it must cover the time the message waits in the queue before a worker
        adopts it (nobody renews it until then).
      ticket: what the client sent in :data:`TICKET_HEADER`, if anything.
      max_hold, meta, token: as :meth:`Leases.try_acquire`.

    Returns:
      the :class:`Lease` (hand it to the message), or :class:`Locked`.

    Raises:
      LeaseUnavailableError: Redis could not be asked (answer 503); as :meth:`Leases.try_acquire`.
    """
    mine = valid_ticket(ticket)
    if mine is not None:
        # Mode "join, never wait in place": a web request cannot block a thread on the wake list.
        result = leases.line.join(
            key, ttl, max_hold=max_hold, meta=meta, token=token, waiter=waiter_of(mine), park_ms=WEB_PARK_MS
        )
        if isinstance(result, Lease):
            return result
        if result.wait is not Wait.DUPLICATE:
            return Locked(result.busy(), mine, result.place)
        # A ticket recorded as done (never the case for ours, whose grants leave the line at once): ask as a
        # newcomer, with a new ticket.
    got = leases.try_acquire(key, ttl, max_hold=max_hold, meta=meta, token=token)
    return got if isinstance(got, Lease) else Locked(got, new_ticket())


def _busy_of(answer: Busy | Locked) -> tuple[Busy, str | None, int]:
    """The busy answer, the ticket (``None``: none) and the ticket's place (-1: none) of ``answer``."""
    return (answer.busy, answer.ticket, answer.place) if isinstance(answer, Locked) else (answer, None, -1)


def retry_after(answer: Busy | Locked) -> int:
    """Whole seconds after which asking again can change the answer (``Retry-After``; see the module docstring)."""
    busy, _, place = _busy_of(answer)
    holder = busy.retry_after  # the holder's TTL left, rounded up; 1 for a key without TTL
    if place >= 0:  # a place in the line: come back in time to keep it
        if busy.ttl_left == 0:  # free, being handed to the head of the line
            return 1
        return max(1, min(KEEP_PLACE_S, holder if busy.ttl_left > 0 else KEEP_PLACE_S))
    if busy.line > 0:  # no place, and the line goes first: take a place at once
        return 1
    return holder


def locked_response_headers(answer: Busy | Locked) -> dict[str, str]:
    """Headers of a 423 answer: ``Retry-After`` (:func:`retry_after`) and, for :class:`Locked`, the ticket."""
    _, ticket, _ = _busy_of(answer)
    headers = {"Retry-After": str(retry_after(answer))}
    if ticket is not None:
        headers[TICKET_HEADER] = ticket
    return headers


def locked_body(answer: Busy | Locked, detail: str | None = None) -> dict[str, Any]:
    """A JSON-ready body for a 423 answer: what is locked, when to retry, and the caller's place.

    Fields: ``error`` ("locked"), ``key``, ``retry_after`` (as the header),
    ``detail`` (in words), ``line_length`` (waiters in the key's line),
    ``place`` (waiters ahead of this caller, 0: next; ``null``: it holds no
    place) and, for :class:`Locked`, ``ticket``.
    """
    busy, ticket, held = _busy_of(answer)
    seconds = retry_after(answer)
    place = held if held >= 0 else None
    if detail is None:
        if place is not None:
            ahead = "next in line" if place == 0 else f"number {place + 1} in its line of {busy.line}"
            detail = (
                f"A job for {busy.key!r} is running; this request is {ahead}. Ask again with the same "
                f"ticket within {seconds} s to keep that place."
            )
        elif busy.line > 0:
            detail = (
                f"A job for {busy.key!r} is running and {busy.line} more wait for it. A request without a "
                "place in their line gets it only once the line is empty"
                + (": send the ticket back to take a place." if ticket is not None else ".")
            )
        else:
            detail = f"A job for {busy.key!r} is already running; retry in {seconds} s."
    body: dict[str, Any] = {
        "error": "locked",
        "detail": detail,
        "key": busy.key,
        "retry_after": seconds,
        "line_length": busy.line,
        "place": place,
    }
    if ticket is not None:
        body["ticket"] = ticket
    return body


def accepted_body(lease: Lease, message_id: str) -> dict[str, Any]:
    """A JSON-ready body for a 202 answer: the queued message and the fencing token its job will hold."""
    return {"key": lease.key, "fence": lease.fence, "message_id": message_id}


def _ends_last(info: LeaseInfo) -> float:
    return float("inf") if info.ttl_left < 0 else info.ttl_left


def status(leases: Leases, key: str) -> dict[str, Any]:
    """A JSON-ready answer to "may a job for ``key`` start now, and if not, when?", for a page to poll.

    A page that got ``423 Locked`` counts down from ``Retry-After``; polling
    this (a status endpoint) tells it that the key is free before the count
    ends (the job finished early) or not yet when it ends (a heartbeat
    renewed the lease), whether the holder still shows signs of life or its
    lease only waits out its TTL, and, for the job it queued, whether it
    ended or its worker vanished. Four reads, no write.

    Fields:

    * ``key``; ``free``: nobody holds the key and nobody waits in its line (a request without a
      ticket gets it now); ``held``: someone holds it; ``holders``: how many (more than one only
      for a key held by several at once);
    * of the holder whose lease ends last (each ``None`` when nobody holds the key): ``fence``;
      ``state``, its health (a :class:`~dramatiq_leases.core.State` value: ``"alive"``,
      ``"heartbeat_overdue"``, ...); ``running``: a worker holds it and renews it (it adopted the
      request's lease, or acquired the key itself), where ``False`` is a request's lease whose
      message is still queued; ``message_id``: the message it runs, from its metadata (a worker's
      lease names it; ``None`` for a request's); ``heartbeat_age``: seconds since its last renewal;
    * ``ttl_left``: seconds until the key is free by the TTLs alone (to the millisecond; 0 when
      nobody holds it, ``None`` for a key without TTL);
    * ``retry_after``: as :func:`retry_after` for a caller without a place: 0 when free, 1 when
      waiters are in the line (come back with the ticket to take a place), else ``ttl_left``
      rounded up;
    * ``line_length``: waiters in the key's line;
    * ``last_fence``: the key's last grant (0: none, or its fence counter is gone) and ``last``,
      what became of it: ``"held"``, ``"released"`` (its holder let go: the job ended),
      ``"expired"`` (nobody released it: it ran out its TTL, its holder gone) or ``None``. A page
      that queued fence *F* tells a job that ended from one whose worker vanished by these.

    Raises:
      LeaseUnavailableError: Redis could not be asked (answer 503).
    """
    counter = leases.fence_state(key)
    holders = leases.holders(key)
    line = leases.inspect_line(key).length
    holder = max(holders, key=_ends_last) if holders else None
    last_fence = counter.get("fence", 0)
    last: str | None = None
    if any(info.fence == last_fence for info in holders):
        last = "held"
    elif last_fence and not counter.get("width"):  # per slot (a key once held by several), no one record says
        last = "released" if counter.get("released", 0) >= last_fence else "expired"
    if holder is None:
        ttl_left: float | None = 0.0
        seconds = 1 if line else 0
    else:
        ttl_left = holder.ttl_left / 1000 if holder.ttl_left >= 0 else None
        seconds = retry_after(Busy(key, holder.ttl_left, holder.fence, line=line))
    return {
        "key": key,
        "free": holder is None and line == 0,
        "held": holder is not None,
        "holders": len(holders),
        "fence": holder.fence if holder else None,
        "state": holder.state.value if holder else None,
        "running": bool(holder.interval or holder.adopted_ms) if holder else None,
        "message_id": holder.meta.get("message_id") if holder else None,
        "heartbeat_age": holder.heartbeat_age if holder else None,
        "ttl_left": ttl_left,
        "retry_after": seconds,
        "line_length": line,
        "last_fence": last_fence,
        "last": last,
    }


class LockedError(LeaseError):
    """Raise from a handler when the key is busy; turn it into a 423 in one error handler.

    Attributes:
      busy: the :class:`Busy` answer of the acquire.
      locked: the :class:`Locked` answer, if the handler used :func:`try_acquire` (it carries the ticket).
      status_code: always :data:`HTTP_423_LOCKED`.
    """

    status_code: Final = HTTP_423_LOCKED

    def __init__(self, answer: Busy | Locked, detail: str | None = None) -> None:
        self.busy, _, _ = _busy_of(answer)
        self.locked = answer if isinstance(answer, Locked) else None
        self.answer = answer
        self.detail = detail
        super().__init__(locked_body(answer, detail)["detail"], key=self.busy.key)

    @property
    def headers(self) -> dict[str, str]:
        """The response headers (``Retry-After``, and the ticket)."""
        return locked_response_headers(self.answer)

    @property
    def body(self) -> dict[str, Any]:
        """The JSON-ready response body."""
        return locked_body(self.answer, self.detail)


__all__ = [
    "HTTP_202_ACCEPTED",
    "HTTP_423_LOCKED",
    "KEEP_PLACE_S",
    "TICKET_HEADER",
    "Locked",
    "LockedError",
    "accepted_body",
    "locked_body",
    "locked_response_headers",
    "new_ticket",
    "retry_after",
    "status",
    "try_acquire",
    "valid_ticket",
]
