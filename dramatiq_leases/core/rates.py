"""Rates: at most N grants of a key in any window of a given length (``lock_rate``).

A rate is written ``"N/UNIT"`` or ``"N/XUNIT"`` (UNIT one of ``ms``, ``s``, ``m``, ``h``, ``d``; X a whole
number: ``"10/s"``, ``"5/10s"``, ``"3/500ms"``, ``"5000/d"``). The grant script keeps, per key and rate, the
server times of the key's last N grants (a sliding log in a ring: ``{prefix}:rate:{tag}:N/WINDOW_MS``, a
string of 8 bytes per grant and 8 of header, kept one window after its last grant) and grants only while
the oldest of them is at least a window old: exact over any window, not per fixed bucket. A grant the rate
refuses is busy as if the key were full, with the time until the rate allows as its ``ttl_left``.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import LeaseConfigError
from .scripts import MAX_RATE_COUNT, MAX_RATE_WINDOW, MAX_RATES

_UNITS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_SPEC = re.compile(r"(\d+)/(\d*)(ms|s|m|h|d)")


@dataclass(frozen=True, order=True)
class Rate:
    """At most ``count`` grants of a key in any window of ``window`` ms."""

    count: int
    window: int

    def __str__(self) -> str:
        return f"{self.count}/{self.window}ms"


def parse_rate(spec: Any, *, name: str = "rate") -> Rate:
    """The :class:`Rate` ``spec`` says (``"10/s"``, ``"5/10s"``...).

    Raises:
      LeaseConfigError: ``spec`` is not such a string, or its count or window is 0 or out of bounds.
    """
    match = _SPEC.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise LeaseConfigError(
            f"{name} must be 'N/UNIT' or 'N/XUNIT' (N and X whole numbers, UNIT one of ms, s, m, h, d: "
            f"'10/s', '5/10s', '5000/d'), got {spec!r}"
        )
    count, times, unit = int(match.group(1)), int(match.group(2) or 1), match.group(3)
    window = times * _UNITS[unit]
    if not 1 <= count <= MAX_RATE_COUNT:
        raise LeaseConfigError(f"{name} {spec!r}: the count must be from 1 to {MAX_RATE_COUNT}")
    if not 1 <= window <= MAX_RATE_WINDOW:
        raise LeaseConfigError(f"{name} {spec!r}: the window must be from 1 ms to 366 days")
    return Rate(count, window)


def parse_rates(value: Any, *, name: str = "rate") -> tuple[Rate, ...]:
    """The rates ``value`` gives: ``None`` (none), one spec, or a list of specs that all hold at once.

    Raises:
      LeaseConfigError: a bad spec (named), an empty list, or more than :data:`MAX_RATES`.
    """
    if value is None:
        return ()
    specs: Sequence[Any] = [value] if isinstance(value, str) else value
    if not isinstance(specs, (list, tuple)) or not specs or len(specs) > MAX_RATES:
        raise LeaseConfigError(
            f"{name} must be a rate such as '10/s', or a list of 1 to {MAX_RATES} of them, got {value!r}"
        )
    return tuple(sorted({parse_rate(spec, name=name) for spec in specs}))


@dataclass(frozen=True)
class RateState:
    """Where a key stands against one of its rates, as read (``show KEY``)."""

    #: The rate.
    rate: Rate
    #: Grants of the key in the last window (server time).
    starts: int
    #: How long until the rate allows one more grant (ms; 0: now).
    next_start_ms: int


def ring_state(rate: Rate, ring: bytes, now_us: int) -> RateState:
    """The state a rate's ring (as ``lua/prelude.lua``'s ``rate`` section writes it) says at ``now_us``."""
    if len(ring) < 8:
        return RateState(rate, 0, 0)
    (grants,) = struct.unpack(">d", ring[:8])
    kept = int(min(grants, rate.count)) if grants == grants else 0
    times = [struct.unpack(">d", ring[8 + 8 * i : 16 + 8 * i])[0] for i in range(kept) if len(ring) >= 16 + 8 * i]
    times = [min(t, now_us) for t in times if t == t]
    since = now_us - rate.window * 1000
    starts = sum(1 for t in times if t > since)
    wait = 0
    if kept >= rate.count and times:
        wait = max(0, math.ceil((min(times) + rate.window * 1000 - now_us) / 1000))
    return RateState(rate, starts, wait)


def rate_of_ring(name: str) -> Rate | None:
    """The rate a ring's Redis name says (``...}:N/W``), or ``None``."""
    match = re.search(r"\}:(\d+)/(\d+)$", name)
    if match is None:
        return None
    return Rate(int(match.group(1)), int(match.group(2)))
