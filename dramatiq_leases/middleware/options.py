"""The lease options of actors and messages: names, defaults, and their checks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import LeaseConfigError
from ..core.lease import default_interval
from ..core.numbers import whole_ms
from ..core.scripts import MAX_MS
from .errors import LeaseOptionError

#: Actor options, each also accepted as a message option (``send_with_options``).
ACTOR_OPTIONS = frozenset(
    {
        "lock_key",
        "lock_ttl",
        "lock_renew_interval",
        "lock_max_hold",
        "lock_min_backoff",
        "lock_max_backoff",
        "lock_max_wait",
        "lock_give_up",
    }
)

#: Message option carrying a lease acquired by the producer, to be adopted by the worker.
LEASE_OPTION = "lease"

#: Lease options that make no sense on an actor without ``lock_key``.
LEASE_MESSAGE_OPTIONS = ACTOR_OPTIONS | {LEASE_OPTION}

#: Message options this middleware keeps across busy retries (the wait clock of one delivery).
ATTEMPTS_OPTION = "lease_busy_attempts"
FIRST_ATTEMPT_OPTION = "lease_first_attempt_ms"

#: Message option of a copy sent back after a Redis error: its run is remembered, like a waiter's, so that a
#: second copy (an enqueue that timed out, was tried again, and reached the broker after all) never runs again.
SENT_BACK_OPTION = "lease_sent_back"

#: What ``lock_give_up`` may be: dead-letter the message, or acknowledge it without running it.
GIVE_UP_ACTIONS = ("fail", "drop")

#: Default ``lock_ttl`` (ms).
DEFAULT_TTL = 30_000

#: Default ``lock_max_wait`` (ms): the wait budget, an hour.
DEFAULT_MAX_WAIT = 3_600_000

#: Default ``lock_give_up``.
DEFAULT_GIVE_UP = "fail"

#: The shortest ``lock_ttl``: a renewal must fit in a third of it, and the safety
#: margin (a tenth) must exceed a scheduler tick.
MIN_TTL = 100

#: The longest backoff (ms): a message sent back is a delayed message, and Dramatiq's brokers take
#: delays of less than 7 days.
MAX_DELAY = 7 * 24 * 3600 * 1000 - 1

#: Added to the actor's ``time_limit`` (and TimeLimit's check interval) to make
#: the default ``lock_max_hold``: the time limit, the real reason, fires first.
TIME_LIMIT_GRACE = 1_000


@dataclass(frozen=True)
class Options:
    """The resolved lease options of one actor or message (times in ms)."""

    ttl: int
    renew_interval: int
    max_hold: int | None
    min_backoff: int
    max_backoff: int
    max_wait: int | None
    give_up: str


def ms(owner: str, name: str, value: Any, *, minimum: int = 1, maximum: int = MAX_MS) -> int:
    """``value`` as whole milliseconds, else :class:`LeaseOptionError` naming ``owner`` and ``name``."""
    try:
        return whole_ms(value, name, minimum=minimum, maximum=maximum, owner=owner)
    except LeaseConfigError as e:
        raise LeaseOptionError(str(e)) from None


def optional_ms(owner: str, name: str, value: Any) -> int | None:
    """As :func:`ms`; ``None`` and infinity mean "no limit"."""
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    return ms(owner, name, value)


def resolve(owner: str, defaults: Mapping[str, Any], *sources: Mapping[str, Any]) -> Options:
    """Each option from the first source that has it (message, then actor), else ``defaults``; all checked."""

    def get(name: str) -> Any:
        for source in sources:
            if source.get(name) is not None:
                return source[name]
        return defaults[name]

    ttl = ms(owner, "lock_ttl", get("lock_ttl"), minimum=MIN_TTL)
    interval = optional_ms(owner, "lock_renew_interval", get("lock_renew_interval"))
    if interval is None:
        interval = default_interval(ttl)
    elif interval * 2 > ttl:
        raise LeaseOptionError(
            f"{owner}: lock_renew_interval={interval} must be at most half of lock_ttl={ttl}, "
            "so that a failed renewal is retried before the lease expires"
        )
    min_backoff = ms(owner, "lock_min_backoff", get("lock_min_backoff"), maximum=MAX_DELAY)
    max_backoff = ms(owner, "lock_max_backoff", get("lock_max_backoff"), maximum=MAX_DELAY)
    if max_backoff < min_backoff:
        raise LeaseOptionError(f"{owner}: lock_max_backoff={max_backoff} is below lock_min_backoff={min_backoff}")
    give_up = get("lock_give_up")
    if give_up not in GIVE_UP_ACTIONS:
        raise LeaseOptionError(f"{owner}: lock_give_up must be one of {GIVE_UP_ACTIONS}, got {give_up!r}")
    return Options(
        ttl=ttl,
        renew_interval=interval,
        max_hold=optional_ms(owner, "lock_max_hold", get("lock_max_hold")),
        min_backoff=min_backoff,
        max_backoff=max_backoff,
        max_wait=optional_ms(owner, "lock_max_wait", get("lock_max_wait")),
        give_up=give_up,
    )
