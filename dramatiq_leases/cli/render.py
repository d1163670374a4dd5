"""How ``dramatiq-leases`` puts leases into words: durations, times, tables, states and verdicts.

Keys and holder metadata are whatever was written to Redis, by anyone who can write there or send a message:
every human-readable output shows their control characters as escapes (:func:`printable`), so that a key
holding ``ESC[1A ESC[2K`` cannot erase the row above it and forge another on the operator's screen.
``--json`` needs none of this: :func:`json.dump` escapes them (and, with its default ``ensure_ascii``, every
character outside ASCII).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import IO, Any, TextIO

from ..core import DeadRelease, LeaseInfo, State, stale_after
from ..core.reading import LineInfo


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal may act on or hide shown as an escape, as ``repr`` does.

    C0 controls (newline and tab included), DEL, C1 controls, the format characters (bidirectional overrides
    such as U+202E, zero-width characters), separators other than the space, surrogates, private-use and
    unassigned code points: whatever :meth:`str.isprintable` refuses becomes ``\\x1b``, ``\\u202e`` or
    ``\\U000e0001``. A backslash is left as it is, so the text of a key stays copyable and escaping twice
    changes nothing (a key spelling ``\\x1b`` out reads as one holding ESC would: neither moves the cursor).
    """
    if text.isprintable():  # the common case: nothing to do
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


class PrintableWriter:
    """A text stream's ``write`` that shows control characters as escapes (:func:`printable`), newlines apart.

    The CLI's human output goes through one, as a second guard behind the escaping of each field: a line added
    later that prints a field raw still cannot move the cursor or recolour the screen (though a newline in
    that field would start a line of its own: fields must still be escaped). JSON passes through unchanged.
    """

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        """Write ``text`` escaped, keeping its newlines; returns ``len(text)``, as a stream's ``write`` does."""
        self.stream.write("\n".join(map(printable, text.split("\n"))))
        return len(text)

    def flush(self) -> None:
        """Flush the stream."""
        self.stream.flush()


def format_duration(seconds: float | None) -> str:
    """A short human duration: ``10ms``, ``0.4s``, ``12.0s``, ``3m04s``, ``2h05m``, ``3d04h``; ``-`` for ``None``."""
    if seconds is None:
        return "-"
    if 0 < seconds < 0.1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def is_lease(info: LeaseInfo) -> bool:
    """Whether the key is a lease hash."""
    # Every lease hash carries a token; anything else under the prefix is debris.
    return bool(info.token)


def _holder(info: LeaseInfo) -> str:
    host, pid = info.meta.get("host", ""), info.meta.get("pid", "")
    return f"{host}:{pid}" if host or pid else "-"


def holder(info: LeaseInfo) -> str:
    """The holder as ``host:pid``, or ``-``, for a terminal (:func:`printable`; ``--json`` has it as written)."""
    return printable(_holder(info))


def ttl_left(info: LeaseInfo) -> str:
    """The key's remaining TTL as a duration, or ``none``."""
    return "none" if info.ttl_left == -1 else format_duration(info.ttl_left / 1000)


def overdue_after(info: LeaseInfo) -> float | None:
    """Seconds without a renewal after which the heartbeat counts as overdue (a warning, not death), or ``None``."""
    # interval 0: nobody heartbeats this lease (taken outside a worker); only its deadline and TTL end it.
    return stale_after(info.interval) / 1000 if info.interval else None


def deadline_in(info: LeaseInfo) -> float | None:
    """Seconds until the lease may be released: its holder's deadline plus safety margin (negative: past it)."""
    deadline = info.ends_ms
    return None if deadline is None else (deadline - info.now_ms) / 1000


def timestamp(ms: int) -> str:
    """``ms`` since the epoch as an ISO 8601 UTC time, to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")


def when(ms: int, now_ms: int) -> str:
    """``<time> (in <duration>)`` or ``<time> (<duration> ago)``."""
    delta = (ms - now_ms) / 1000
    ago = f"in {format_duration(delta)}" if delta >= 0 else f"{format_duration(-delta)} ago"
    return f"{timestamp(ms)} ({ago})"


def expires(info: LeaseInfo) -> str:
    """When the key ends by its TTL, as ``at <time> (in <duration>)``, or ``never (no TTL)``."""
    if info.ttl_left < 0:
        return "never (no TTL)"
    return f"at {timestamp(info.now_ms + info.ttl_left)} (in {format_duration(info.ttl_left / 1000)})"


def _ends(info: LeaseInfo, subject: str = "it") -> str:
    """How the key ends if nobody acts: by its TTL, or (no TTL) not at all, leaked once the holder's deadline passes."""
    if info.ttl_left < 0:
        return f"{subject} has no TTL, so after that deadline it is leaked (no_ttl) and never ends by itself"
    return f"{subject} ends by its TTL {expires(info)}"


def _by_max_hold(info: LeaseInfo) -> bool:
    """Whether the holder's deadline comes from the maximum hold rather than the last renewal."""
    deadline = info.holder_deadline_ms
    return bool(info.max_hold_until_ms) and deadline is not None and deadline >= info.max_hold_until_ms - info.margin


def lease_dict(info: LeaseInfo, problem: str | None) -> dict[str, Any]:
    """The JSON object of a lease, or of a key that is not a lease (``problem`` says why)."""
    if problem is None:
        return {**info.as_dict(), "leaked": info.state.leaked, "holder": _holder(info)}
    # Not a lease hash: its timestamps are absent, so report only what is real.
    return {
        "key": info.key,
        "redis_key": info.redis_key,
        "state": info.state.value,
        "leaked": info.state.leaked,
        "ttl_left": info.ttl_left,
        "problem": problem,
    }


def _table(rows: list[list[str]], out: TextIO) -> None:
    rows = [[printable(cell) for cell in row] for row in rows]  # escaped before measuring: escapes take room
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")


def key_limit(holders: Sequence[LeaseInfo], fences: Mapping[str, int]) -> int:
    """How many may hold a key at once: the highest limit its holders were granted under; with none, the fence
    counter's ``width`` (how many slots it may have held), else 1."""
    if holders:
        return max(info.limit for info in holders)
    return max(1, fences.get("width", 1))


def held_by(found: Sequence[LeaseInfo], problems: Mapping[str, str | None]) -> dict[str, tuple[int, int]]:
    """``{key: (holders, limit)}`` of the leases among ``found`` (each holder of a key held by several at once is
    one of them); keys of the wrong type are their own."""
    out: dict[str, tuple[int, int]] = {}
    for info in found:
        if problems[info.redis_key] is None:
            count, limit = out.get(info.key, (0, 1))
            out[info.key] = (count + 1, max(limit, info.limit))
    return out


def write_list(found: list[LeaseInfo], problems: dict[str, str | None], out: TextIO) -> None:
    """The table of ``list``, one row per holder (HELD: how many hold its key, of its limit), then a note on each
    stray key and on each state that calls for one."""
    held = held_by(found, problems)
    rows = [["KEY", "ACTOR", "MESSAGE", "HOLDER", "AGE", "TTL LEFT", "HEARTBEAT", "HELD", "FENCE", "STATE"]]
    for info in found:
        if problems[info.redis_key] is None:
            count, limit = held[info.key]
            rows.append(
                [
                    info.key,
                    info.meta.get("actor", "-"),
                    info.meta.get("message_id", "-"),
                    holder(info),
                    format_duration(info.age),
                    ttl_left(info),
                    format_duration(info.heartbeat_age) + " ago",
                    f"{count}/{limit}",
                    str(info.fence),
                    info.state.value,
                ]
            )
        else:
            rows.append([info.redis_key, "-", "-", "-", "-", ttl_left(info), "-", "-", "-", info.state.value])
    _table(rows, out)
    for info in found:
        problem = problems[info.redis_key]
        if problem is not None:
            out.write(f"note: {printable(info.redis_key)} is {problem}; no dramatiq-leases code wrote it.\n")
    states = {info.state for info in found}
    if State.HEARTBEAT_OVERDUE in states:
        out.write(
            "note: heartbeat_overdue: renewals are late, but the holder may still be running until its "
            "deadline; the lease then ends by its TTL. Investigate the holder; do not release it.\n"
        )
    if any(state.leaked for state in states):
        out.write(
            "note: holder_dead, past_max_hold, no_ttl: leaked, no holder can still believe it holds the "
            "lease; `release KEY --if-dead` frees it.\n"
        )


def state_note(info: LeaseInfo) -> str:
    """What the lease's state means, and what (not) to do about it."""
    state, deadline = info.state, info.holder_deadline_ms
    if state is State.ALIVE:
        if deadline is None:
            return f"not written by a dramatiq-leases holder (no holder deadline); it ends by its TTL {expires(info)}"
        if not info.interval:
            return (
                "not heartbeated (taken outside a worker, waiting to be adopted); its holder may rely on it "
                f"until {when(deadline, info.now_ms)}, and {_ends(info)}"
            )
        return f"the holder's heartbeat is renewing it (last {info.heartbeat_age:.1f}s ago)"
    if state is State.HEARTBEAT_OVERDUE:
        assert deadline is not None  # overdue only before a deadline
        return (
            f"renewals are late: none for {info.heartbeat_age:.1f}s (expected every "
            f"{format_duration(info.interval / 1000)}), but the holder may still be running under the lease "
            f"until its deadline {when(deadline, info.now_ms)}; {_ends(info, 'the lease')}. "
            "It is not leaked: investigate the holder, and leave the lease alone (ending it now could let "
            "a second worker run beside the first)"
        )
    if state is State.NO_TTL:
        past = (
            f"its holder's deadline and safety margin passed at {timestamp(deadline + info.margin)} and "
            if deadline is not None
            else ""
        )
        return f"leaked: {past}the key has no TTL, so it would never expire by itself; `release --if-dead` removes it"
    assert deadline is not None  # holder_dead and past_max_hold both have a deadline in the past
    why = (
        "its maximum hold ended"
        if state is State.PAST_MAX_HOLD
        else "its holder's deadline and the safety margin its actor had to stop passed"
    )
    return (
        f"leaked: {why} at {when(deadline + info.margin, info.now_ms)}, so no holder can still be "
        "running under it; its TTL was changed by hand; "
        f"it ends by its TTL {expires(info)}, or `release --if-dead` ends it now"
    )


def describe_line(line: LineInfo) -> str:
    """``3 waiting (1 in_place, 2 parked); head 5f2c...:0; oldest waiting 12.3s``, or ``empty``."""
    if not line.length:
        return "empty"
    states = ", ".join(f"{n} {state}" for state, n in sorted(line.states.items()))
    # Waiting for its rate (lock_rate) or a hold (RateLimited), not for a holder: when the next start may be.
    why = f"; waiting for rate: next start in {line.next_start_ms} ms" if line.waiting_for_rate else ""
    # Escaped whole: the head and the states are as the waiters' entries spell them.
    return printable(
        f"{line.length} waiting ({states}); head {line.head}; oldest waiting {format_duration(line.oldest_wait)}{why}"
    )


def line_dict(line: LineInfo) -> dict[str, Any]:
    """The line of a key for ``--json``."""
    return {
        "length": line.length,
        "head": line.head or None,
        "oldest_wait": line.oldest_wait,
        "states": line.states,
        "actors": line.actors,
        "waiting_for": "rate" if line.waiting_for_rate else "holder",
        "next_start_ms": line.next_start_ms if line.waiting_for_rate else None,
    }


#: The legacy records of a fence counter, as ``show`` names them (a key never held by several at once).
_COUNTER_FIELDS = ("expired", "fence", "released")
#: A slot's records (``g:<slot>``...), as ``show`` names them.
_SLOT_RECORDS = (("g", "granted"), ("r", "released"), ("e", "expired"))
#: Slots ``show`` lists by number in its ``holders`` line; past that, only how many.
_SLOTS_NAMED = 12


def describe_counter(fences: Mapping[str, int]) -> str:
    """The key-wide part of a fence counter: ``last fence 9, last released 4``, then ``width 3`` for a key held by
    several at once; ``none`` if there is no counter."""
    parts = [f"last {name} {fences[name]}" for name in _COUNTER_FIELDS if name in fences]
    if "width" in fences:
        parts.append(f"width {fences['width']}")
    return ", ".join(parts) or "none"


def slot_records(fences: Mapping[str, int], slot: int) -> str:
    """What the fence counter records of one slot: ``last granted 9, last released 7``; ``none`` if nothing."""
    parts = [f"last {name} {fences[f'{code}:{slot}']}" for code, name in _SLOT_RECORDS if f"{code}:{slot}" in fences]
    return ", ".join(parts) or "none"


def holders_summary(holders: Sequence[LeaseInfo], limit: int) -> str:
    """``2 of 3 (slots 0, 2)``: how many hold the key, of how many may, and in which slots."""
    slots = [str(info.slot) for info in holders]
    which = f" (slot{'s' if len(slots) > 1 else ''} {', '.join(slots)})" if 0 < len(slots) <= _SLOTS_NAMED else ""
    return f"{len(holders)} of {limit}{which}"


def _aligned(lines: Sequence[tuple[str, str]], out: TextIO, indent: str = "") -> None:
    # Field names too: the metadata's come from whoever wrote the hash.
    escaped = [(printable(name), printable(value)) for name, value in lines]
    width = max(len(name) for name, _ in escaped)
    for name, value in escaped:
        out.write(f"{indent}{name.ljust(width)}  {value}\n")


def write_show(
    info: LeaseInfo,
    token: str | None,
    fences: dict[str, int],
    line: LineInfo,
    out: TextIO,
    *,
    limit: int = 1,
) -> None:
    """The fields of ``show`` for a key of one holder, one per line, names aligned; ``token`` is ``None`` when
    hidden. A holder of a key that several may hold at once (``limit``) also has a ``holders`` line and its
    slot's records."""
    several = limit > 1 or info.slot > 0 or info.per_slot
    lines = [
        ("key", info.key),
        *([("holders", holders_summary([info], limit))] if several else []),
        *_holder_lines(info, token),
        ("fence counter", describe_counter(fences)),
        *([("slot records", slot_records(fences, info.slot))] if several else []),
        ("line", describe_line(line)),
    ]
    _aligned(lines, out)


def write_show_holders(
    key: str,
    holders: Sequence[tuple[LeaseInfo, str | None, str | None]],
    fences: dict[str, int],
    line: LineInfo,
    out: TextIO,
    *,
    limit: int,
) -> None:
    """``show`` of a key with several holders: the key's own lines, then a block per holder, by slot. Each of
    ``holders`` is (its info, its token or ``None`` when hidden, why it is not a lease hash or ``None``)."""
    _aligned(
        [
            ("key", key),
            ("holders", holders_summary([info for info, _, _ in holders], limit)),
            ("fence counter", describe_counter(fences)),
            ("line", describe_line(line)),
        ],
        out,
    )
    for info, token, problem in holders:
        out.write(f"\nslot {info.slot} (fence {info.fence}, {info.state.value})\n")
        if problem is not None:
            out.write(f"  {printable(info.redis_key)} is {problem} (TTL left: {ttl_left(info)}).\n")
            continue
        _aligned([*_holder_lines(info, token), ("slot records", slot_records(fences, info.slot))], out, "  ")


def _holder_lines(info: LeaseInfo, token: str | None) -> list[tuple[str, str]]:
    """One holder's lines of ``show``, from its Redis key to its adoption."""
    return [
        ("redis key", info.redis_key),
        ("state", f"{info.state.value}: {state_note(info)}"),
        ("fence", str(info.fence)),
        ("owner token", token if token is not None else "(hidden; --show-token prints it)"),
        *((name, value) for name, value in sorted(info.meta.items())),
        ("acquired", f"{timestamp(info.acquired_ms)} ({format_duration(info.age)} ago)"),
        ("last heartbeat", f"{timestamp(info.renewed_ms)} ({format_duration(info.heartbeat_age)} ago)"),
        ("renew interval", format_duration(info.interval / 1000)),
        (
            "overdue after",
            f"{format_duration(overdue)} without a heartbeat (a warning: the holder may still run)"
            if (overdue := overdue_after(info))
            else "never: not heartbeated (waiting to be adopted)",
        ),
        (
            "holder deadline",
            when(deadline, info.now_ms) + ": no holder trusts the lease after it"
            if (deadline := info.holder_deadline_ms) is not None
            else "none recorded",
        ),
        ("ttl", format_duration(info.ttl / 1000)),
        ("ttl left", ttl_left(info)),
        ("expires", expires(info)),
        ("max hold until", timestamp(info.max_hold_until_ms) if info.max_hold_until_ms else "none"),
        *([("adopted", timestamp(info.adopted_ms))] if info.adopted_ms else []),
    ]


def why_released(info: LeaseInfo, result: DeadRelease) -> str:
    """Why ``release --if-dead`` could end the lease."""
    if not is_lease(info):
        return "it is not a lease hash, and had no TTL"
    if info.holder_deadline_ms is None:
        return "it named no holder deadline and had no TTL, so it would never have expired"
    past = f"{-result.deadline_in:.1f}s ago" if result.deadline_in is not None else "already"
    what = "its maximum hold ended" if _by_max_hold(info) else "its holder's deadline and safety margin passed"
    ttl = "; the key had no TTL" if info.ttl_left == -1 else ""
    return f"{what} {past}, so no holder could still be running under it{ttl}"


def why_refused(key: str, info: LeaseInfo, result: DeadRelease) -> str:
    """Why ``release --if-dead`` left the lease on ``key`` alone."""
    unchanged = "nothing changed"
    if result.deadline_in is None:
        what = "is not a lease hash" if not is_lease(info) else "names no holder deadline"
        return (
            f"refused: {key!r} (fence {result.fence}) {what}, and expires by itself by its TTL "
            f"{expires(info)}; {unchanged}"
        )
    deadline = f"its deadline plus the safety margin its actor has to stop, in {result.deadline_in:.1f}s"
    if info.ends_ms is not None:
        deadline += f" ({timestamp(info.ends_ms)})"
    ends = _ends(info)
    if not info.interval:
        return (
            f"refused: the lease on {key!r} (fence {result.fence}) is not heartbeated (taken outside a worker, "
            f"waiting to be adopted); its holder may rely on it until {deadline}; {ends}; {unchanged}"
        )
    who = f"{key!r} (fence {result.fence}, {holder(info)})"
    if info.state is State.HEARTBEAT_OVERDUE:
        return (
            f"refused: the heartbeat of {who} is overdue (last renewal {info.heartbeat_age:.1f}s ago), "
            f"but its holder may still be running under the lease until {deadline}: releasing it now could "
            f"let a second worker run beside it; {ends}; {unchanged}"
        )
    return (
        f"refused: the holder of {who} is alive: its last heartbeat was {info.heartbeat_age:.1f}s ago, "
        f"and it relies on the lease until {deadline}; {unchanged}"
    )
