"""LeaseMiddleware's defaults and backoff, imported from the package so the harness never drifts from it.

The figures that run "with the defaults" (4 and 5) and the comparisons that
mimic them (``crash_peer``'s retry period, the ``raw``/``crl`` TTL of
``bench.app``) take their numbers from here, never from a literal.
"""

from __future__ import annotations

from dramatiq_leases.middleware import DEFAULT_MAX_BACKOFF, DEFAULT_MIN_BACKOFF, DEFAULT_TTL
from dramatiq_leases.middleware.backoff import backoff_cap as _backoff_cap

#: ``lock_ttl`` default (ms).
TTL_MS: int = DEFAULT_TTL
#: ``lock_min_backoff`` and ``lock_max_backoff`` defaults (ms).
BACKOFF_MIN: int = DEFAULT_MIN_BACKOFF
BACKOFF_MAX: int = DEFAULT_MAX_BACKOFF
DEFAULT_BACKOFF: tuple[int, int] = (BACKOFF_MIN, BACKOFF_MAX)

#: The defaults before commit cf6e0a1, run once in figure 4 for comparison.
PREVIOUS_BACKOFF: tuple[int, int] = (100, 10_000)


def backoff_cap(attempts_before: int, backoff: tuple[int, int] = DEFAULT_BACKOFF) -> int:
    """The largest delay LeaseMiddleware draws for a message sent back ``attempts_before`` times already."""
    low, high = backoff
    return _backoff_cap(attempts_before, low, high)


def fmt_ms(ms: int) -> str:
    """``50 ms``, ``2 s``, ``10 s``: how the doc names a backoff bound."""
    return f"{ms / 1000:g} s" if ms >= 1000 and ms % 100 == 0 else f"{ms} ms"
