"""Reading leases without changing them: inspect, scan, lines, fence counters (one round trip per slot)."""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.crc import key_slot

from .client import RedisClient, unavailable
from .info import LeaseInfo, parse_info, text
from .keys import fence_name, lease_name, lease_pattern, line_name, line_pattern, validate_key

_FENCE_FIELDS = frozenset({"fence", "released", "expired"})


@dataclass(frozen=True)
class LineInfo:
    """What the line of one key holds now.

    Attributes:
      name: the Redis key of the line.
      length: how many wait in it.
      head: the waiter id at its head (``""`` if empty).
      oldest_first_ms: the first attempt of its oldest waiter (server Unix ms; 0 if empty).
      now_ms: the server's clock when read.
      states: how many waiters are parked (``"parked"``), asked back (``"promoted"``), waiting in place
        (``"in_place"``).
      actors: how many waiters each actor has.
    """

    name: str
    length: int
    head: str
    oldest_first_ms: int
    now_ms: int
    states: dict[str, int]
    actors: dict[str, int]

    @property
    def oldest_wait(self) -> float:
        """Seconds its oldest waiter has waited since its first attempt (0 if empty)."""
        return max(0.0, (self.now_ms - self.oldest_first_ms) / 1000) if self.oldest_first_ms else 0.0


_STATES = {"p": "parked", "m": "promoted", "r": "in_place"}


class LeaseReading:
    """The read side of :class:`~dramatiq_leases.core.store.Leases` (its base class)."""

    client: RedisClient
    prefix: str
    _cluster: bool
    _inspect_many: Any

    def inspect(self, key: str) -> LeaseInfo | None:
        """What Redis holds for the lease on ``key``, or ``None`` if there is none."""
        infos = self.inspect_names([lease_name(self.prefix, validate_key(key))])
        return infos[0] if infos else None

    def inspect_names(self, names: Sequence[str]) -> list[LeaseInfo]:
        """Read the lease hashes at these Redis keys (those that still exist), one round trip per slot."""
        by_slot: dict[int, list[str]] = defaultdict(list)
        for name in names:
            by_slot[key_slot(name.encode()) if self._cluster else 0].append(name)
        out: list[LeaseInfo] = []
        with unavailable("read leases"):
            for group in by_slot.values():
                reply = self._inspect_many(keys=group, args=[])
                now_ms = int(reply[0])
                for name, (pttl, flat) in zip(group, reply[1:]):
                    if int(pttl) != -2:
                        out.append(parse_info(name, int(pttl), flat, now_ms))
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

    def _scan_names(self, pattern: str, count: int) -> Iterator[str]:
        """The Redis keys matching ``pattern``, by ``SCAN`` (on a cluster: of every master, each key once)."""
        names: Iterable[Any] = self.client.scan_iter(match=pattern, count=count)
        if not self._cluster:
            yield from map(text, names)
            return
        seen: set[str] = set()  # a key moved to a master scanned later (a slot migration) is listed twice
        for raw in names:
            name = text(raw)
            if name not in seen:
                seen.add(name)
                yield name

    def _scan(self, pattern: str, count: int) -> Iterator[LeaseInfo]:
        batch: list[str] = []
        with unavailable("scan leases"):
            for name in self._scan_names(pattern, count):
                batch.append(name)
                if len(batch) >= count:
                    yield from self.inspect_names(batch)
                    batch = []
        if batch:
            yield from self.inspect_names(batch)

    def inspect_line(self, key: str) -> LineInfo:
        """The line of waiters of ``key`` (empty if there is none)."""
        return self.inspect_lines([line_name(self.prefix, validate_key(key))])[0]

    def inspect_lines(self, names: Sequence[str]) -> list[LineInfo]:
        """Read the lines at these Redis keys (see :func:`~dramatiq_leases.core.keys.line_name`), pipelined."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.zrange(name, 0, 0, withscores=True)
            pipe.zcard(name)
            pipe.hvals(name.replace(":line:", ":waiters:", 1))
        if not self._cluster:
            pipe.time()  # a cluster pipeline refuses commands without a key: asked on its own below
        with unavailable("read lines"):
            replies = pipe.execute()
            seconds, micros = self.client.time() if self._cluster else replies[-1]
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        out = []
        for i, name in enumerate(names):
            head, length, entries = replies[3 * i : 3 * i + 3]
            states: dict[str, int] = {}
            actors: dict[str, int] = {}
            for raw in entries:
                parts = text(raw).split(" ", 3)
                state = _STATES.get(parts[0], parts[0])
                states[state] = states.get(state, 0) + 1
                actor = parts[3] if len(parts) > 3 else ""
                actors[actor] = actors.get(actor, 0) + 1
            first = head[0] if head else (b"", 0)
            out.append(LineInfo(name, int(length), text(first[0]), int(first[1]), now_ms, states, actors))
        return out

    def scan_lines(self, *, count: int = 500) -> Iterator[LineInfo]:
        """Every line of waiters under this prefix, read in batches with ``SCAN``."""
        batch: list[str] = []
        with unavailable("scan lines"):
            for name in self._scan_names(line_pattern(self.prefix), count):
                if name.endswith("}"):  # not a waiter's wake list
                    batch.append(name)
                if len(batch) >= count:
                    yield from self.inspect_lines(batch)
                    batch = []
        if batch:
            yield from self.inspect_lines(batch)

    def fence_state(self, key: str) -> dict[str, int]:
        """The fence counter of ``key``: last ``fence`` granted, last ``released``, last ``expired``."""
        return self.fence_states([validate_key(key)])[0]

    def fence_states(self, keys: Sequence[str]) -> list[dict[str, int]]:
        """:meth:`fence_state` of many keys, pipelined."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(fence_name(self.prefix, key))
        with unavailable("read fence counters"):
            replies = pipe.execute()
        return [{name: int(v) for k, v in raw.items() if (name := text(k)) in _FENCE_FIELDS} for raw in replies]
