"""What Redis holds for a lease, as observers read it: its hash fields, its state, its holder's deadline."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .errors import LeaseConfigError
from .keys import slot_of


class State(str, Enum):
    """The health of a lease as seen from Redis.

    Only the *leaked* states (:attr:`leaked`) say that no holder can still
    believe it holds the lease; they are what ``release --if-dead`` may end.
    ``heartbeat_overdue`` is a warning: renewals are late, but the holder may
    still be running under its lease until its own deadline.
    """

    ALIVE = "alive"
    HEARTBEAT_OVERDUE = "heartbeat_overdue"
    HOLDER_DEAD = "holder_dead"
    PAST_MAX_HOLD = "past_max_hold"
    NO_TTL = "no_ttl"

    @property
    def leaked(self) -> bool:
        """True when no holder can still believe it holds the lease, yet the key is there."""
        return self in (State.HOLDER_DEAD, State.PAST_MAX_HOLD, State.NO_TTL)


def stale_after(interval_ms: int) -> int:
    """Milliseconds without a renewal after which a heartbeat counts as overdue: two missed rounds plus slack."""
    return 2 * interval_ms + 500


@dataclass(frozen=True)
class LeaseInfo:
    """Everything Redis knows about one lease, as read at ``now_ms``.

    Durations are whole milliseconds, named without a unit (``ttl``, ``ttl_left``, ``interval``,
    ``margin``); instants are the server's Unix time in milliseconds, named ``*_ms`` (``acquired_ms``,
    ``renewed_ms``, ``max_hold_until_ms``, ``adopted_ms``, ``now_ms``; 0 when unknown).

    Attributes:
      key: the lease key; redis_key: the Redis key holding it.
      token: the owner token (a secret: the CLI hides it unless asked).
      fence: the fencing token of the grant.
      meta: the holder's metadata (actor, message id, host, pid...).
    """

    key: str
    redis_key: str
    token: str
    fence: int
    ttl: int
    ttl_left: int
    interval: int
    acquired_ms: int
    renewed_ms: int
    max_hold_until_ms: int
    now_ms: int
    meta: Mapping[str, str] = field(default_factory=dict)
    margin: int = 0
    adopted_ms: int = 0
    #: The holder slot (0 but on a key held by several at once: ``lock_limit``).
    slot: int = 0
    #: How many may hold the key at once, as this holder was granted (1 for a key of one holder).
    limit: int = 1
    #: Whether the fence counter records this grant's end per slot (``g:<slot>``, ``r:<slot>``, ``e:<slot>``),
    #: as it does for every grant made once its key had been held by several at once (the hash names its
    #: slot); else in the counter's ``fence``, ``released`` and ``expired``.
    per_slot: bool = False

    @property
    def age(self) -> float:
        """Seconds since the lease was granted."""
        return max(0, self.now_ms - self.acquired_ms) / 1000

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the last renewal (or the grant)."""
        return max(0, self.now_ms - self.renewed_ms) / 1000

    @property
    def holder_deadline_ms(self) -> int | None:
        """When the holder stops trusting the lease at the latest (server ms), or ``None`` if the hash does not say.

        The same formula as the ``RELEASE_IF_DEAD`` script's: the earlier of
        the last renewal plus the TTL and the end of the maximum hold, less
        the holder's safety margin.
        """
        if not self.renewed_ms or self.ttl <= 0:
            return None
        ends = self.renewed_ms + self.ttl
        if self.max_hold_until_ms:
            ends = min(ends, self.max_hold_until_ms)
        return ends - self.margin

    @property
    def ends_ms(self) -> int | None:
        """When the lease ends by its holder's own facts: its deadline plus the margin its actor has to stop.

        The instant the key expires by itself unless its TTL was changed by
        hand; from then on ``release --if-dead`` may end it.
        """
        deadline = self.holder_deadline_ms
        return None if deadline is None else deadline + self.margin

    @property
    def state(self) -> State:
        """The lease's health; see :class:`State`. Agrees with :meth:`Leases.release_if_dead` on the same snapshot."""
        deadline = self.ends_ms
        if deadline is not None and self.now_ms <= deadline:  # as the script: whole ms, rounded down
            # interval 0: nobody heartbeats this lease (taken in a web request, say); only its TTL ends it.
            if self.interval and self.now_ms - self.renewed_ms > stale_after(self.interval):
                return State.HEARTBEAT_OVERDUE
            return State.ALIVE
        if self.ttl_left == -1:
            return State.NO_TTL
        if deadline is None:
            return State.ALIVE  # a key we did not write, which expires by itself
        if self.max_hold_until_ms and deadline >= self.max_hold_until_ms:
            return State.PAST_MAX_HOLD
        return State.HOLDER_DEAD

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view (without the owner token)."""
        deadline = self.holder_deadline_ms
        return {
            **self.meta,
            "key": self.key,
            "redis_key": self.redis_key,
            "fence": self.fence,
            "state": self.state.value,
            "age": self.age,
            "ttl": self.ttl,
            "ttl_left": self.ttl_left,
            "interval": self.interval,
            "heartbeat_age": self.heartbeat_age,
            "acquired_at": self.acquired_ms / 1000,
            "renewed_at": self.renewed_ms / 1000,
            "max_hold_until": self.max_hold_until_ms / 1000 if self.max_hold_until_ms else None,
            "holder_deadline": deadline / 1000 if deadline is not None else None,
            "adopted_at": self.adopted_ms / 1000 if self.adopted_ms else None,
            "slot": self.slot,
            "limit": self.limit,
        }


#: Hash fields the scripts own; holder metadata may not use these names.
_CORE_FIELDS = frozenset(
    {
        "token",
        "fence",
        "ttl",
        "interval",
        "margin_ms",
        "acquired_ms",
        "renewed_ms",
        "max_hold_until_ms",
        "adopted_ms",
        "key",
        "slot",
        "limit",
        "waiter",
    }
)
#: Hash fields the scripts own that came after metadata names were checked against :data:`_CORE_FIELDS` (a
#: metadata entry may still use the name: it is stored in ``meta``): never shown as metadata. ``wide``: the
#: holder was granted while its key had one holder, and the key has had several since (``lua/acquire.lua``).
_LATER_FIELDS = frozenset({"wide"})


def text(value: Any) -> str:
    """A reply as text; bytes that are not UTF-8 (a key written by hand) shown escaped, never an error."""
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)


def parse_info(redis_key: str, pttl: int, flat: Sequence[Any], now_ms: int) -> LeaseInfo:
    raw = {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}

    def num(name: str) -> int:
        try:
            return int(raw.get(name, 0))
        except ValueError:
            return 0

    return LeaseInfo(
        key=raw.get("key", redis_key),
        redis_key=redis_key,
        token=raw.get("token", ""),
        fence=num("fence"),
        ttl=num("ttl"),
        ttl_left=pttl,
        interval=num("interval"),
        acquired_ms=num("acquired_ms"),
        renewed_ms=num("renewed_ms"),
        max_hold_until_ms=num("max_hold_until_ms"),
        now_ms=now_ms,
        meta=_meta(raw),
        margin=num("margin_ms"),
        adopted_ms=num("adopted_ms"),
        slot=num("slot") if "slot" in raw else slot_of(redis_key),
        limit=max(1, num("limit")),
        per_slot="slot" in raw,
    )


def meta_args(key: str, meta: Mapping[str, str]) -> list[str]:
    """The lease key and the holder metadata as field/value arguments: ``key``, and ``meta`` as one JSON string.

    One argument rather than a field per entry: fewer arguments to pack and fewer hash fields to write
    on every grant (``redis-cli HGETALL`` shows the metadata as JSON).
    """
    for name, value in meta.items():
        if not isinstance(name, str) or name in _CORE_FIELDS or not isinstance(value, str):
            raise LeaseConfigError(
                f"lease metadata must map strings to strings, not reuse {sorted(_CORE_FIELDS)}; got {name!r}: {value!r}"
            )
    if not meta:
        return ["key", key]
    return ["key", key, "meta", json.dumps(meta, separators=(",", ":"))]


def _meta(raw: Mapping[str, str]) -> dict[str, str]:
    """The holder metadata of a lease hash: its ``meta`` JSON, plus any other non-core field (older leases)."""
    meta = {k: v for k, v in raw.items() if k not in _CORE_FIELDS and k not in _LATER_FIELDS}
    packed = meta.pop("meta", None)
    if packed is not None:
        try:
            decoded = json.loads(packed)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            meta.update({str(k): str(v) for k, v in decoded.items()})
        else:
            meta["meta"] = packed  # not ours: shown as written
    return meta


#: What each kind of key must be, by the kind its name says (``{prefix}:{kind}:{tag}``): its Redis type, in words.
_EXPECTED = {
    "lease": ("hash", "lease hash"),
    "line": ("zset", "line of waiters (a sorted set)"),
    "waiters": ("hash", "waiters hash"),
    "fence": ("hash", "fence counter (a hash)"),
}

#: The kinds of key a reader may find of the wrong type (``dramatiq_lease_exporter_unreadable_keys``'s ``kind``).
UNREADABLE_KINDS = tuple(_EXPECTED)

#: The ``found`` of an :class:`UnreadableKey` whose name is not UTF-8 (its type is not asked).
NOT_UTF8 = "name not UTF-8"


@dataclass(frozen=True)
class UnreadableKey:
    """A Redis key whose name says one kind of key and whose type is another (written by hand, or by other code).

    Attributes:
      name: the Redis key.
      kind: what its name says it is: ``lease``, ``line``, ``waiters`` or ``fence``.
      found: its Redis type (``string``, ``list``, ...); ``""`` if it was not asked.
    """

    name: str
    kind: str
    found: str = ""

    @property
    def problem(self) -> str:
        """What is wrong with it, as in ``a string key, not a line of waiters (a sorted set)``."""
        if self.found == NOT_UTF8:
            return "its name is not UTF-8, so no command can name it (written by hand?)"
        found = f"a {self.found} key" if self.found else "a key of another type"
        return f"{found}, not a {_EXPECTED[self.kind][1]}"
