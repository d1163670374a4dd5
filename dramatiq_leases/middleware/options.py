"""The lease options of actors and messages: names, defaults, and their checks."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import LeaseConfigError
from ..core.lease import default_interval
from ..core.numbers import whole_limit, whole_ms
from ..core.rates import Rate, parse_rates
from ..core.scripts import MAX_DEBOUNCE_MS, MAX_LIMIT, MAX_MS
from ..core.unique import UNIQUE_MODES as CORE_UNIQUE_MODES
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
        "lock_limit",
        "lock_on_busy",
        "lock_unique",
        "lock_unique_ttl",
        "lock_rate",
        "lock_debounce",
        "lock_debounce_max",
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

#: Message option of the copy of a message whose actor raised ``RateLimited`` and held its key back: when the
#: hold ends (ms). It waits for it in the key's line whatever its ``lock_on_busy`` says, and its wait budget
#: starts then (see :mod:`.held_back`).
HELD_BACK_OPTION = "lease_held_back"

#: Message option of a ``lock_on_busy="latest"`` message: its order among its key's messages, taken at its first
#: send and kept by every later enqueue of it (see :mod:`.ordering`).
ORDER_OPTION = "lease_order"

#: What ``lock_give_up`` may be: dead-letter the message, or acknowledge it without running it.
GIVE_UP_ACTIONS = ("fail", "drop")

#: What ``lock_on_busy`` may be: what a message does when its key is full. ``"wait"``: take a place in the
#: key's line; ``"skip"``: acknowledged without running; ``"fail"``: dead-lettered without running;
#: ``"latest"``: wait, but the key keeps only its newest such message waiting (the older is acknowledged).
ON_BUSY_POLICIES = ("wait", "skip", "fail", "latest")

#: What ``lock_unique`` may be (besides ``None``, the default: no uniqueness): while a message of the key is
#: queued (sent, not started) another send of it is refused (``"queued"``), or until it is done for good
#: (``"until_done"``).
UNIQUE_MODES = CORE_UNIQUE_MODES

#: Default ``lock_unique_ttl`` (ms): how long a unique record outlives its message's last sign of life (its
#: send, a delivery, a park, a retry), so that a message purged or deleted by hand frees its key: an hour.
DEFAULT_UNIQUE_TTL = 3_600_000

#: Message option marking a message whose send took a unique record: a later enqueue of it (a retry, a
#: parked copy, a delayed copy leaving its delay queue) keeps that record rather than asking for one.
UNIQUE_OPTION = "lease_unique"

#: Default ``lock_on_busy``.
DEFAULT_ON_BUSY = "wait"

#: Default ``lock_limit``: one holder at a time.
DEFAULT_LIMIT = 1

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
    #: How many may hold a key at once: an int, or a callable of the actor's arguments returning one.
    limit: int | Callable[..., Any] = DEFAULT_LIMIT
    on_busy: str = DEFAULT_ON_BUSY
    #: ``None``, ``"queued"`` or ``"until_done"`` (:data:`UNIQUE_MODES`).
    unique: str | None = None
    unique_ttl: int = DEFAULT_UNIQUE_TTL
    #: At most N starts of a key per window (``lock_rate``): none if empty.
    rates: tuple[Rate, ...] = ()
    #: The quiet window of a debounce (``lock_debounce``, ms; ``None``: none), and its cap (``lock_debounce_max``).
    debounce: int | None = None
    debounce_max: int | None = None


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
    on_busy = get("lock_on_busy")
    if not isinstance(on_busy, str) or on_busy not in ON_BUSY_POLICIES:
        raise LeaseOptionError(f"{owner}: lock_on_busy must be one of {ON_BUSY_POLICIES}, got {on_busy!r}")
    limit = get("lock_limit")
    if not callable(limit):
        limit = check_limit(owner, limit)
    unique = get("lock_unique")
    if unique is not None and (not isinstance(unique, str) or unique not in UNIQUE_MODES):
        raise LeaseOptionError(f"{owner}: lock_unique must be None or one of {UNIQUE_MODES}, got {unique!r}")
    debounce, debounce_max = check_debounce(owner, get("lock_debounce"), get("lock_debounce_max"))
    if debounce is not None and unique is not None:
        raise LeaseOptionError(
            f"{owner}: lock_debounce={debounce} cannot be used with lock_unique={unique!r}: lock_unique would refuse "
            "the later sends of a burst, whose newest arguments lock_debounce runs (a burst already runs once)"
        )
    return Options(
        ttl=ttl,
        renew_interval=interval,
        max_hold=optional_ms(owner, "lock_max_hold", get("lock_max_hold")),
        min_backoff=min_backoff,
        max_backoff=max_backoff,
        max_wait=optional_ms(owner, "lock_max_wait", get("lock_max_wait")),
        give_up=give_up,
        limit=limit,
        on_busy=on_busy,
        unique=unique,
        unique_ttl=ms(owner, "lock_unique_ttl", get("lock_unique_ttl"), minimum=1_000, maximum=MAX_DELAY),
        rates=check_rates(owner, get("lock_rate")),
        debounce=debounce,
        debounce_max=debounce_max,
    )


def check_rates(owner: str, value: Any) -> tuple[Rate, ...]:
    """The rates ``lock_rate`` gives (``None``: none), else :class:`LeaseOptionError` naming ``owner`` and it."""
    try:
        return parse_rates(value, name="lock_rate")
    except LeaseConfigError as e:
        raise LeaseOptionError(f"{owner}: {e}") from None


def check_debounce(owner: str, quiet: Any, cap: Any) -> tuple[int | None, int | None]:
    """``lock_debounce`` and ``lock_debounce_max``: ints of ms from 1 to a day (``None``: none), the cap at least
    the quiet window and only with one; else :class:`LeaseOptionError` naming ``owner``, the option and the value."""
    for name, value in (("lock_debounce", quiet), ("lock_debounce_max", cap)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DEBOUNCE_MS
        ):
            raise LeaseOptionError(
                f"{owner}: {name} must be None or an int of milliseconds from 1 to {MAX_DEBOUNCE_MS}, got {value!r}"
            )
    if cap is not None and quiet is None:
        raise LeaseOptionError(f"{owner}: lock_debounce_max={cap} needs lock_debounce (the quiet window it caps)")
    if cap is not None and quiet is not None and cap < quiet:
        raise LeaseOptionError(f"{owner}: lock_debounce_max={cap} is below lock_debounce={quiet}")
    return quiet, cap


def check_limit(owner: str, value: Any, *, returned_by: Any = None) -> int:
    """``value`` if it is a ``lock_limit`` (an int from 1 to 1 000), else :class:`LeaseOptionError` naming
    ``owner`` and the value (and the callable that ``returned_by`` it)."""
    try:
        return whole_limit(value, "lock_limit", maximum=MAX_LIMIT)
    except LeaseConfigError:
        said = f"lock_limit={value!r}" if returned_by is None else f"lock_limit {returned_by!r} returned {value!r}"
        raise LeaseOptionError(
            f"{owner}: {said}; a limit is an int from 1 to {MAX_LIMIT} (True, 1.5 and '2' are refused), "
            "or an actor's callable of its arguments returning one"
        ) from None
