"""Checks for the numbers a lease is made of, before anything reaches Redis."""

from __future__ import annotations

import math
from typing import Any

from .errors import LeaseConfigError
from .scripts import MAX_MS


def whole_ms(value: Any, name: str, *, minimum: int = 1, owner: str = "", maximum: int = MAX_MS) -> int:
    """Return ``value`` as an ``int`` if it is a whole number of milliseconds in ``[minimum, maximum]``.

    Floats are accepted only when whole (``1500.0``): a fraction would be
    truncated somewhere on the way to Redis, and ``0.5`` would become 0.

    Raises:
      LeaseConfigError: naming ``owner`` (if given), ``name`` and the value.
    """
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value == int(value)
        and minimum <= value <= maximum
    )
    if not ok:
        prefix = f"{owner}: " if owner else ""
        raise LeaseConfigError(
            f"{prefix}{name} must be a whole number of milliseconds from {minimum} to {maximum}, got {value!r}"
        )
    return int(value)


def whole_count(value: Any, name: str, *, maximum: int, owner: str = "") -> int:
    """Return ``value`` as an ``int`` if it is a whole number in ``[0, maximum]`` (``2.0`` is accepted, ``True`` not).

    Raises:
      LeaseConfigError: naming ``owner`` (if given), ``name`` and the value.
    """
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value == int(value)
        and 0 <= value <= maximum
    )
    if not ok:
        prefix = f"{owner}: " if owner else ""
        raise LeaseConfigError(f"{prefix}{name} must be a whole number from 0 to {maximum}, got {value!r}")
    return int(value)


def whole_limit(value: Any, name: str, *, maximum: int, owner: str = "") -> int:
    """Return ``value`` if it is an ``int`` from 1 to ``maximum``: a limit of holders (``True``, ``2.0`` and
    ``"2"`` are refused: a limit is counted, never converted).

    Raises:
      LeaseConfigError: naming ``owner`` (if given), ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        prefix = f"{owner}: " if owner else ""
        raise LeaseConfigError(f"{prefix}{name} must be a whole number (an int) from 1 to {maximum}, got {value!r}")
    return value


def check_numbers(ttl: Any, interval: Any, max_hold: Any) -> tuple[int, int, int]:
    """Validated ``(ttl, interval or 0, max_hold or 0)`` of a grant: every number is checked before any write."""
    ttl = whole_ms(ttl, "ttl")
    interval = 0 if interval is None else whole_ms(interval, "interval")
    max_hold = 0 if max_hold is None else whole_ms(max_hold, "max_hold")
    return ttl, interval, max_hold
