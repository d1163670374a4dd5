"""LeaseMiddleware's defaults, read from its signature so the harness never drifts from the package.

The figures that run "with the defaults" (4 and 5) and the comparisons that
mimic them (``crash_peer``'s retry period, the ``raw``/``crl`` TTL of
``bench.app``) take their numbers from here, never from a literal.
"""

from __future__ import annotations

import inspect
from typing import Any

from dramatiq_leases.middleware import LeaseMiddleware

_PARAMETERS = inspect.signature(LeaseMiddleware.__init__).parameters


def middleware_default(name: str) -> Any:
    """The default of ``LeaseMiddleware(..., name=...)``; fails loudly if the parameter is gone or has none."""
    try:
        value = _PARAMETERS[name].default
    except KeyError:
        raise RuntimeError(f"LeaseMiddleware has no parameter {name!r}: update bench/defaults.py") from None
    if value is inspect.Parameter.empty:
        raise RuntimeError(f"LeaseMiddleware's {name!r} has no default: update bench/defaults.py")
    return value


#: ``lock_ttl`` default (ms).
TTL_MS: int = middleware_default("ttl")
#: ``lock_backoff_min`` and ``lock_backoff_max`` defaults (ms).
BACKOFF_MIN: int = middleware_default("backoff_min")
BACKOFF_MAX: int = middleware_default("backoff_max")
DEFAULT_BACKOFF: tuple[int, int] = (BACKOFF_MIN, BACKOFF_MAX)

#: The defaults before commit cf6e0a1, run once in figure 4 for comparison.
PREVIOUS_BACKOFF: tuple[int, int] = (100, 10_000)


def backoff_cap(attempts_before: int, backoff: tuple[int, int] = DEFAULT_BACKOFF) -> int:
    """The largest delay LeaseMiddleware draws for a message sent back ``attempts_before`` times already.

    Mirrors ``LeaseMiddleware._send_back``: ``min(max, min * 2 ** attempts)``, full jitter below it.
    """
    low, high = backoff
    return int(min(high, low * 2 ** min(max(0, attempts_before), 32)))


def fmt_ms(ms: int) -> str:
    """``50 ms``, ``2 s``, ``10 s``: how the doc names a backoff bound."""
    return f"{ms / 1000:g} s" if ms >= 1000 and ms % 100 == 0 else f"{ms} ms"
