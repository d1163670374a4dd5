"""A key's history: what happened to its lease, one event per change, kept in Redis beside the lease.

Opt-in (``Leases(history=N)``, ``LeaseMiddleware(history=N)``): the scripts that change a key's state append
an event in the same step (``history_append`` in ``lua/prelude.lua``), to a list in the key's hash slot
(:func:`~.keys.history_name`), capped to the newest N events and kept :data:`~.scripts.HISTORY_MS` (a week)
after the last one. The few events decided outside a script (a skip, a message given up) are appended by
the :data:`~.scripts.HISTORY` script right after. Off (the default), no script makes any extra call.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import redis

from . import scripts
from .client import unavailable
from .errors import LeaseConfigError, LeaseStateError
from .info import meta_args
from .keys import history_name, validate_key
from .numbers import whole_count, whole_ms
from .runner import ScriptRunner
from .scripts import MAX_ID_LENGTH, MAX_LIMIT

#: Every event a history holds, in the words :attr:`HistoryEvent.event` uses.
EVENTS = (
    "granted",
    "released",
    "lost",
    "expired",
    "adopted",
    "duplicate",
    "skipped",
    "failed",
    "superseded",
    "gave_up",
    "force_released",
    "rate_limited",
    "debounced",
)


@dataclass(frozen=True)
class HistoryEvent:
    """One change of a key's lease, as its history recorded it (oldest first in :meth:`Leases.history`).

    Events about a grant that no longer knows its holder (``expired``, ``lost``) name the holder of their
    fence's ``granted`` event, if the history still has it. :attr:`message_id`, :attr:`actor` and :attr:`holder`
    are cut to their first 512 bytes (``scripts.MAX_ID_LENGTH``, at a UTF-8 boundary): each event is bounded.
    """

    #: What happened: ``granted``; ``released`` (by its holder); ``force_released`` (by an operator:
    #: ``release --if-dead``, or ``release --owner`` from the CLI; :attr:`by` names them if known);
    #: ``lost`` (its holder's heartbeat found it gone, stolen or past its maximum hold: :attr:`reason`);
    #: ``expired`` (a grant found that the previous one, of :attr:`fence`, had ended by its TTL, never
    #: released: a holder killed or cut off); ``adopted`` (a handed-over lease taken over by a worker);
    #: ``duplicate`` (a copy of a message that already ran, not run; or a send ``lock_unique`` refused,
    #: :attr:`by` naming the message holding the record); ``skipped`` and ``failed`` (the key
    #: was full and ``lock_on_busy`` said so); ``superseded`` (a newer message of the key took its place
    #: in the line: ``lock_on_busy="latest"``); ``gave_up`` (``lock_max_wait`` spent); ``rate_limited`` (released
    #: by its holder, whose actor raised ``RateLimited``, holding the key back: :attr:`reason` says how long, and
    #: :attr:`waiter` is the message that runs first after); ``debounced`` (not run: a newer send of its burst,
    #: :attr:`by`, runs instead: ``lock_debounce``).
    event: str
    #: When, in the Redis server's Unix time (ms).
    time_ms: int
    #: The fence of the grant the event is about (0: none, such as a message that never held the key).
    fence: int = 0
    #: The message's id (from the holder's metadata, or its waiter id); ``""`` if unknown.
    message_id: str = ""
    #: The actor's name; ``""`` if unknown.
    actor: str = ""
    #: The holder's process, ``host:pid``; ``""`` if unknown.
    holder: str = ""
    #: Why, for ``lost`` (``gone``, ``stolen``, ``max_hold``), ``force_released`` (``dead``: its holder's
    #: deadline had passed; ``owner``: released with its token), and events given a reason by their caller.
    reason: str = ""
    #: Who caused it, when known: the operator (``user@host``) of a ``force_released``; the newer waiter of
    #: a ``superseded``; ``fence N``, the grant holding the key now, of a ``lost`` by ``stolen``; the message
    #: that runs instead of a ``debounced``.
    by: str = ""
    #: The holder slot, on a key held by several at once (``lock_limit``); ``None`` otherwise.
    slot: int | None = None
    #: The message's waiter id in the key's line (``<message id>:<retries>``); ``""`` if it has none.
    waiter: str = ""
    #: How long the message had waited for the key (ms), for a ``gave_up`` or ``skipped``; 0 if not known.
    waited_ms: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The event as plain JSON values (``show --history --json``, the exporter's ``/leases/history``)."""
        return {
            "event": self.event,
            "time_ms": self.time_ms,
            "fence": self.fence,
            "message_id": self.message_id,
            "actor": self.actor,
            "holder": self.holder,
            "reason": self.reason,
            "by": self.by,
            "slot": self.slot,
            "waiter": self.waiter,
            "waited_ms": self.waited_ms,
        }


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


#: The largest number an event's field is read as (Redis's integers): one past it, written by hand, reads as 0.
_MAX_WHOLE = 2**63 - 1


def _whole(value: Any) -> int:
    """A number the scripts wrote as text (a fence may have 16 digits) or as a JSON number; 0 if neither, or
    if it is no whole number from 0 to ``_MAX_WHOLE`` (infinite, NaN, negative: written by hand)."""
    if isinstance(value, bool):
        return 0
    if (isinstance(value, float) and math.isfinite(value)) or (
        isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19
    ):
        value = int(value)
    return value if isinstance(value, int) and 0 <= value <= _MAX_WHOLE else 0


def _slot(value: Any) -> int | None:
    """A holder slot, 0 to ``MAX_LIMIT - 1``; ``None`` if the event names none (or none that can be one)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_LIMIT:
        return value
    return None


def _event(raw: str | bytes) -> HistoryEvent | None:
    """One entry of the list, or ``None`` if it is not an event (written by hand)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("e"), str):
        return None
    return HistoryEvent(
        event=data["e"],
        time_ms=_whole(data.get("t")),
        fence=_whole(data.get("f")),
        message_id=_text(data.get("m")),
        actor=_text(data.get("a")),
        holder=_text(data.get("h")),
        reason=_text(data.get("r")),
        by=_text(data.get("by")),
        slot=_slot(data.get("s")),
        waiter=_text(data.get("w")),
        waited_ms=_whole(data.get("wt")),
    )


def parse(entries: Iterable[str | bytes]) -> list[HistoryEvent]:
    """The events of a history list as Redis holds it (newest first), oldest first; an event that does not
    name its holder takes the holder of its fence's ``granted`` event (so an ``expired`` says whose grant)."""
    events = [e for e in (_event(raw) for raw in entries) if e is not None]
    events.reverse()
    grants: dict[int, HistoryEvent] = {}
    out: list[HistoryEvent] = []
    for event in events:
        if event.event in ("granted", "adopted") and event.fence:
            grants[event.fence] = event
        elif event.fence and not event.message_id and event.fence in grants:
            grant = grants[event.fence]
            event = replace(
                event,
                message_id=grant.message_id,
                actor=event.actor or grant.actor,
                holder=event.holder or grant.holder,
                waiter=event.waiter or grant.waiter,
                slot=grant.slot if event.slot is None else event.slot,
            )
        out.append(event)
    return out


class History:
    """The histories of a store's keys under ``prefix``: read, and appended to outside the scripts (for the store,
    not a user API). ``cap``: how many events each key's history keeps (0: none kept)."""

    def __init__(self, runner: ScriptRunner, prefix: str, cap: int) -> None:
        self.runner = runner
        self.prefix = prefix
        self.cap = cap
        self._script = runner.register(scripts.HISTORY)

    def read(self, key: str) -> list[HistoryEvent]:
        """:meth:`~.store.Leases.history`."""
        name = history_name(self.prefix, validate_key(key))
        with unavailable(f"read the history of {key!r}", key):
            try:
                entries = self.runner.client.lrange(name, 0, -1)
            except redis.ResponseError as e:
                if "WRONGTYPE" not in str(e):
                    raise
                raise LeaseStateError(f"the history of {key!r} ({name}) is not a list: {e}", key=key) from None
        return parse(entries)

    def record(
        self,
        key: str,
        event: str,
        *,
        fence: int,
        reason: str,
        meta: Mapping[str, str] | None,
        waited_ms: int,
        by: str = "",
    ) -> None:
        """:meth:`~.store.Leases.record_history`."""
        if not self.cap:
            return
        validate_key(key)
        if event not in _RECORDED:
            raise LeaseConfigError(f"record_history: event must be one of {_RECORDED}, got {event!r}")
        fence = whole_count(fence, "fence", maximum=2**53, owner="record_history")
        for name, text in (("reason", reason), ("by", by)):
            if not isinstance(text, str) or len(text.encode()) > MAX_ID_LENGTH:  # the scripts count bytes
                raise LeaseConfigError(f"record_history: {name} must be a string of at most {MAX_ID_LENGTH} bytes")
        waited_ms = whole_ms(waited_ms, "waited_ms", minimum=0, owner="record_history")
        packed = meta_args(key, dict(meta or {}))  # checked as a lease's metadata is
        args = [self.cap, event, fence, reason, packed[3] if len(packed) > 2 else "", waited_ms, by]
        with unavailable(f"record the history of {key!r}", key):
            self.runner.call(self._script, [history_name(self.prefix, key)], args)


#: The events decided outside the scripts, which :meth:`Histories.record_history` appends.
_RECORDED = ("skipped", "failed", "gave_up", "debounced")


class Histories:
    """The history methods of a :class:`~.store.Leases` (one of its base classes), through its :class:`History`."""

    def __init__(self, history: History) -> None:
        self._history = history

    def history(self, key: str) -> list[HistoryEvent]:
        """The history of ``key``, oldest event first (empty if it has none: the store's ``history`` is off,
        or nothing happened to the key for a week). Readable whatever this store's own ``history`` setting.

        Raises:
          LeaseStateError: the history's Redis key is of another type (written by hand).
          LeaseUnavailableError: Redis could not be asked.
        """
        return self._history.read(key)

    def record_history(
        self,
        key: str,
        event: str,
        *,
        fence: int = 0,
        reason: str = "",
        meta: Mapping[str, str] | None = None,
        waited_ms: int = 0,
        by: str = "",
    ) -> None:
        """Append an event decided outside the scripts (``skipped``, ``failed``, ``gave_up``, ``debounced``) to the
        history of ``key``, stamped with the server's time; nothing (no call) if this store keeps no history.
        ``meta``: the message's metadata (``message_id``, ``actor``, ``host``, ``pid``), named in the event;
        ``waited_ms``: how long it had waited for the key; ``by``: who or what caused it.

        Raises:
          LeaseConfigError: an unknown ``event``, a ``fence`` or ``waited_ms`` that is not a whole number, a
            ``reason`` or ``by`` over 512 bytes (UTF-8), or ``meta`` that is not strings.
          LeaseUnavailableError: Redis could not be asked.
        """
        self._history.record(key, event, fence=fence, reason=reason, meta=meta, waited_ms=waited_ms, by=by)
