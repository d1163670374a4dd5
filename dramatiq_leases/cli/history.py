"""``show KEY --history``: a key's history as a table, oldest event first, and who an operator is."""

from __future__ import annotations

import getpass
import socket
from collections.abc import Sequence
from typing import TextIO

from ..core.history import HistoryEvent
from .render import _table, timestamp

#: The events in words, for the table's last column.
_WORDS = {
    "granted": "granted",
    "released": "released by its holder",
    "force_released": "released by an operator",
    "lost": "lost by its holder",
    "expired": "found ended by its TTL (never released) at the next grant",
    "adopted": "adopted (a handed-over lease)",
    "duplicate": "refused as a duplicate (a copy of a message that already ran, or a lock_unique send)",
    "skipped": "not run: its key was full",
    "failed": "not run: its key was full (dead-lettered)",
    "superseded": "not run: a newer message took its place in the line",
    "gave_up": "given up: waited past lock_max_wait",
    "rate_limited": "released by its holder, rate limited (RateLimited): the key held back",
    "debounced": "not run: a newer send of its burst runs instead (lock_debounce)",
}


def detail(event: HistoryEvent) -> str:
    """What happened, in words, with its reason, who caused it and how long the message waited."""
    words = [_WORDS.get(event.event, event.event)]
    if event.reason:
        words.append(f"({event.reason})")
    if event.by:
        words.append(f"by {event.by}")
    if event.waited_ms:
        words.append(f"after waiting {event.waited_ms / 1000:.1f}s")
    return " ".join(words)


def write_history(key: str, events: Sequence[HistoryEvent], out: TextIO) -> None:
    """The history of ``key``, oldest first: one row per event (fence ``-`` for an event about no grant)."""
    if not events:
        out.write(
            f"no history of {key!r}: its workers keep none (LeaseMiddleware(history=N)), "
            "or nothing happened to it for a week\n"
        )
        return
    out.write(f"history of {key!r}, oldest first ({len(events)} events):\n")
    rows = [["TIME (UTC)", "EVENT", "FENCE", "SLOT", "MESSAGE", "ACTOR", "HOLDER", "WHAT"]]
    for event in events:
        rows.append(
            [
                timestamp(event.time_ms),
                event.event,
                str(event.fence) if event.fence else "-",
                "-" if event.slot is None else str(event.slot),
                event.message_id or event.waiter or "-",
                event.actor or "-",
                event.holder or "-",
                detail(event),
            ]
        )
    _table(rows, out)


def operator() -> str:
    """Who runs this command, as ``user@host``, for the history's ``force_released`` events."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name (a container without one): the host still says where
        user = "?"
    return f"{user}@{socket.gethostname()}"
