"""How long a message sent back waits before it asks again (Redis unreachable, or near the head with no thread free)."""

from __future__ import annotations

import random

#: Default ``lock_min_backoff`` (ms): the smallest delay before a message sent back asks again.
DEFAULT_MIN_BACKOFF = 50

#: Default ``lock_max_backoff`` (ms): a message sent back asks again at least this often.
DEFAULT_MAX_BACKOFF = 2_000


def backoff_cap(attempts: int, low: int, high: int) -> int:
    """The largest delay for a message already sent back ``attempts`` times: ``min(high, low * 2 ** attempts)``."""
    return min(high, low << min(max(0, attempts), 32))


def backoff_delay(attempts: int, low: int, high: int, holder_ttl: int = -1) -> int:
    """A delay drawn with full jitter in ``[low, backoff_cap(...)]`` (ms).

    When the holder's lease ends sooner than the drawn delay (``holder_ttl``
    ms; -1 unknown), ask just after it instead: a dead holder's key frees
    then, and a live holder renews and is unaffected.
    """
    delay = random.randint(low, max(low, backoff_cap(attempts, low, high)))
    if 0 <= holder_ttl < delay:
        delay = holder_ttl + 1
    return delay
