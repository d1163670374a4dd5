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
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from .scripts import MAX_LIMIT

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
    #: in the line: ``lock_on_busy="latest"``); ``gave_up`` (``lock_max_wait`` spent).
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
    #: a ``superseded``; ``fence N``, the grant holding the key now, of a ``lost`` by ``stolen``.
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
