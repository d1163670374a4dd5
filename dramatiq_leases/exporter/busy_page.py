"""The Busy-page view: which leases are held now, worst first, and which keys have the longest lines.

Built from one scan's leases and lines (no Redis call of its own), bounded to
the top N rows of each table, and served as JSON by the exporter (its shape, an API:
docs/reference.md, "The Busy view"). Lease keys appear here and never in
metric labels: they are unbounded and may carry user ids.
"""

from __future__ import annotations

import fnmatch
import heapq
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..core import LeaseInfo, State
from ..core.keys import lease_name
from ..core.reading import LineInfo

#: Default bound on the rows of each table (``--top``).
DEFAULT_TOP = 50

#: The tail of a holder slot's lease hash: ``:s``, s from 1.
_SLOT = re.compile(r":[1-9]\d{0,2}")


class LeaseRow(TypedDict):
    """One held lease, as of the scan (docs/reference.md, "The Busy view")."""

    key: str
    actor: str
    queue: str
    message_id: str
    host: str
    pid: int | None
    fence: int
    state: str
    leaked: bool
    age_seconds: float | None
    heartbeat_age_seconds: float | None
    ttl_left_seconds: float | None
    line_length: int
    inspect_command: str | None
    slot: int
    holders: int
    limit: int


class HotKeyRow(TypedDict):
    """One key with waiters in its line, as of the scan (docs/reference.md, "The Busy view")."""

    key: str
    line_length: int
    oldest_wait_seconds: float
    waiting_in_place: int
    parked: int
    promoted: int
    actor: str
    held: bool
    state: str
    inspect_command: str | None
    holders: int
    limit: int
    waiting_for: str
    next_start_ms: int | None


@dataclass(frozen=True)
class BusyPage:
    """The top rows of one scan: held leases worst first, and the keys with the longest lines.

    Attributes:
      leases: at most ``top`` lease rows, most worrying first.
      hot_keys: at most ``top`` rows of keys with waiters, longest line first.
      leases_total: how many leases the scan saw (``leases`` may be fewer).
      hot_keys_total: how many keys had waiters.
    """

    leases: list[LeaseRow] = field(default_factory=list)
    hot_keys: list[HotKeyRow] = field(default_factory=list)
    leases_total: int = 0
    hot_keys_total: int = 0


def shell_quote(word: str) -> str:
    """``word`` in single quotes, safe to paste into a POSIX shell (always quoted, for a uniform column)."""
    return "'" + word.replace("'", "'\"'\"'") + "'"


def inspect_command(key: str, cli_options: Sequence[str] = ()) -> str:
    """The ``dramatiq-leases show`` command line that inspects ``key``.

    ``cli_options``: global arguments to put before ``show`` (the exporter's
    non-default ``--redis-url`` and ``--prefix``), quoted only where needed.
    """
    options = "".join(" " + shlex.quote(word) for word in cli_options)
    # "--" keeps a key starting with "-" from being read as an option.
    return f"dramatiq-leases{options} show {'-- ' if key.startswith('-') else ''}{shell_quote(key)}"


def hash_tag_of(name: str, prefix: str, kind: str) -> str | None:
    """The hash tag of a Redis key ``{prefix}:{kind}:{tag}``, or ``None`` if it is not one; for ``kind`` ``lease``,
    also of holder slot ``s``'s ``{prefix}:lease:{tag}:s`` (a key several hold at once)."""
    head = f"{prefix}:{kind}:{{"
    if not name.startswith(head):
        return None
    tag, brace, tail = name[len(head) :].partition("}")
    if not brace or (tail and not (kind == "lease" and _SLOT.fullmatch(tail))):
        return None
    return tag


def _show_key(prefix: str, redis_key: str, candidates: Iterable[str], slot: int = 0) -> str | None:
    """A key that ``show`` maps back to ``redis_key`` (the lease hash of ``slot``): the lease's own, else its hash
    tag (a digest or debris)."""
    for key in candidates:
        if key and len(key) <= 1024 and lease_name(prefix, key, slot) == redis_key:
            return key
    return None


def _worry(info: LeaseInfo) -> tuple[int, int, str, int]:
    """Sort key, most worrying first: leaked, then overdue, then the oldest grant."""
    return (_rank(info.state), info.acquired_ms, info.key, info.slot)


def _rank(state: State) -> int:
    return 0 if state.leaked else 1 if state is State.HEARTBEAT_OVERDUE else 2


def _pid(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def build(
    infos: Sequence[LeaseInfo],
    lines: Sequence[LineInfo],
    *,
    prefix: str,
    top: int = DEFAULT_TOP,
    cli_options: Sequence[str] = (),
    match: str = "*",
) -> BusyPage:
    """The Busy page of one scan's ``infos`` and ``lines``: ``O(leases + lines)``, plus ``log top`` per row."""
    line_of: dict[str, LineInfo] = {}  # by hash tag, shared by a lease and its line
    for line in lines:
        tag = hash_tag_of(line.name, prefix, "line")
        if tag is not None and line.length:
            line_of[tag] = line
    holders_of: dict[str, list[LeaseInfo]] = {}  # every holder of a key, by its hash tag
    for info in infos:
        tag = hash_tag_of(info.redis_key, prefix, "lease")
        if tag is not None:
            holders_of.setdefault(tag, []).append(info)

    rows: list[LeaseRow] = []
    for info in heapq.nsmallest(top, infos, key=_worry):
        tag = hash_tag_of(info.redis_key, prefix, "lease") or ""
        waiting = line_of.get(tag)
        state = info.state
        key = _show_key(prefix, info.redis_key, (info.key, tag), info.slot)
        holders = holders_of.get(tag, [info])
        rows.append(
            LeaseRow(
                key=info.key,
                actor=info.meta.get("actor", ""),
                queue=info.meta.get("queue", ""),
                message_id=info.meta.get("message_id", ""),
                host=info.meta.get("host", ""),
                pid=_pid(info.meta.get("pid", "")),
                fence=info.fence,
                state=state.value,
                leaked=state.leaked,
                # A hash without these fields (debris) has no age to show.
                age_seconds=info.age if info.acquired_ms else None,
                heartbeat_age_seconds=info.heartbeat_age if info.renewed_ms else None,
                ttl_left_seconds=info.ttl_left / 1000 if info.ttl_left >= 0 else None,
                line_length=waiting.length if waiting else 0,
                inspect_command=inspect_command(key, cli_options) if key is not None else None,
                slot=info.slot,
                holders=len(holders),
                limit=key_limit(holders),
            )
        )

    # A held key is shown by its own name; a free one (between holders) by its hash tag, which `show` accepts.
    hot: list[tuple[str, LineInfo, list[LeaseInfo]]] = []
    for tag, line in line_of.items():
        held = holders_of.get(tag, [])
        name = held[0].key if held else tag
        if match == "*" or fnmatch.fnmatchcase(name, match):
            hot.append((name, line, held))
    hot_rows: list[HotKeyRow] = []
    for name, line, held in heapq.nsmallest(top, hot, key=lambda h: (-h[1].length, h[1].oldest_first_ms, h[0])):
        first = held[0] if held else None
        redis_key = first.redis_key if first is not None else lease_name(prefix, name)
        slot = first.slot if first is not None else 0
        key = _show_key(prefix, redis_key, (name, hash_tag_of(redis_key, prefix, "lease") or ""), slot)
        # The worst holder's state speaks for the key (a leak among its holders first).
        worst = min(held, key=lambda info: (_rank(info.state), info.slot), default=None)
        hot_rows.append(
            HotKeyRow(
                key=name,
                line_length=line.length,
                oldest_wait_seconds=line.oldest_wait,
                waiting_in_place=line.states.get("in_place", 0),
                parked=line.states.get("parked", 0),
                promoted=line.states.get("promoted", 0),
                actor=_most_waiting(line.actors),
                held=bool(held),
                state=worst.state.value if worst is not None else "free",
                inspect_command=inspect_command(key, cli_options) if key is not None else None,
                holders=len(held),
                limit=key_limit(held),
                # Over its rate, the key starts nobody before then, whoever holds it.
                waiting_for="rate" if line.waiting_for_rate else "holder",
                next_start_ms=line.next_start_ms if line.waiting_for_rate else None,
            )
        )
    return BusyPage(rows, hot_rows, len(infos), len(hot))


def key_limit(holders: Sequence[LeaseInfo]) -> int:
    """How many may hold a key at once, as its holders were granted: the highest of their limits (1 if none)."""
    return max((info.limit for info in holders), default=1)


def _most_waiting(actors: Mapping[str, int]) -> str:
    """The actor with the most waiters in a line (``""`` if none)."""
    return min(actors.items(), key=lambda a: (-a[1], a[0]))[0] if actors else ""


def as_json(
    page: BusyPage, *, scanned_at: float | None, scan_duration: float, top: int, limit: int | None = None
) -> dict[str, Any]:
    """The JSON document of ``GET /leases``: ``page`` cut to ``limit`` rows (at most ``top``)."""
    limit = top if limit is None else max(0, min(limit, top))
    return {
        "scanned_at": scanned_at,
        "scan_duration_seconds": scan_duration,
        "limit": limit,
        "leases_total": page.leases_total,
        "hot_keys_total": page.hot_keys_total,
        "leases": page.leases[:limit],
        "hot_keys": page.hot_keys[:limit],
    }
