"""A lease held by this process, and the answers to asking for one.

A lease is a Redis hash with a TTL, owned by whoever knows its random token.
Only the owner can renew or release it; it ends by itself when its TTL runs
out, so a holder that dies (OOM, SIGKILL) cannot leave an orphan behind.
Every grant of a key carries a fencing token that is larger than any token
granted for that key before, so the systems a lease protects can refuse a
stale holder. :class:`~dramatiq_leases.core.store.Leases` hands them out.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Literal, Protocol

#: Part of the TTL a holder keeps as a safety margin: it stops trusting its lease
#: ``ttl * SAFETY_MARGIN`` before the key can expire on the server, so an actor
#: interrupted at its deadline has that long to stop before anyone else is granted the key.
SAFETY_MARGIN = 0.1


def margin_ms(ttl: int) -> int:
    """The safety margin of a lease with this TTL, in whole milliseconds (always below the TTL)."""
    return int(ttl * SAFETY_MARGIN)


def new_token() -> str:
    """A random owner token of 128 bits."""
    return secrets.token_hex(16)


def default_interval(ttl: int) -> int:
    """The renewal interval used when none is given: a third of the TTL."""
    return max(1, ttl // 3)


class Lease:
    """A lease this process holds (or held) on ``key``.

    The holder trusts it until its local deadline: ``ttl - margin``
    milliseconds after the last confirmed renewal was *sent* (monotonic
    clock), and never past ``max_hold`` after the grant was asked for. The key
    outlives that deadline on the server by at least ``margin``, the time an
    interrupted actor has to stop before anyone else can be granted the key.

    Attributes:
      key: the lease key, such as ``"invoice:42"``.
      token: the owner token; whoever presents it owns the lease.
      fence: the fencing token of this grant, larger than any earlier grant's.
      ttl: the TTL in milliseconds that every renewal restores.
      interval: how often a heartbeat renews it, in milliseconds.
      max_hold: the longest it may be held in milliseconds, or ``None``.
      margin: the safety margin in milliseconds (``ttl * SAFETY_MARGIN``).
      acquired_at: when it was granted, in Unix seconds (server clock).
      meta: holder metadata stored with the lease (actor, message id, host...).
      handoff: seconds from the previous holder's release to this grant, when
        it went to a waiter of the key's line; ``None`` otherwise.
      from_line: whether it was granted from the front of the key's line.
      slot: the holder slot it holds (0 but on a key several may hold at once: ``limit``).
    """

    __slots__ = (
        "_ended",
        "_hold_until",
        "_valid_until",
        "acquired_at",
        "fence",
        "from_line",
        "handoff",
        "interval",
        "key",
        "margin",
        "max_hold",
        "meta",
        "slot",
        "token",
        "ttl",
    )

    def __init__(
        self,
        *,
        key: str,
        token: str,
        fence: int,
        ttl: int,
        interval: int,
        max_hold: int | None,
        acquired_at: float,
        meta: Mapping[str, str],
        sent_at: float,
    ) -> None:
        self.key = key
        self.token = token
        self.fence = fence
        self.ttl = ttl
        self.interval = interval
        self.max_hold = max_hold
        self.margin = margin_ms(ttl)
        self.acquired_at = acquired_at
        self.meta = dict(meta)
        self.handoff: float | None = None
        self.from_line = False
        self.slot = 0
        self._hold_until = math.inf if max_hold is None else sent_at + max_hold / 1000
        self._valid_until = min(sent_at + (ttl - self.margin) / 1000, self._hold_until)
        self._ended = False

    @property
    def valid_until(self) -> float:
        """The ``time.monotonic()`` instant after which this process must assume the lease is gone."""
        return self._valid_until

    @property
    def hold_until(self) -> float:
        """The ``time.monotonic()`` instant at which the maximum hold ends (``inf`` without one)."""
        return self._hold_until

    def remaining(self) -> float:
        """Seconds this process may still rely on the lease (0 once it must not)."""
        return max(0.0, self._valid_until - time.monotonic())

    def __repr__(self) -> str:
        return f"Lease(key={self.key!r}, fence={self.fence}, ttl={self.ttl}, remaining={self.remaining():.3f}s)"


def confirm(lease: Lease, sent_at: float) -> None:
    """Record a renewal of ``lease`` that Redis confirmed; ``sent_at`` is when it was sent (monotonic)."""
    if lease._ended:
        return  # declared lost: a late reply never revives it
    # max: a slow reply to an earlier renewal must not pull back what a later one confirmed.
    until = min(sent_at + (lease.ttl - lease.margin) / 1000, lease._hold_until)
    lease._valid_until = max(lease._valid_until, until)


def declare_lost(lease: Lease) -> None:
    """``lease`` was declared lost: this process must not rely on it any more (``remaining()`` is 0)."""
    lease._ended = True
    lease._valid_until = -math.inf


class Tracker(Protocol):
    """What keeps a lease alive while a :meth:`~.store.Leases.lease` block runs: a :class:`~.heartbeat.Heartbeat`."""

    def track(self, lease: Lease, on_lost: Callable[[Lease, LostReason], None]) -> None: ...

    def untrack(self, lease: Lease) -> object: ...


@dataclass(frozen=True)
class Busy:
    """The answer to an acquire when someone else holds the key.

    Attributes:
      key: the lease key.
      ttl_left: the holder's remaining TTL in milliseconds (-1: the key has no TTL).
      fence: the holder's fencing token (0 if unknown).
      now_ms: the Redis server's clock when it answered (Unix ms; 0 if unknown).
      line: how many wait in the key's line.
    """

    key: str
    ttl_left: int
    fence: int
    now_ms: int = 0
    line: int = 0

    @property
    def retry_after(self) -> int:
        """Whole seconds until the holder's lease runs out at the latest (at least 1), for ``Retry-After``."""
        if self.ttl_left < 0:
            return 1
        return max(1, math.ceil(self.ttl_left / 1000))

    def __bool__(self) -> Literal[False]:
        # So that ``if leases.try_acquire(...):`` reads as "if acquired".
        return False


class Renewal(str, Enum):
    """What a renewal found."""

    OK = "ok"
    GONE = "gone"
    STOLEN = "stolen"
    MAX_HOLD = "max_hold"
    ERROR = "error"


class LostReason(str, Enum):
    """Why a held lease was lost (the ``reason`` label of ``dramatiq_lease_lost_total``)."""

    GONE = "gone"
    STOLEN = "stolen"
    UNREACHABLE = "unreachable"
    MAX_HOLD = "max_hold"

    @property
    def description(self) -> str:
        """The reason in words, for logs and ``LeaseLost``."""
        return _DESCRIPTIONS[self]

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


_DESCRIPTIONS = {
    LostReason.GONE: "the key is gone from Redis (expired or deleted)",
    LostReason.STOLEN: "another owner holds the key",
    LostReason.UNREACHABLE: "Redis did not confirm a renewal before the local deadline",
    LostReason.MAX_HOLD: "the maximum hold time was reached",
}
