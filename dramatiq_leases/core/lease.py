"""Leases on keys in Redis: acquire, renew, release, adopt and inspect.

A lease is a Redis hash with a TTL, owned by whoever knows its random token.
Only the owner can renew or release it; it ends by itself when its TTL runs
out, so a holder that dies (OOM, SIGKILL) cannot leave an orphan behind.
Every grant of a key carries a fencing token that is larger than any token
granted for that key before, so the systems a lease protects can refuse a
stale holder.

This module knows nothing of Dramatiq.
"""

from __future__ import annotations

import fnmatch
import math
import secrets
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from .. import tracing
from . import scripts
from .errors import LeaseConfigError, LeaseUnavailableError
from .keys import DEFAULT_PREFIX, fence_name, lease_name, lease_pattern, validate_key, validate_prefix

#: A client this package can work with.
RedisClient = redis.Redis | RedisCluster

#: Largest number of leases renewed by one script call; bigger batches are
#: split, and the calls still share one pipelined round trip.
RENEW_BATCH = 1000

#: Part of the TTL kept as a safety margin: a holder treats its lease as lost
#: once 90% of the TTL has passed since the last confirmed renewal was *sent*,
#: so it stops before the key can expire on the server.
SAFETY_MARGIN = 0.1


def new_token() -> str:
    """A random owner token of 128 bits."""
    return secrets.token_hex(16)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Lease:
    """A lease this process holds (or held) on ``key``.

    Attributes:
      key: the lease key, such as ``"invoice:42"``.
      token: the owner token; whoever presents it owns the lease.
      fence: the fencing token of this grant, larger than any earlier grant's.
      ttl: the TTL in milliseconds that every renewal restores.
      interval: how often a heartbeat renews it, in milliseconds.
      max_hold: the longest it may be held in milliseconds, or ``None``.
      acquired_at: when it was granted, in Unix seconds (server clock).
      meta: holder metadata stored with the lease (actor, message id, host...).
    """

    __slots__ = ("_hold_until", "_valid_until", "acquired_at", "fence", "interval", "key", "max_hold", "meta", "token",
                 "ttl")

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
        self.acquired_at = acquired_at
        self.meta = dict(meta)
        margin = ttl * SAFETY_MARGIN / 1000
        self._hold_until = math.inf if max_hold is None else sent_at + max_hold / 1000 - margin
        self._valid_until = min(sent_at + ttl / 1000 - margin, self._hold_until)

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

    def confirm(self, sent_at: float) -> None:
        """Record a renewal that Redis confirmed; ``sent_at`` is when it was sent (monotonic)."""
        self._valid_until = min(sent_at + self.ttl * (1 - SAFETY_MARGIN) / 1000, self._hold_until)

    def __repr__(self) -> str:
        return f"Lease(key={self.key!r}, fence={self.fence}, ttl={self.ttl}, remaining={self.remaining():.3f}s)"


@dataclass(frozen=True)
class Busy:
    """The answer to an acquire when someone else holds the key.

    Attributes:
      key: the lease key.
      ttl_left: the holder's remaining TTL in milliseconds (-1: the key has no TTL).
      fence: the holder's fencing token (0 if unknown).
    """

    key: str
    ttl_left: int
    fence: int

    @property
    def retry_after(self) -> int:
        """Whole seconds until the holder's lease runs out at the latest (at least 1), for ``Retry-After``."""
        if self.ttl_left < 0:
            return 1
        return max(1, math.ceil(self.ttl_left / 1000))

    def __bool__(self) -> bool:
        # So that ``if leases.try_acquire(...):`` reads as "if acquired".
        return False


class Renewal(str, Enum):
    """What a renewal found."""

    OK = "ok"
    GONE = "gone"
    STOLEN = "stolen"
    MAX_HOLD = "max_hold"
    ERROR = "error"


_RENEW_CODES = {1: Renewal.OK, 0: Renewal.GONE, -1: Renewal.STOLEN, -2: Renewal.MAX_HOLD}


class State(str, Enum):
    """The health of a lease as seen from Redis."""

    ALIVE = "alive"
    HOLDER_DEAD = "holder_dead"
    PAST_MAX_HOLD = "past_max_hold"
    NO_TTL = "no_ttl"


def stale_after(interval_ms: int) -> int:
    """Milliseconds without a heartbeat after which a holder counts as dead: two missed renewals plus slack."""
    return 2 * interval_ms + 500


@dataclass(frozen=True)
class LeaseInfo:
    """Everything Redis knows about one lease, as read at ``now`` (server ms)."""

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

    @property
    def age(self) -> float:
        """Seconds since the lease was granted."""
        return max(0, self.now_ms - self.acquired_ms) / 1000

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the last renewal (or the grant)."""
        return max(0, self.now_ms - self.renewed_ms) / 1000

    @property
    def state(self) -> State:
        """``no_ttl`` beats ``past_max_hold`` beats ``holder_dead`` beats ``alive``."""
        if self.ttl_left == -1:
            return State.NO_TTL
        if self.max_hold_until_ms and self.now_ms > self.max_hold_until_ms:
            return State.PAST_MAX_HOLD
        # interval 0: nobody heartbeats this lease (taken in a web request, say); only its TTL ends it.
        if self.interval and self.now_ms - self.renewed_ms > stale_after(self.interval):
            return State.HOLDER_DEAD
        return State.ALIVE

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view (without the owner token)."""
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
        }


_CORE_FIELDS = {"token", "fence", "ttl", "interval", "acquired_ms", "renewed_ms", "max_hold_until_ms", "key"}


def _parse_info(redis_key: str, pttl: int, flat: Sequence[Any], now_ms: int) -> LeaseInfo:
    raw = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}

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
        meta={k: v for k, v in raw.items() if k not in _CORE_FIELDS},
    )


class Leases:
    """Leases on keys, stored in one Redis deployment (standalone, Sentinel or Cluster).

    Parameters:
      client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client.
        Give it a ``socket_timeout`` shorter than your TTLs: a renewal that
        hangs cannot confirm a lease.
      prefix: the prefix of every Redis key written. Defaults to
        ``"dramatiq-leases"``.

    Example:
      >>> leases = Leases.from_url("redis://127.0.0.1:6379/1")
      >>> lease = leases.try_acquire("export:report:42", ttl=30_000)
      >>> if lease:
      ...     try:
      ...         do_export(fence=lease.fence)
      ...     finally:
      ...         leases.release(lease)
      ... else:
      ...     print(f"busy, retry in {lease.retry_after}s")
    """

    def __init__(self, client: RedisClient, *, prefix: str = DEFAULT_PREFIX) -> None:
        self.client = client
        self.prefix = validate_prefix(prefix)
        self._cluster = isinstance(client, RedisCluster)
        self._acquire = client.register_script(scripts.ACQUIRE)
        self._renew_many = client.register_script(scripts.RENEW_MANY)
        self._release = client.register_script(scripts.RELEASE)
        self._release_if_dead = client.register_script(scripts.RELEASE_IF_DEAD)
        self._adopt = client.register_script(scripts.ADOPT)
        self._inspect_many = client.register_script(scripts.INSPECT_MANY)

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, socket_timeout: float = 2.0) -> Leases:
        """Leases on the Redis at ``url`` (``redis://``, ``rediss://`` or ``unix://``)."""
        client = redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        return cls(client, prefix=prefix)

    # Names -----------------------------------------------------------------

    def lease_name(self, key: str) -> str:
        """The Redis key holding the lease on ``key``."""
        return lease_name(self.prefix, key)

    def fence_name(self, key: str) -> str:
        """The Redis key holding the fencing counter of ``key``."""
        return fence_name(self.prefix, key)

    # Acquire, adopt, renew, release -----------------------------------------

    def try_acquire(
        self,
        key: str,
        ttl: int,
        *,
        interval: int | None = None,
        max_hold: int | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> Lease | Busy:
        """Acquire ``key`` for ``ttl`` milliseconds without waiting.

        Parameters:
          key: the lease key.
          ttl: the lease's time to live in milliseconds, restored by each renewal.
          interval: how often a :class:`Heartbeat` will renew it, in
            milliseconds, stored so observers can tell a dead holder. Leave
            it out for a lease nobody renews (taken in a web request and
            handed to a worker): it then counts as alive until its TTL ends,
            and a heartbeat that tracks it anyway renews every ``ttl // 3``.
          max_hold: the longest the lease may be renewed for, in milliseconds.
          meta: holder metadata stored with the lease (strings).

        Returns:
          a :class:`Lease` with a fresh token and fence, or :class:`Busy`
          (falsy) with the holder's remaining TTL.

        Raises:
          LeaseUnavailableError: Redis could not be asked; nothing was granted.
        """
        validate_key(key)
        if ttl <= 0:
            raise LeaseConfigError(f"ttl must be a positive number of milliseconds, got {ttl!r}")
        token = new_token()
        meta = dict(meta or {})
        args: list[Any] = [token, ttl, max_hold or 0, interval or 0]
        for k, v in {**meta, "key": key}.items():
            args += [k, v]
        with tracing.span("lease.acquire", {tracing.KEY: key, tracing.TTL: ttl}) as span:
            sent_at = time.monotonic()
            try:
                reply = self._acquire(keys=[self.lease_name(key), self.fence_name(key)], args=args)
            except redis.RedisError as e:
                raise LeaseUnavailableError(f"could not acquire lease {key!r}: {type(e).__name__}: {e}") from e
            if int(reply[0]) != 1:
                span.set_attributes({tracing.OUTCOME: "busy", tracing.FENCE: int(reply[2])})
                return Busy(key=key, ttl_left=int(reply[1]), fence=int(reply[2]))
            span.set_attributes({tracing.OUTCOME: "acquired", tracing.FENCE: int(reply[1])})
        return Lease(
            key=key,
            token=token,
            fence=int(reply[1]),
            ttl=ttl,
            interval=interval or max(1, ttl // 3),
            max_hold=max_hold,
            acquired_at=int(reply[2]) / 1000,
            meta=meta,
            sent_at=sent_at,
        )

    def adopt(
        self,
        key: str,
        token: str,
        ttl: int,
        *,
        interval: int | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> Lease | Busy | None:
        """Take over a lease acquired elsewhere (another process) by proving its ``token``.

        The TTL is restored to ``ttl`` and the metadata updated; the fence and
        the maximum hold stay those of the original grant.

        Returns:
          the :class:`Lease`; :class:`Busy` if another token holds ``key``
          now; ``None`` if the lease is gone (expired or released).
        """
        validate_key(key)
        interval = interval or max(1, ttl // 3)
        meta = dict(meta or {})
        args: list[Any] = [token, ttl, interval]
        for k, v in {**meta, "key": key}.items():
            args += [k, v]
        sent_at = time.monotonic()
        try:
            reply = self._adopt(keys=[self.lease_name(key)], args=args)
        except redis.RedisError as e:
            raise LeaseUnavailableError(f"could not adopt lease {key!r}: {type(e).__name__}: {e}") from e
        code = int(reply[0])
        if code == 0:
            return None
        if code < 0:
            return Busy(key=key, ttl_left=int(reply[1]), fence=int(reply[2]))
        _, fence, acquired_ms, until_ms, now_ms = (int(x) for x in reply)
        return Lease(
            key=key,
            token=token,
            fence=fence,
            ttl=ttl,
            interval=interval,
            max_hold=(until_ms - now_ms) if until_ms else None,
            acquired_at=acquired_ms / 1000,
            meta=meta,
            sent_at=sent_at,
        )

    def renew(self, lease: Lease) -> Renewal:
        """Restore ``lease``'s TTL if this token still holds it. Raises :class:`LeaseUnavailableError`."""
        return self.renew_many([lease])[0]

    def renew_many(self, leases: Sequence[Lease]) -> list[Renewal]:
        """Renew many leases in one round trip per hash slot (one in all on a standalone Redis).

        Confirmed leases have their local validity extended. Returns one
        :class:`Renewal` per lease, in order.

        Raises:
          LeaseUnavailableError: Redis could not be asked.
        """
        if not leases:
            return []
        groups: dict[int, list[int]] = defaultdict(list)
        for i, lease in enumerate(leases):
            slot = key_slot(self.lease_name(lease.key).encode()) if self._cluster else 0
            groups[slot].append(i)
        batches = [idx[n : n + RENEW_BATCH] for idx in groups.values() for n in range(0, len(idx), RENEW_BATCH)]
        with tracing.span("lease.renew", {tracing.COUNT: len(leases)}) as span:
            sent_at = time.monotonic()
            try:
                replies = self._run_batches(leases, batches)
            except redis.RedisError as e:
                raise LeaseUnavailableError(f"could not renew {len(leases)} lease(s): {type(e).__name__}: {e}") from e
            out = [Renewal.ERROR] * len(leases)
            for batch, codes in zip(batches, replies):
                for i, code in zip(batch, codes):
                    out[i] = _RENEW_CODES.get(int(code), Renewal.STOLEN)
                    if out[i] is Renewal.OK:
                        leases[i].confirm(sent_at)
            lost = len(leases) - out.count(Renewal.OK)
            span.set_attributes({tracing.OUTCOME: "ok" if not lost else "lost", "lease.lost_count": lost})
        return out

    def _run_batches(self, leases: Sequence[Lease], batches: list[list[int]]) -> list[list[Any]]:
        def keys_args(batch: list[int]) -> tuple[list[str], list[Any]]:
            args: list[Any] = []
            for i in batch:
                args += [leases[i].token, leases[i].ttl]
            return [self.lease_name(leases[i].key) for i in batch], args

        if self._cluster or len(batches) == 1:
            # A cluster routes each call to its slot's node: one round trip per slot.
            return [self._renew_many(*keys_args(batch)) for batch in batches]
        # redis-py would check SCRIPT EXISTS before a pipeline (an extra round trip);
        # send bare EVALSHAs and load the script only if Redis lost it (a restart).
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            for batch in batches:
                keys, args = keys_args(batch)
                pipe.evalsha(self._renew_many.sha, len(keys), *keys, *args)
            try:
                return list(pipe.execute())
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                self.client.script_load(scripts.RENEW_MANY)
        raise AssertionError("unreachable")

    def release(self, lease: Lease) -> bool:
        """Release ``lease`` if its token still holds it; ``False`` if it did not (nothing touched).

        Raises:
          LeaseUnavailableError: Redis could not be asked; the lease expires by its TTL.
        """
        return self.release_token(lease.key, lease.token, fence=lease.fence)

    def release_token(self, key: str, token: str, *, fence: int | None = None) -> bool:
        """Release the lease on ``key`` only if ``token`` holds it (``fence`` only labels the span)."""
        attributes: dict[str, str | int] = {tracing.KEY: key}
        if fence is not None:
            attributes[tracing.FENCE] = fence
        with tracing.span("lease.release", attributes) as span:
            try:
                released = int(self._release(keys=[self.lease_name(key), self.fence_name(key)], args=[token])) == 1
            except redis.RedisError as e:
                raise LeaseUnavailableError(f"could not release lease {key!r}: {type(e).__name__}: {e}") from e
            span.set_attribute(tracing.OUTCOME, "released" if released else "not_held")
        return released

    def release_if_dead(self, key: str) -> tuple[bool | None, float, int]:
        """Release the lease on ``key`` only if its holder's heartbeat has stopped.

        The check and the delete are one script, so a holder that renews in
        between keeps its lease.

        Returns:
          ``(released, heartbeat_age_seconds, fence)``; ``released`` is
          ``None`` when there is no lease on ``key``.
        """
        info = self.inspect(key)
        if info is None:
            return None, 0.0, 0
        # Without a heartbeat to judge by, only a lease without TTL counts as dead.
        stale = stale_after(info.interval) if info.interval else 2**62
        try:
            reply = self._release_if_dead(keys=[self.lease_name(key), self.fence_name(key)], args=[stale])
        except redis.RedisError as e:
            raise LeaseUnavailableError(f"could not release lease {key!r}: {type(e).__name__}: {e}") from e
        if int(reply[0]) < 0:
            return None, 0.0, 0
        return int(reply[0]) == 1, int(reply[1]) / 1000, int(reply[2])

    # Inspection ------------------------------------------------------------

    def inspect(self, key: str) -> LeaseInfo | None:
        """What Redis holds for the lease on ``key``, or ``None`` if there is none."""
        infos = self.inspect_names([self.lease_name(validate_key(key))])
        return infos[0] if infos else None

    def inspect_names(self, names: Sequence[str]) -> list[LeaseInfo]:
        """Read the lease hashes at these Redis keys (those that still exist), one round trip per slot."""
        by_slot: dict[int, list[str]] = defaultdict(list)
        for name in names:
            by_slot[key_slot(name.encode()) if self._cluster else 0].append(name)
        out: list[LeaseInfo] = []
        try:
            for group in by_slot.values():
                reply = self._inspect_many(keys=group, args=[])
                now_ms = int(reply[0])
                for name, (pttl, flat) in zip(group, reply[1:]):
                    if int(pttl) != -2:
                        out.append(_parse_info(name, int(pttl), flat, now_ms))
        except redis.RedisError as e:
            raise LeaseUnavailableError(f"could not read leases: {type(e).__name__}: {e}") from e
        return out

    def scan(self, match: str = "*", *, count: int = 500) -> Iterator[LeaseInfo]:
        """Every lease whose key matches the glob ``match``, read in batches with ``SCAN`` (never ``KEYS``).

        With the default ``match``, also any other key under ``{prefix}:lease:``
        (a key someone wrote by hand, perhaps without TTL: the classic orphan).
        """
        if match == "*":
            yield from self._scan(f"{self.prefix}:lease:*", count)
            return
        seen = set()
        for info in self._scan(lease_pattern(self.prefix, match), count):
            seen.add(info.redis_key)
            yield info
        # Keys with braces are stored under a digest (see hash_tag): match them here.
        for info in self._scan(lease_pattern(self.prefix, "h:*"), count):
            if info.redis_key not in seen and fnmatch.fnmatchcase(info.key, match):
                yield info

    def _scan(self, pattern: str, count: int) -> Iterator[LeaseInfo]:
        batch: list[str] = []
        try:
            names: Iterable[Any] = self.client.scan_iter(match=pattern, count=count)
            for name in names:
                batch.append(_text(name))
                if len(batch) >= count:
                    yield from self.inspect_names(batch)
                    batch = []
        except redis.RedisError as e:
            raise LeaseUnavailableError(f"could not scan leases: {type(e).__name__}: {e}") from e
        if batch:
            yield from self.inspect_names(batch)

    def fence_state(self, key: str) -> dict[str, int]:
        """The fence counter of ``key``: last ``fence`` granted, last ``released``, last ``expired``."""
        return self.fence_states([validate_key(key)])[0]

    def fence_states(self, keys: Sequence[str]) -> list[dict[str, int]]:
        """:meth:`fence_state` of many keys, pipelined."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(self.fence_name(key))
        try:
            replies = pipe.execute()
        except redis.RedisError as e:
            raise LeaseUnavailableError(f"could not read fence counters: {type(e).__name__}: {e}") from e
        return [{_text(k): int(v) for k, v in raw.items()} for raw in replies]
