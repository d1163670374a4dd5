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
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from . import scripts, tracing
from .errors import LeaseConfigError, LeaseUnavailableError
from .keys import DEFAULT_PREFIX, fence_name, lease_name, lease_pattern, validate_key, validate_prefix
from .numbers import margin_ms, whole_ms

#: A client this package can work with.
RedisClient = redis.Redis | RedisCluster

#: Largest number of leases renewed by one script call; bigger batches are
#: split, and the calls still share one pipelined round trip.
RENEW_BATCH = 1000

def new_token() -> str:
    """A random owner token of 128 bits."""
    return secrets.token_hex(16)


_new_token = new_token  # for methods whose parameter is named new_token


def default_interval(ttl: int) -> int:
    """The renewal interval used when none is given: a third of the TTL."""
    return max(1, ttl // 3)


def _check_numbers(ttl: Any, interval: Any, max_hold: Any) -> tuple[int, int, int]:
    """Validated ``(ttl, interval or 0, max_hold or 0)``: every number is checked before any write."""
    ttl = whole_ms(ttl, "ttl")
    interval = 0 if interval is None else whole_ms(interval, "interval")
    max_hold = 0 if max_hold is None else whole_ms(max_hold, "max_hold")
    return ttl, interval, max_hold


class DeadRelease(NamedTuple):
    """What :meth:`Leases.release_if_dead` did.

    Attributes:
      released: ``True`` if released, ``False`` if refused, ``None`` if there is no such lease.
      deadline_in: seconds until the lease may be released, its holder's
        deadline plus safety margin (negative: past it), or ``None`` when the
        key does not say (it then expires by its TTL).
      fence: the fence of the lease found (0 if unknown).
    """

    released: bool | None
    deadline_in: float | None
    fence: int


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
    """

    __slots__ = ("_hold_until", "_valid_until", "acquired_at", "fence", "interval", "key", "margin", "max_hold", "meta",
                 "token", "ttl")

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
        self._hold_until = math.inf if max_hold is None else sent_at + max_hold / 1000
        self._valid_until = min(sent_at + (ttl - self.margin) / 1000, self._hold_until)

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
        # max: a slow reply to an earlier renewal must not pull back what a later one confirmed.
        self._valid_until = max(self._valid_until, min(sent_at + (self.ttl - self.margin) / 1000, self._hold_until))

    def __repr__(self) -> str:
        return f"Lease(key={self.key!r}, fence={self.fence}, ttl={self.ttl}, remaining={self.remaining():.3f}s)"


@dataclass(frozen=True)
class Busy:
    """The answer to an acquire when someone else holds the key.

    Attributes:
      key: the lease key.
      ttl_left: the holder's remaining TTL in milliseconds (-1: the key has no TTL).
      fence: the holder's fencing token (0 if unknown).
      now_ms: the Redis server's clock when it answered (Unix ms; 0 if unknown).
    """

    key: str
    ttl_left: int
    fence: int
    now_ms: int = 0

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
    """Everything Redis knows about one lease, as read at ``now_ms`` (server ms)."""

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
    margin_ms: int = 0
    adopted_ms: int = 0

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
        return ends - self.margin_ms

    @property
    def ends_ms(self) -> int | None:
        """When the lease ends by its holder's own facts: its deadline plus the margin its actor has to stop.

        The instant the key expires by itself unless its TTL was changed by
        hand; from then on ``release --if-dead`` may end it.
        """
        deadline = self.holder_deadline_ms
        return None if deadline is None else deadline + self.margin_ms

    @property
    def state(self) -> State:
        """The lease's health; see :class:`State`. Agrees with :meth:`Leases.release_if_dead` on the same snapshot."""
        deadline = self.ends_ms
        if deadline is not None and self.now_ms < deadline:
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
        }


#: Hash fields the scripts own; holder metadata may not use these names.
_CORE_FIELDS = frozenset({"token", "fence", "ttl", "interval", "margin_ms", "acquired_ms", "renewed_ms",
                          "max_hold_until_ms", "adopted_ms", "key"})


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
        margin_ms=num("margin_ms"),
        adopted_ms=num("adopted_ms"),
    )


def _meta_args(key: str, meta: Mapping[str, str]) -> list[str]:
    """Holder metadata as flat field/value arguments, after the lease key itself."""
    args = ["key", key]
    for name, value in meta.items():
        if not isinstance(name, str) or name in _CORE_FIELDS or not isinstance(value, str):
            raise LeaseConfigError(
                f"lease metadata must map strings to strings, not reuse {sorted(_CORE_FIELDS)}; got {name!r}: {value!r}"
            )
        args += [name, value]
    return args


class Leases:
    """Leases on keys, stored in one Redis deployment (standalone, Sentinel or Cluster).

    Parameters:
      client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client.
        Give it a ``socket_timeout`` shorter than your TTLs: a renewal that
        hangs cannot confirm a lease.
      prefix: the prefix of every Redis key written. Defaults to
        ``"dramatiq-leases"``.
      thread_connections: acquire, adopt and release on a connection of the
        calling thread's own, reopened after any call that did not complete.
        For threads that asynchronous exceptions can interrupt (Dramatiq's
        worker threads): an interruption between sending a command and
        reading its reply would otherwise return a pooled connection with a
        reply still unread, which the next caller would take for its own, or
        leak the connection from the pool. Not available with RedisCluster.

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

    def __init__(self, client: RedisClient, *, prefix: str = DEFAULT_PREFIX, thread_connections: bool = False) -> None:
        self.client = client
        self.prefix = validate_prefix(prefix)
        self._cluster = isinstance(client, RedisCluster)
        self._threads: threading.local | None = threading.local() if thread_connections and not self._cluster else None
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
        token: str | None = None,
    ) -> Lease | Busy:
        """Acquire ``key`` for ``ttl`` milliseconds without waiting.

        Parameters:
          key: the lease key.
          ttl: the lease's time to live in whole milliseconds, restored by each renewal.
          interval: how often a :class:`Heartbeat` will renew it, in
            milliseconds, stored so observers can tell an overdue heartbeat.
            Leave it out for a lease nobody renews (taken in a web request
            and handed to a worker); a heartbeat that tracks it anyway
            renews every ``ttl // 3``.
          max_hold: the longest the holder may trust the lease, in
            milliseconds from now; renewals never extend it past that.
          meta: holder metadata stored with the lease (strings).
          token: the owner token to use; default a fresh random one. Choose
            it beforehand to be able to release a grant whose reply was lost.

        Returns:
          a :class:`Lease` with the token and a new fence, or :class:`Busy`
          (falsy) with the holder's remaining TTL.

        Raises:
          LeaseConfigError: a number is not a whole count of milliseconds in
            range, or the metadata is not strings; checked before Redis is asked.
          LeaseUnavailableError: Redis could not be asked; nothing was granted.
        """
        validate_key(key)
        ttl, stored_interval, max_hold_ms = _check_numbers(ttl, interval, max_hold)
        token = token or new_token()
        meta = dict(meta or {})
        args: list[Any] = [token, ttl, max_hold_ms, stored_interval, margin_ms(ttl), *_meta_args(key, meta)]
        with tracing.span("lease.acquire", {tracing.KEY: key, tracing.TTL: ttl}) as span:
            sent_at = time.monotonic()
            try:
                reply = self._call(self._acquire, [self.lease_name(key), self.fence_name(key)], args)
            except redis.RedisError as e:
                raise LeaseUnavailableError(f"could not acquire lease {key!r}: {type(e).__name__}: {e}") from e
            if int(reply[0]) != 1:
                span.set_attributes({tracing.OUTCOME: "busy", tracing.FENCE: int(reply[2])})
                return Busy(key=key, ttl_left=int(reply[1]), fence=int(reply[2]), now_ms=int(reply[3]))
            span.set_attributes({tracing.OUTCOME: "acquired", tracing.FENCE: int(reply[1])})
        return Lease(
            key=key,
            token=token,
            fence=int(reply[1]),
            ttl=ttl,
            interval=stored_interval or default_interval(ttl),
            max_hold=max_hold_ms or None,
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
        max_hold: int | None = None,
        meta: Mapping[str, str] | None = None,
        new_token: str | None = None,
    ) -> Lease | Busy | None:
        """Take over a lease acquired elsewhere (a web request) by proving its ``token``.

        Adoption happens once: the lease gets a new owner token, so a second
        adopter presenting the same handed-over token finds the key busy. The
        fence stays the grant's (one grant, one run). The TTL becomes ``ttl``;
        the maximum hold becomes the earlier of the grant's and ``max_hold``
        from now.

        Returns:
          the adopted :class:`Lease` (with the new token); :class:`Busy` if
          another token holds ``key`` now, including an earlier adopter;
          ``None`` if the lease is gone (expired or released) or its maximum
          hold leaves less than the safety margin.

        Raises:
          LeaseConfigError: as :meth:`try_acquire`.
          LeaseUnavailableError: Redis could not be asked.
        """
        validate_key(key)
        ttl, stored_interval, max_hold_ms = _check_numbers(ttl, interval, max_hold)
        if not isinstance(token, str) or not token:
            raise LeaseConfigError(f"the handed-over token must be a non-empty string, got {token!r}")
        mine = new_token or _new_token()
        meta = dict(meta or {})
        interval_ms = stored_interval or default_interval(ttl)
        margin = margin_ms(ttl)
        args: list[Any] = [token, mine, ttl, interval_ms, margin, max_hold_ms, *_meta_args(key, meta)]
        sent_at = time.monotonic()
        try:
            reply = self._call(self._adopt, [self.lease_name(key)], args)
        except redis.RedisError as e:
            raise LeaseUnavailableError(f"could not adopt lease {key!r}: {type(e).__name__}: {e}") from e
        code = int(reply[0])
        if code == 0:
            return None
        if code < 0:
            return Busy(key=key, ttl_left=int(reply[1]), fence=int(reply[2]), now_ms=int(reply[3]))
        _, fence, acquired_ms, until_ms, now_ms = (int(x) for x in reply)
        return Lease(
            key=key,
            token=mine,
            fence=fence,
            ttl=ttl,
            interval=interval_ms,
            # The server keeps the key until until_ms; the holder stops a margin earlier.
            max_hold=(until_ms - now_ms - margin) if until_ms else None,
            acquired_at=acquired_ms / 1000,
            meta=meta,
            sent_at=sent_at,
        )

    def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run ``script`` on this thread's own connection when asked to (see ``thread_connections``)."""
        local = self._threads
        if local is None:
            return script(keys=keys, args=args)
        client = getattr(local, "client", None)
        if client is None:
            assert isinstance(self.client, redis.Redis)
            client = local.client = redis.Redis(connection_pool=self.client.connection_pool,
                                                single_connection_client=True)
        elif local.dirty:
            client.connection.disconnect()  # the last call did not complete: never read its reply as ours
        # Two single stores around the call: an interruption anywhere in between leaves dirty set.
        local.dirty = True
        reply = script(keys=keys, args=args, client=client)
        local.dirty = False
        return reply

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
                released = int(self._call(self._release, [self.lease_name(key), self.fence_name(key)], [token])) == 1
            except redis.RedisError as e:
                raise LeaseUnavailableError(f"could not release lease {key!r}: {type(e).__name__}: {e}") from e
            span.set_attribute(tracing.OUTCOME, "released" if released else "not_held")
        return released

    def release_if_dead(self, key: str) -> DeadRelease:
        """Release the lease on ``key`` only if no holder can still be running under it.

        Decided inside one script from facts the holder wrote itself: its
        deadline and the margin its actor has to stop have passed
        (:attr:`LeaseInfo.ends_ms`; the key outlived them because its TTL was
        changed by hand); or the hash does not say and the key has no TTL
        (written by hand). A holder whose heartbeat is merely overdue keeps
        its lease: it may still be running, and the key expires by itself at
        that same instant.
        """
        try:
            reply = self._release_if_dead(keys=[self.lease_name(validate_key(key)), self.fence_name(key)], args=[])
        except redis.RedisError as e:
            raise LeaseUnavailableError(f"could not release lease {key!r}: {type(e).__name__}: {e}") from e
        code = int(reply[0])
        if code < 0:
            return DeadRelease(None, None, 0)
        ms, fence = int(reply[1]), int(reply[2])
        if code == 1:
            return DeadRelease(True, -ms / 1000, fence)
        return DeadRelease(False, ms / 1000 if ms >= 0 else None, fence)

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
