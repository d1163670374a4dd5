"""The core's scripts' protocol: one request object per kind of call, its encoder beside it, named replies.

A request is built once, with named fields, and checked as it is built (every number before Redis is asked);
:meth:`GrantRequest.encode` and :meth:`ReleaseRequest.encode` are the only places that know the order of a
script's ``KEYS`` and ``ARGV`` (the header of ``lua/acquire.lua`` and ``lua/release.lua``). Reply codes are
named once, in :data:`~.scripts.LUA_CONSTANTS`, which the Lua reads too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

from . import scripts
from .errors import LeaseConfigError
from .info import meta_args, text
from .keys import lease_name, line_names, rate_name, script_names, slot_names, validate_key, wake_name
from .lease import Busy, margin_ms
from .numbers import whole_count, whole_limit, whole_ms
from .rates import Rate
from .scripts import MAX_ID_LENGTH, MAX_LIMIT, MAX_ORDER, MAX_RATES, MAX_READY, MAX_TIMESTAMP_MS

#: How many waiters of one key may wait in place (holding a thread) by default.
DEFAULT_READY = 2

#: How long a parked waiter stays away at most, by default (ms).
DEFAULT_PARK_MS = 300_000

#: How long a waiter asked to come back (promoted) has to show up, in ms (as in ``lua/*.lua``).
PROMOTE_MS = 10_000


#: ``lua/acquire.lua``'s ARGV by name, in order (the lease hash's field/value pairs follow them).
GRANT_ARGV = (
    "token",
    "ttl_ms",
    "max_hold_ms",
    "interval_ms",
    "margin_ms",
    "retention_ms",
    "waiter",
    "limit",
    "history",
    "unique",
    "first_ms",
    "mode",
    "ready",
    "park_ms",
    "promote_ms",
    "policy",
    "order",
    "grace_ms",
    "failover_ms",
    "rates",
)
#: ``lua/release.lua``'s ARGV by name, in order.
RELEASE_ARGV = ("token", "waiter", "grant", "retention_ms", "history", "ready", "promote_ms", "by", "hold_ms", "back")
#: ``lua/acquire_plain.lua``'s ARGV by name, in order (the lease hash's field/value pairs follow them).
GRANT_PLAIN_ARGV = (*GRANT_ARGV[:7], "grace_ms", "failover_ms", "rates")
#: ``lua/release_plain.lua``'s ARGV by name, in order.
RELEASE_PLAIN_ARGV = ("token", "grant", "retention_ms")


class Join(IntEnum):
    """How a grant request stands in its key's line when the key is busy (``lua/acquire.lua``'s ``mode``)."""

    #: Never joins the line (:meth:`~.store.Leases.try_acquire`).
    NEVER = 0
    #: Joins it; parks when not granted.
    PARK = 1
    #: Joins it; may wait in place near its head.
    IN_PLACE = 2


@dataclass(frozen=True)
class GrantRequest:
    """One grant asked of ``lua/acquire.lua``: every option of the call, checked when built.

    ``interval`` and ``max_hold`` are 0 for none. ``waiter``: a message's id and retry count (the line's and
    the duplicate records' name for it; ``""``: no message). ``rules``: the line's ``ready``, ``park_ms`` and
    ``promote_ms``. ``latest``: the key keeps only its newest such waiter, newest by ``order``. ``final``
    (with :attr:`Join.NEVER`): a refusal is remembered, so another copy of this waiter never runs after it.
    ``unique``: the grant ends the message's queued unique record (``lock_unique``), in the same step.
    ``rates``: the key's rates (``lock_rate``, :mod:`.rates`): granted only while each allows one more.
    """

    key: str
    token: str
    ttl: int
    interval: int = 0
    max_hold: int = 0
    meta: Mapping[str, str] = field(default_factory=dict)
    waiter: str = ""
    first_ms: int = 0
    join: Join = Join.NEVER
    rules: tuple[int, int, int] = (DEFAULT_READY, DEFAULT_PARK_MS, PROMOTE_MS)
    limit: int = 1
    latest: bool = False
    order: int = 0
    final: bool = False
    unique: bool = False
    rates: tuple[Rate, ...] = ()
    #: The lease hash's fields besides the script's own: ``key`` and the metadata (see :func:`.info.meta_args`).
    fields: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        key = validate_key(self.key)
        whole_ms(self.ttl, "ttl")
        if self.interval:
            whole_ms(self.interval, "interval")
        if self.max_hold:
            whole_ms(self.max_hold, "max_hold")
        whole_limit(self.limit, "limit", maximum=MAX_LIMIT)
        if self.first_ms:
            whole_ms(self.first_ms, "first_ms", minimum=0, maximum=MAX_TIMESTAMP_MS)
        if self.latest and (
            isinstance(self.order, bool) or not isinstance(self.order, int) or not 1 <= self.order <= MAX_ORDER
        ):
            raise LeaseConfigError(
                f"a latest waiter of {key!r} needs an order, a whole number from 1 to {MAX_ORDER}; got {self.order!r}",
                key=key,
            )
        if (
            not isinstance(self.rates, tuple)
            or len(self.rates) > MAX_RATES
            or not all(isinstance(r, Rate) for r in self.rates)
        ):
            raise LeaseConfigError(
                f"the rates of {key!r} must be a tuple of at most {MAX_RATES} Rate, got {self.rates!r}"
            )
        if self.join is not Join.NEVER and not self.waiter:
            raise LeaseConfigError(f"a waiter of {key!r} needs a non-empty id, got {self.waiter!r}", key=key)
        if self.final and (self.join is not Join.NEVER or not self.waiter or self.latest):
            raise LeaseConfigError(f"a final refusal of {key!r} is for a waiter that never joins the line", key=key)
        # Checked here, not only by the general script: the plain one, which grants a free key, never sees them.
        ready, park_ms, promote_ms = self.rules
        whole_count(ready, "ready", maximum=MAX_READY)
        whole_ms(park_ms, "park_ms")
        whole_ms(promote_ms, "promote_ms")
        object.__setattr__(self, "fields", tuple(meta_args(key, dict(self.meta))))

    @property
    def plain(self) -> bool:
        """Whether ``lua/acquire_plain.lua`` is asked first (in a store without history): a key of one holder, no
        unique record, not latest, and not back from the line (whose key is likely still lined)."""
        return self.limit == 1 and not self.unique and not self.latest and not self.first_ms

    def encode_plain(
        self, prefix: str, retention: int, *, grace: int = 0, failover: int = 0
    ) -> tuple[list[str], list[Any]]:
        """``KEYS`` and ``ARGV`` of ``lua/acquire_plain.lua`` (see :meth:`encode`)."""
        args: list[Any] = [
            *(self.token, self.ttl, self.max_hold, self.interval, margin_ms(self.ttl), retention, self.waiter),
            *(grace, failover, len(self.rates)),
            *(n for rate in self.rates for n in (rate.count, rate.window)),
            *self.fields,
        ]  # GRANT_PLAIN_ARGV
        if self.waiter:
            args += ["waiter", self.waiter]
        rings = [rate_name(prefix, self.key, rate.count, rate.window) for rate in self.rates]
        return [*script_names(prefix, self.key), *rings], args

    def encode(
        self, prefix: str, retention: int, history: int, *, grace: int = 0, failover: int = 0, width: int = 1
    ) -> tuple[list[str], list[Any]]:
        """``KEYS`` and ``ARGV`` of ``lua/acquire.lua`` (its latest build if :attr:`latest`), for a store of
        ``prefix`` whose fence counters are kept ``retention`` ms, histories ``history`` events, and whose
        restart and failover graces are ``grace`` and ``failover`` ms; the key's holder slots declared as many
        as the larger of :attr:`limit` and ``width``."""
        keys = [
            *script_names(prefix, self.key),
            *line_names(prefix, self.key),
            wake_name(prefix, self.key, self.waiter),
            *(rate_name(prefix, self.key, rate.count, rate.window) for rate in self.rates),
            *slot_names(prefix, self.key, max(self.limit, width)),
        ]
        ready, park_ms, promote_ms = self.rules
        args: list[Any] = [
            *(
                self.token,
                self.ttl,
                self.max_hold,
                self.interval,
                margin_ms(self.ttl),
                retention,
                self.waiter,
                self.limit,
                history,
                1 if self.unique else 0,
                self.first_ms,
                int(self.join),
                ready,
                park_ms,
                promote_ms,
                2 if self.final else int(self.latest),
                self.order,
                grace,
                failover,
                len(self.rates),
            ),  # GRANT_ARGV
            *(n for rate in self.rates for n in (rate.count, rate.window)),
            *self.fields,
        ]
        if self.waiter:  # named in the grant, so that another copy of the same message never holds a slot beside it
            args += ["waiter", self.waiter]
        return keys, args


@dataclass(frozen=True)
class ReleaseRequest:
    """One release asked of ``lua/release.lua``, by ``token``.

    ``fence``: the grant's, if known (a release asked again after its reply was lost is then answered
    :attr:`Released.EARLIER`). ``slot``: the grant's holder slot (``None``: looked for by token in every slot).
    ``waiter``: the holder was this waiter of the line and its actor returned: remembered as having run.
    ``by``: an operator releasing it in its holder's stead (the history records a ``force_released``).
    ``hold_ms``: the holder holds the key back that long (no grant of it before; ``RateLimited``), and
    ``back``, its message's waiter id, waits at the head of the key's line meanwhile.
    """

    key: str
    token: str
    fence: int | None = None
    slot: int | None = 0
    waiter: str = ""
    ready: int = DEFAULT_READY
    promote_ms: int = PROMOTE_MS
    by: str = ""
    hold_ms: int = 0
    back: str = ""

    @property
    def plain(self) -> bool:
        """Whether ``lua/release_plain.lua`` is asked first (in a store without history): slot 0, by its holder,
        not a waiter of the line."""
        return self.slot == 0 and not self.waiter and not self.by and not self.hold_ms

    def encode_plain(self, prefix: str, retention: int) -> tuple[list[str], list[Any]]:
        """``KEYS`` and ``ARGV`` of ``lua/release_plain.lua`` (see :meth:`GrantRequest.encode`)."""
        names = script_names(prefix, self.key)
        grant = "" if self.fence is None else str(self.fence)
        return [names[0], names[1], names[2]], [self.token, grant, retention]  # RELEASE_PLAIN_ARGV

    def encode(self, prefix: str, retention: int, history: int, *, width: int = 1) -> tuple[list[str], list[Any]]:
        """``KEYS`` and ``ARGV`` of ``lua/release.lua`` (see :meth:`GrantRequest.encode`), ``width`` holder slots
        declared."""
        names, (_, waiters, _, history_key) = script_names(prefix, self.key), line_names(prefix, self.key)
        keys = [
            lease_name(prefix, self.key, self.slot) if self.slot else names[0],
            *names[1:4],
            waiters,
            history_key,
            names[0],
            *slot_names(prefix, self.key, width),
        ]
        grant = "find" if self.slot is None else "" if self.fence is None else str(self.fence)
        # -1: an operator's release appends to a history the fleet keeps, even one unknown to this store.
        args: list[Any] = [  # RELEASE_ARGV
            self.token,
            self.waiter,
            grant,
            retention,
            (history or -1) if self.by else history,
            self.ready,
            self.promote_ms,
            self.by,
            self.hold_ms,
            self.back,
        ]
        return keys, args


class Released(IntEnum):
    """The release script's answer (``NOT_HELD``, ``RELEASED``, ``RELEASED_EARLIER`` in the Lua)."""

    #: The token did not hold the lease: nothing was touched.
    NOT_HELD = scripts.NOT_HELD
    #: Released now.
    NOW = scripts.RELEASED
    #: Not held, but this grant (by its fence) is recorded as released: an earlier try's reply was lost.
    EARLIER = scripts.RELEASED_EARLIER


def hold_ms(hold: int | None) -> int:
    """A release's hold (``None``: 0, none), checked before Redis is asked."""
    if hold is None:
        return 0
    return whole_ms(hold, "hold", maximum=scripts.MAX_HOLD_BACK_MS)


def operator_name(by: str | None) -> str:
    """An operator's name for the history (``""``: none), checked before Redis is asked."""
    if by is None:
        return ""
    if not isinstance(by, str) or len(by.encode()) > MAX_ID_LENGTH:  # the scripts count bytes
        raise LeaseConfigError(f"by must be a string of at most {MAX_ID_LENGTH} bytes (UTF-8), got {by[:64]!r}")
    return by


class Wait(str, Enum):
    """What a waiter of a key's line should do with a busy answer."""

    #: Not in the line (asked without a waiter id).
    NONE = "none"
    #: Wait in place: block on the waiter's wake list, then ask again.
    IN_PLACE = "in_place"
    #: Park: leave the worker thread; the waiter is asked to come back when its turn nears.
    PARK = "park"
    #: Near the front, but not allowed to wait in place: park, as :attr:`PARK` (promoted at the next release).
    SOON = "soon"
    #: This waiter already ran: the message is a stray copy and must not run.
    DUPLICATE = "duplicate"
    #: A newer waiter of the key took this one's place (``lock_on_busy="latest"``): it must not run.
    SUPERSEDED = "superseded"
    #: Another copy of this message (the same waiter) holds the key and runs: ask again later, outside the
    #: line (a redelivery of a crashed run then runs once that lease ends; a stray copy finds it ran).
    COPY_HOLDS = "copy_holds"
    #: Asked without joining the line within the restart or failover grace: nobody may hold the key yet, but
    #: the store cannot tell (``restart_grace``, ``failover_grace``); ask again once it ends (``ttl_left``).
    GRACE = "grace"


#: The acquire script's wait codes (``WAIT_*`` in the Lua), by code.
WAITS = {
    scripts.WAIT_NONE: Wait.NONE,
    scripts.WAIT_IN_PLACE: Wait.IN_PLACE,
    scripts.WAIT_PARK: Wait.PARK,
    scripts.WAIT_SOON: Wait.SOON,
    scripts.WAIT_DUPLICATE: Wait.DUPLICATE,
    scripts.WAIT_SUPERSEDED: Wait.SUPERSEDED,
    scripts.WAIT_COPY_HOLDS: Wait.COPY_HOLDS,
    scripts.WAIT_GRACE: Wait.GRACE,
}


@dataclass(frozen=True)
class Turn(Busy):
    """A busy answer to a grant request, with what its waiter does next: the line's answer to its callers
    (the middleware, the web helpers), not a user API. :meth:`busy` is what a user is given.

    Attributes:
      wait: what the waiter should do (:class:`Wait`).
      place: the waiter's place in the line (0: its head; -1: not in it).
      block_ms: with :attr:`Wait.IN_PLACE`, how long to block before asking again.
      newer: with :attr:`Wait.SUPERSEDED`, the message id of the newest message of the key that reached
        the lease (``""`` if unknown).
    """

    wait: Wait = Wait.NONE
    place: int = -1
    block_ms: int = 0
    newer: str = ""

    @classmethod
    def decode(cls, key: str, reply: list[Any]) -> Turn:
        """The acquire script's busy reply: ``{BUSY, ttl_left, fence, now, wait, place, line, block_ms[, newer]}``."""
        return cls(
            key=key,
            ttl_left=int(reply[1]),
            fence=int(reply[2]),
            now_ms=int(reply[3]),
            wait=WAITS[int(reply[4])],
            place=int(reply[5]),
            line=int(reply[6]),
            block_ms=int(reply[7]),
            newer=text(reply[8]) if len(reply) > 8 else "",
        )

    def busy(self) -> Busy:
        """The answer without the line's part, as :meth:`~.store.Leases.try_acquire` gives it."""
        return Busy(key=self.key, ttl_left=self.ttl_left, fence=self.fence, now_ms=self.now_ms, line=self.line)
