"""The libraries compared, reduced to "one acquire+release cycle" and "one renewal round of N held locks".

Every adapter uses its library the way its documentation shows, with a
30 s TTL, and checks that each acquire and release succeeded: a benchmark
of a lock that silently fails measures nothing.

Peers construct their lock object per cycle, as a job with its own key
would; ours reuses one :class:`Leases`, as :class:`LeaseMiddleware` does.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis_lock
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.rate_limits.backends import RedisBackend
from pottery import Redlock

from dramatiq_leases import Leases

#: TTL of every lock in figure 1, in milliseconds.
TTL_MS = 30_000

#: TTL of the locks held in figure 2: longer than setting up and timing every peer at N = 10 000 takes,
#: so no lock expires between two of its renewal rounds (that would measure a failure, not a renewal).
HB_TTL_MS = 600_000

#: The seed's pattern: compare-and-delete, so only the owner releases.
RAW_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: The per-lease renewal a hand-written heartbeat would use: compare-and-pexpire.
RAW_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

#: The least a renewal of many leases can be: one script over all keys, a token check and a PEXPIRE each.
RAW_RENEW_ALL = """
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i + 1] then redis.call('PEXPIRE', key, ARGV[1]) end
end
return 1
"""

Cycle = Callable[[], None]

# pottery logs every acquire at INFO and warns about single-master use; neither is news here.
logging.getLogger("pottery").setLevel(logging.ERROR)


class BenchError(RuntimeError):
    """A lock under test did not do what it promised (acquire or release failed)."""


def check(ok: object, what: str) -> None:
    """Raise :class:`BenchError` unless ``ok``: keeps ``python -O`` from skipping the check."""
    if not ok:
        raise BenchError(what)


@dataclass(frozen=True)
class CyclePeer:
    """A library under figure 1: ``make(client)`` returns a function doing one acquire+release."""

    name: str
    make: Callable[[redis.Redis], Cycle]
    note: str = ""


def _ping(client: redis.Redis) -> Cycle:
    def cycle() -> None:
        client.ping()

    return cycle


def _raw(client: redis.Redis) -> Cycle:
    release = client.register_script(RAW_RELEASE)
    key = "bench:raw"

    def cycle() -> None:
        token = secrets.token_hex(16)
        check(client.set(key, token, nx=True, px=TTL_MS), "raw acquire")
        check(release(keys=[key], args=[token]) == 1, "raw release")

    return cycle


def _ours(client: redis.Redis) -> Cycle:
    leases = Leases(client)

    def cycle() -> None:
        lease = leases.try_acquire("bench:ours", TTL_MS)
        check(lease, "dramatiq-leases acquire")
        check(leases.release(lease), "dramatiq-leases release")  # type: ignore[arg-type]

    return cycle


def _ours_history(client: redis.Redis) -> Cycle:
    """:func:`_ours` with each key's history kept (``Leases(history=50)``): two events per cycle."""
    leases = Leases(client, history=HISTORY_CAP)

    def cycle() -> None:
        lease = leases.try_acquire("bench:ours-history", TTL_MS)
        check(lease, "dramatiq-leases (history on) acquire")
        check(leases.release(lease), "dramatiq-leases (history on) release")  # type: ignore[arg-type]

    return cycle


def leases_cycle(
    leases_class: Callable[[redis.Redis], Any], key: str, **acquire: Any
) -> Callable[[redis.Redis], Cycle]:
    """Figure 1's cycle of ours with any :class:`Leases` class (today's or an earlier commit's, see
    :mod:`bench.baseline`) on ``key``, ``acquire`` passed to ``try_acquire`` (``limit=4``)."""

    def make(client: redis.Redis) -> Cycle:
        leases = leases_class(client)

        def cycle() -> None:
            lease = leases.try_acquire(key, TTL_MS, **acquire)
            check(lease, f"{key} acquire")
            check(leases.release(lease), f"{key} release")

        return cycle

    return make


def _redis_py(client: redis.Redis) -> Cycle:
    def cycle() -> None:
        lock = client.lock("bench:redis-py", timeout=TTL_MS / 1000, blocking=False)
        check(lock.acquire(), "redis-py Lock acquire")
        lock.release()  # raises LockNotOwnedError on failure

    return cycle


def _python_redis_lock(auto_renewal: bool) -> Callable[[redis.Redis], Cycle]:
    def make(client: redis.Redis) -> Cycle:
        def cycle() -> None:
            lock = redis_lock.Lock(client, "bench:prl", expire=TTL_MS // 1000, auto_renewal=auto_renewal)
            check(lock.acquire(blocking=False), "python-redis-lock acquire")
            lock.release()  # raises NotAcquired on failure

        return cycle

    return make


def _pottery(client: redis.Redis) -> Cycle:
    def cycle() -> None:
        lock = Redlock(key="bench:pottery", masters={client}, auto_release_time=TTL_MS / 1000)
        check(lock.acquire(blocking=False), "pottery acquire")
        lock.release()  # raises ReleaseUnlockedLock on failure

    return cycle


def _rate_limiter(client: redis.Redis) -> Cycle:
    backend = RedisBackend(client=client)

    def cycle() -> None:
        mutex = ConcurrentRateLimiter(backend, "bench:crl", limit=1, ttl=TTL_MS)
        with mutex.acquire(raise_on_failure=False) as acquired:
            check(acquired, "ConcurrentRateLimiter acquire")

    return cycle


PING = CyclePeer("PING (floor)", _ping, "one round trip, no lock")
RAW = CyclePeer("raw SET NX + Lua CAD", _raw, "baseline: SET NX PX, compare-and-delete script")
OURS = CyclePeer("dramatiq-leases", _ours, "try_acquire + release (fence, metadata, server time)")
#: How many events figure 1's "history on" variant keeps per key (its list is at the cap after 25 cycles).
HISTORY_CAP = 50
OURS_HISTORY = CyclePeer(
    "dramatiq-leases, history on",
    _ours_history,
    f"as dramatiq-leases, with Leases(history={HISTORY_CAP}): granted and released appended in the same scripts",
)

LOCK = CyclePeer("redis-py Lock", _redis_py, "SET NX PX, Lua release")

CYCLE_PEERS: tuple[CyclePeer, ...] = (
    PING,
    RAW,
    OURS,
    OURS_HISTORY,
    LOCK,
    CyclePeer(
        "python-redis-lock (auto-renewal)",
        _python_redis_lock(True),
        "GET (held?) + SET NX, a renewal thread per lock, Lua release",
    ),
    CyclePeer("python-redis-lock (no renewal)", _python_redis_lock(False), "as above without the thread"),
    CyclePeer("pottery Redlock (1 master)", _pottery, "a thread pool per acquire and per release"),
    CyclePeer("dramatiq ConcurrentRateLimiter", _rate_limiter, "SET NX; release is WATCH/GET/MULTI/SET/EXEC"),
)


# Figure 2: renewal rounds --------------------------------------------------------------------


@dataclass(frozen=True)
class RenewPeer:
    """A way to renew N held locks: ``make(client, n)`` acquires them and returns one renewal round."""

    name: str
    make: Callable[[redis.Redis, int], Cycle]
    note: str = ""


def _ours_renew(client: redis.Redis, n: int) -> Cycle:
    leases = Leases(client)
    held = []
    for i in range(n):
        lease = leases.try_acquire(f"bench:hb:ours:{i}", HB_TTL_MS)
        check(lease, "acquire")
        held.append(lease)

    def round_() -> None:
        # What Heartbeat._round does: one renew_many over every due lease.
        results = leases.renew_many(held)  # type: ignore[arg-type]
        check(all(r.value == "ok" for r in results), "renew_many")

    return round_


def _raw_tokens(client: redis.Redis, prefix: str, n: int) -> list[tuple[str, str]]:
    pairs = [(f"{prefix}:{i}", secrets.token_hex(16)) for i in range(n)]
    pipe = client.pipeline(transaction=False)
    for key, token in pairs:
        pipe.set(key, token, px=HB_TTL_MS)
    pipe.execute()
    return pairs


def _raw_loop(client: redis.Redis, n: int) -> Cycle:
    renew = client.register_script(RAW_RENEW)
    pairs = _raw_tokens(client, "bench:hb:rawloop", n)

    def round_() -> None:
        for key, token in pairs:
            check(renew(keys=[key], args=[token, HB_TTL_MS]) == 1, "raw renew")

    return round_


def _raw_pipelined(client: redis.Redis, n: int) -> Cycle:
    renew = client.register_script(RAW_RENEW)
    pairs = _raw_tokens(client, "bench:hb:rawpipe", n)

    def round_() -> None:
        pipe = client.pipeline(transaction=False)
        for key, token in pairs:
            renew(keys=[key], args=[token, HB_TTL_MS], client=pipe)
        check(all(r == 1 for r in pipe.execute()), "raw pipelined renew")

    return round_


def _raw_one_script(client: redis.Redis, n: int) -> Cycle:
    renew = client.register_script(RAW_RENEW_ALL)
    pairs = _raw_tokens(client, "bench:hb:rawall", n)
    keys, tokens = [k for k, _ in pairs], [t for _, t in pairs]

    def round_() -> None:
        check(renew(keys=keys, args=[HB_TTL_MS, *tokens]) == 1, "raw renew of all")

    return round_


def _redis_py_extend(client: redis.Redis, n: int) -> Cycle:
    locks = [client.lock(f"bench:hb:rpy:{i}", timeout=HB_TTL_MS / 1000, blocking=False) for i in range(n)]
    for lock in locks:
        check(lock.acquire(), "acquire")

    def round_() -> None:
        for lock in locks:
            lock.extend(HB_TTL_MS / 1000, replace_ttl=True)

    return round_


def _redis_py_reacquire(client: redis.Redis, n: int) -> Cycle:
    locks = [client.lock(f"bench:hb:rpyre:{i}", timeout=HB_TTL_MS / 1000, blocking=False) for i in range(n)]
    for lock in locks:
        check(lock.acquire(), "acquire")

    def round_() -> None:
        for lock in locks:
            lock.reacquire()

    return round_


def _prl_extend(client: redis.Redis, n: int) -> Cycle:
    # auto_renewal=False here: what we time is the renewal itself (Lock.extend,
    # which its renewal thread calls), not N threads sleeping.
    locks = [redis_lock.Lock(client, f"bench:hb:prl:{i}", expire=HB_TTL_MS // 1000) for i in range(n)]
    for lock in locks:
        check(lock.acquire(blocking=False), "acquire")

    def round_() -> None:
        for lock in locks:
            lock.extend()

    return round_


def _pottery_extend(client: redis.Redis, n: int) -> Cycle:
    # num_extensions is 3 by default: pottery refuses a fourth renewal. Raised here so rounds can repeat.
    locks = [
        Redlock(
            key=f"bench:hb:pot:{i}",
            masters={client},
            auto_release_time=HB_TTL_MS / 1000,
            num_extensions=1_000_000,
        )
        for i in range(n)
    ]
    for lock in locks:
        check(lock.acquire(blocking=False), "acquire")

    def round_() -> None:
        for lock in locks:
            lock.extend()

    return round_


RENEW_OURS = RenewPeer("dramatiq-leases renew_many", _ours_renew, "one script call per 1 000 leases, pipelined")

RENEW_PEERS: tuple[RenewPeer, ...] = (
    RENEW_OURS,
    RenewPeer("raw Lua renew, one script", _raw_one_script, "hand-written: one EVALSHA checking and extending all N"),
    RenewPeer("raw Lua renew, pipelined", _raw_pipelined, "hand-written: N EVALSHA in one pipeline"),
    RenewPeer("raw Lua renew, loop", _raw_loop, "one EVALSHA round trip per lease"),
    RenewPeer("redis-py Lock.extend loop", _redis_py_extend, "one round trip per lock"),
    RenewPeer("redis-py Lock.reacquire loop", _redis_py_reacquire, "one round trip per lock"),
    RenewPeer("python-redis-lock extend loop", _prl_extend, "what its per-lock renewal thread does"),
    RenewPeer("pottery Redlock.extend loop", _pottery_extend, "a thread pool per extend; max 3 by default"),
)

#: Per-lease peers whose round at the largest N would take minutes on their own; skipped above this N.
SLOW_ABOVE: dict[str, int] = {"pottery Redlock.extend loop": 1_000}


def cleanup(client: redis.Redis) -> None:
    """Delete every key the benchmarks wrote (they all start with ``bench:`` or the lease prefix)."""
    for pattern in ("bench:*", "dramatiq-leases:*", "lock:bench:*", "lock-signal:bench:*", "redlock:bench:*"):
        names: list[Any] = list(client.scan_iter(match=pattern, count=1000))
        for i in range(0, len(names), 1000):
            client.delete(*names[i : i + 1000])
