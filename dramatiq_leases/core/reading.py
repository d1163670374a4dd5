"""Reading leases without changing them: inspect, scan, lines, fence counters (one round trip per master).

Each read reaches its keys through :class:`~.nodes.Nodes`, master by master on a Cluster. A read that is
given a :class:`~.nodes.ReadGaps` goes on past a master that does not answer and past a key of the wrong
type, and records them there: what the masters that answered hold is read, and the blind spots are named
rather than hiding everything.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.crc import key_slot

from . import cluster, scripts
from .client import RedisClient, unavailable
from .info import LeaseInfo, parse_info, text
from .keys import fence_name, lease_name, lease_pattern, line_name, line_pattern, rate_name, validate_key
from .nodes import NODE_ERRORS, Nodes, ReadGaps, wrong_type
from .numbers import whole_count
from .rates import RateState, rate_of_ring, ring_state

__all__ = ["LineInfo", "ReadGaps", "Reader", "Reads"]

#: The fence counter's fields a reader returns: the key's last fence granted, the legacy records of a key never
#: held by several at once, the width (how many slots may be held), and each slot's records (``g:<slot>`` last
#: granted, ``r:<slot>`` released, ``e:<slot>`` found expired).
_FENCE_FIELDS = frozenset({"fence", "released", "expired", "width"})
_SLOT_RECORD = re.compile(r"[gre]:\d{1,3}")
#: What follows a lease hash's tag: nothing (slot 0), or ``:<slot>``.
_SLOT_SUFFIX = re.compile(r":[1-9]\d{0,2}")


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
      rate_until_ms: until when the key is over its rate (server Unix ms; 0: not known to be): the later of the
        fence counter's ``rate_until`` (a grant the key's ``lock_rate`` refused) and ``hold_until`` (a hold its
        last holder put on it). Read with the line, in the same round trip.
    """

    name: str
    length: int
    head: str
    oldest_first_ms: int
    now_ms: int
    states: dict[str, int]
    actors: dict[str, int]
    rate_until_ms: int = 0

    @property
    def oldest_wait(self) -> float:
        """Seconds its oldest waiter has waited since its first attempt (0 if empty)."""
        return max(0.0, (self.now_ms - self.oldest_first_ms) / 1000) if self.oldest_first_ms else 0.0

    @property
    def next_start_ms(self) -> int:
        """Milliseconds until the key's rate allows its next start, when read (0: the rate holds nobody back)."""
        return max(0, self.rate_until_ms - self.now_ms)

    @property
    def waiting_for_rate(self) -> bool:
        """Whether its waiters wait for the key's rate (:attr:`next_start_ms` ahead), not for a holder."""
        return self.next_start_ms > 0


_STATES = {"p": "parked", "m": "promoted", "r": "in_place"}


class Reader:
    """The read side of a :class:`~dramatiq_leases.core.store.Leases` (its :attr:`~.store.Leases.reader`).

    Every read takes an optional ``gaps``: without it, a master that does not answer fails the read
    (:class:`LeaseUnavailableError`); with it, that master is recorded there and the read goes on with
    the others, failing only if none answered. Keys of the wrong type are always left out (lease keys
    excepted: see :meth:`inspect_names`), and recorded in ``gaps`` when given.
    """

    def __init__(self, client: RedisClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.nodes = Nodes(client)
        self._inspect_many = client.register_script(scripts.INSPECT_MANY)

    def node_name(self, name: str) -> str:
        """The Cluster master serving the Redis key ``name`` (``host:port``, from the slot map: no call);
        ``""`` on a single server."""
        return self.nodes.node_name(name)

    # Rates ------------------------------------------------------------------

    def rate_states(self, key: str) -> list[RateState]:
        """Where ``key`` stands against each rate it was granted under (``lock_rate``), from the rings kept for
        it (one per rate: ``{prefix}:rate:{tag}:N/W``), by the server's clock."""
        ring = rate_name(self.prefix, validate_key(key), 1, 1)
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", ring.rsplit(":", 1)[0]) + ":*"
        ((client, _),) = self.nodes.by_node([ring], None).values()
        with unavailable(f"read the rates of {key!r}", key):
            names = sorted(text(name) for name in client.scan_iter(match=pattern, count=100))
            pipe = client.pipeline(transaction=False)
            pipe.time()
            for name in names:
                pipe.get(name)
            replies = pipe.execute(raise_on_error=False)
        seconds, micros = replies[0]
        now_us = int(seconds) * 1_000_000 + int(micros)
        states = []
        for name, raw in zip(names, replies[1:]):
            rate = rate_of_ring(name)
            if rate is not None and isinstance(raw, bytes):
                states.append(ring_state(rate, raw, now_us))
        return states

    # Leases -----------------------------------------------------------------

    def inspect(self, key: str, *, slot: int = 0, gaps: ReadGaps | None = None) -> LeaseInfo | None:
        """What Redis holds for the lease on ``key`` in holder ``slot``, or ``None`` if there is none."""
        infos = self.inspect_names([lease_name(self.prefix, validate_key(key), slot)], gaps=gaps)
        return infos[0] if infos else None

    def holders(self, key: str, *, gaps: ReadGaps | None = None) -> list[LeaseInfo]:
        """Every holder of ``key``, by slot: slots 0 to the fence counter's ``width`` less one (slot 0 only for a
        key never held by several at once), read in one round trip after the counter's.

        A counter gone while slots were held (a ``fence_retention`` shorter than the hold) or behind the holders
        found (their ``limit`` is above its width) is made up for by the holders' own limit: the slots up to it
        are read too, in one more round trip.
        """
        key = validate_key(key)
        width = self.fence_states([key], gaps=gaps)[0].get("width", 1)
        width = max(1, min(width, scripts.MAX_LIMIT))
        found = self.inspect_names([lease_name(self.prefix, key, s) for s in range(width)], gaps=gaps)
        wider = min(max((info.limit for info in found), default=1), scripts.MAX_LIMIT)
        if wider > width:
            found += self.inspect_names([lease_name(self.prefix, key, s) for s in range(width, wider)], gaps=gaps)
        return sorted(found, key=lambda info: info.slot)

    def inspect_names(self, names: Sequence[str], *, gaps: ReadGaps | None = None) -> list[LeaseInfo]:
        """Read the lease hashes at these Redis keys (those that still exist), one round trip per slot.

        A key there that is not a hash is returned too (with no token: it blocks its lease key as a
        lease does, and ``release --if-dead`` ends it if it has no TTL), and recorded in ``gaps``.
        """
        out, asked = self._read_leases(names, gaps)
        self.nodes.none_answered(asked, gaps, "read leases")
        return out

    def _read_leases(self, names: Sequence[str], gaps: ReadGaps | None) -> tuple[list[LeaseInfo], set[str]]:
        """:meth:`inspect_names`, and the nodes asked, without failing when none of them answered (a scan
        judges that over all its masters)."""
        by_slot: dict[int, list[str]] = defaultdict(list)
        for name in names:
            if gaps is None or self.nodes.node_name(name) not in gaps.nodes:
                by_slot[key_slot(name.encode()) if self.nodes.cluster else 0].append(name)
        groups = list(by_slot.values())
        replies: list[Any]
        if not self.nodes.cluster:
            with unavailable("read leases"):
                replies = [self._inspect_many(keys=group, args=[]) for group in groups]
        else:
            # Node by node, one socket timeout for a master that hangs (cluster.run): a reply is None if its
            # master did not answer.
            try:
                replies = cluster.run(self.client, self._inspect_many, [(group, []) for group in groups])
            except NODE_ERRORS as e:
                for group in groups:
                    self.nodes.failed(gaps, self.nodes.node_name(group[0]), e, "read leases")
                replies = [None] * len(groups)
        out: list[LeaseInfo] = []
        not_hashes: dict[str, str] = {}
        for group, reply in zip(groups, replies):
            if reply is None:
                self.nodes.failed(gaps, self.nodes.node_name(group[0]), "did not answer", "read leases")
                continue
            now_ms = int(reply[0])
            for name, (pttl, flat) in zip(group, reply[1:]):
                if int(pttl) == -2:
                    continue
                if not flat:  # a hash always has a field: this key is of another type
                    not_hashes[name] = "lease"
                out.append(parse_info(name, int(pttl), flat, now_ms))
        self.nodes.unreadable(gaps, not_hashes)
        return out, {self.nodes.node_name(group[0]) for group in groups}

    def scan(self, match: str = "*", *, count: int = 500, gaps: ReadGaps | None = None) -> Iterator[LeaseInfo]:
        """Every lease whose key matches the glob ``match``, read in batches with ``SCAN`` (never ``KEYS``).

        With the default ``match``, also any other key under ``{prefix}:lease:``
        (a key someone wrote by hand, perhaps without TTL: the classic orphan).
        On a Cluster, master by master: with ``gaps``, those that do not answer are recorded there.
        """
        if match == "*":
            yield from self._scan(f"{self.prefix}:lease:*", count, gaps)
            return
        seen = set()
        # The tag's pattern, then any slot's suffix (a key held by several at once: {prefix}:lease:{tag}:s).
        for info in self._scan(lease_pattern(self.prefix, match) + "*", count, gaps, keep=self._is_lease):
            seen.add(info.redis_key)
            yield info
        # Keys with braces are stored under a digest (see hash_tag): match them here.
        for info in self._scan(lease_pattern(self.prefix, "h:*") + "*", count, gaps, keep=self._is_lease):
            if info.redis_key not in seen and fnmatch.fnmatchcase(info.key, match):
                yield info

    def _is_lease(self, name: str) -> bool:
        """Whether ``name`` is a lease hash's: ``{prefix}:lease:{tag}``, or slot ``s``'s ``{prefix}:lease:{tag}:s``."""
        start = f"{self.prefix}:lease:{{"
        tag, brace, tail = name[len(start) :].partition("}")
        return (
            name.startswith(start)
            and bool(brace)
            and "{" not in tag
            and (not tail or bool(_SLOT_SUFFIX.fullmatch(tail)))
        )

    def _scan(
        self, pattern: str, count: int, gaps: ReadGaps | None, keep: Callable[[str], bool] = lambda name: True
    ) -> Iterator[LeaseInfo]:
        for batch in self.nodes.scan_batches(pattern, count, gaps, keep):
            yield from self._read_leases(batch, gaps)[0]

    # Lines ------------------------------------------------------------------

    def inspect_line(self, key: str, *, gaps: ReadGaps | None = None) -> LineInfo:
        """The line of waiters of ``key`` (empty if there is none, or if it cannot be read: see ``gaps``)."""
        name = line_name(self.prefix, validate_key(key))
        lines = self.inspect_lines([name], gaps=gaps)
        return lines[0] if lines else LineInfo(name, 0, "", 0, 0, {}, {})

    def inspect_lines(self, names: Sequence[str], *, gaps: ReadGaps | None = None) -> list[LineInfo]:
        """Read the lines at these Redis keys (see :func:`~dramatiq_leases.core.keys.line_name`), pipelined.

        One per name, in order, but for those that could not be read: a line (or its waiters hash) of
        the wrong type, or (with ``gaps``) on a master that did not answer.
        """
        out, asked = self._read_lines(names, gaps)
        self.nodes.none_answered(asked, gaps, "read lines")
        return out

    def _read_lines(self, names: Sequence[str], gaps: ReadGaps | None) -> tuple[list[LineInfo], set[str]]:
        """:meth:`inspect_lines`, and the nodes asked, without failing when none of them answered."""

        def commands(pipe: Any, name: str) -> None:
            pipe.zrange(name, 0, 0, withscores=True)
            pipe.zcard(name)
            pipe.hvals(name.replace(":line:", ":waiters:", 1))
            # Whether the key is over its rate: two fields of its fence counter, in the same round trip.
            pipe.hmget(self._fence_of_line(name), "rate_until", "hold_until")

        replies, asked = self.nodes.pipelined(names, gaps, "read lines", commands, clock=True)
        out = []
        bad: dict[str, str] = {}
        for i, name in enumerate(names):
            if i not in replies:
                continue
            (head, length, entries, until), now_ms = replies[i]
            if wrong_type(head) or wrong_type(length):
                bad[name] = "line"
            if wrong_type(entries):
                bad[name.replace(":line:", ":waiters:", 1)] = "waiters"
            if wrong_type(until):  # a counter of another type says nothing of a rate: the line is still read
                bad[self._fence_of_line(name)] = "fence"
            replied = (head, length, entries, until)
            errors = [r for r in replied if isinstance(r, Exception) and not wrong_type(r)]
            if errors:  # an error of the node itself (a script killed, OOM...): it did not answer this
                self.nodes.failed(gaps, self.nodes.node_name(name), errors[0], "read lines")
                continue
            if any(wrong_type(r) for r in (head, length, entries)):
                continue
            out.append(_line_info(name, head, length, entries, now_ms, [] if wrong_type(until) else until))
        self.nodes.unreadable(gaps, bad)
        return out, asked

    def _fence_of_line(self, name: str) -> str:
        """The fence counter of the key whose line is ``name`` (``{prefix}:line:{tag}`` -> ``{prefix}:fence:{tag}``)."""
        return f"{self.prefix}:fence:{name[len(self.prefix) + len(':line:') :]}"

    def _is_line(self, name: str) -> bool:
        """Whether ``name`` is a line's: ``{prefix}:line:{tag}`` with a tag without braces (as every tag is), not
        a waiter's wake list (``{prefix}:line:{tag}:w:<waiter>``), which the scan pattern matches too when
        the waiter id ends with ``}``."""
        start = f"{self.prefix}:line:{{"
        tag = name[len(start) : -1]
        return name.startswith(start) and name.endswith("}") and "{" not in tag and "}" not in tag

    def scan_lines(self, *, count: int = 500, gaps: ReadGaps | None = None) -> Iterator[LineInfo]:
        """Every line of waiters under this prefix, read in batches with ``SCAN`` (on a Cluster, master by
        master: with ``gaps``, those that do not answer are recorded there)."""
        for batch in self.nodes.scan_batches(line_pattern(self.prefix), count, gaps, keep=self._is_line):
            yield from self._read_lines(batch, gaps)[0]

    # Fence counters ---------------------------------------------------------

    def fence_state(self, key: str, *, gaps: ReadGaps | None = None) -> dict[str, int]:
        """The fence counter of ``key``: last ``fence`` granted, last ``released``, last ``expired`` (a key never held
        by several at once); once it was, ``width`` (how many slots may be held) and each slot's records,
        ``g:<slot>`` last granted, ``r:<slot>`` last released, ``e:<slot>`` last found expired (see
        :attr:`LeaseInfo.per_slot`). Empty if there is none, or if it cannot be read: see ``gaps``."""
        return self.fence_states([validate_key(key)], gaps=gaps)[0]

    def fence_states(self, keys: Sequence[str], *, gaps: ReadGaps | None = None) -> list[dict[str, int]]:
        """:meth:`fence_state` of many keys, pipelined: one per key, in order, empty for a counter that is
        gone, of the wrong type, or (with ``gaps``) on a master that did not answer."""
        names = [fence_name(self.prefix, key) for key in keys]
        replies, asked = self.nodes.pipelined(names, gaps, "read fence counters", lambda pipe, name: pipe.hgetall(name))
        out: list[dict[str, int]] = []
        bad: dict[str, str] = {}
        for i, name in enumerate(names):
            raw = replies[i][0][0] if i in replies else {}
            if wrong_type(raw):
                bad[name] = "fence"
                raw = {}
            elif isinstance(raw, Exception):
                self.nodes.failed(gaps, self.nodes.node_name(name), raw, "read fence counters")
                raw = {}
            state = {}
            for k, v in raw.items():
                if (field_name := text(k)) in _FENCE_FIELDS or _SLOT_RECORD.fullmatch(field_name):
                    with contextlib.suppress(ValueError):  # a field written by hand is not a number
                        state[field_name] = int(v)
            if state.get("released") == 0:  # a counter's first grant writes it (lua/acquire.lua): none yet
                del state["released"]
            out.append(state)
        self.nodes.unreadable(gaps, bad)
        self.nodes.none_answered(asked, gaps, "read fence counters")
        return out


class Reads:
    """The reads of a :class:`~.store.Leases` (one of its base classes), through its :class:`Reader`."""

    def __init__(self, reader: Reader) -> None:
        self._reader = reader

    @property
    def reader(self) -> Reader:
        """The read side of this store: for the package's integrations (the exporter), not a user API."""
        return self._reader

    def inspect(self, key: str, *, slot: int = 0, gaps: ReadGaps | None = None) -> LeaseInfo | None:
        """What Redis holds for the lease on ``key`` in holder ``slot`` (0: the only one of a key of one holder),
        or ``None`` if there is none; :meth:`holders` reads every holder of a key held by several at once.

        ``gaps`` (every read takes one): without it, a Cluster master that does not answer fails the read
        (:class:`LeaseUnavailableError`); with it, that master is recorded there and the read goes on.
        """
        return self._reader.inspect(key, slot=whole_count(slot, "slot", maximum=scripts.MAX_LIMIT - 1), gaps=gaps)

    def holders(self, key: str, *, gaps: ReadGaps | None = None) -> list[LeaseInfo]:
        """Every holder of ``key``, ordered by slot (empty if nobody holds it): one for a key of one holder, up to
        its limit for one held by several at once (``limit``). Two round trips: the fence counter, which says
        how many slots may be held (its ``width``), then those slots."""
        return self._reader.holders(key, gaps=gaps)

    def scan(self, match: str = "*", *, count: int = 500, gaps: ReadGaps | None = None) -> Iterator[LeaseInfo]:
        """Every lease whose key matches the glob ``match``, read in batches with ``SCAN`` (never ``KEYS``): each
        holder of a key held by several at once is one (its :attr:`LeaseInfo.slot` says which); with the
        default ``match``, also any other key under the prefix's lease keys (a hand-written orphan)."""
        return self._reader.scan(match, count=count, gaps=gaps)

    def inspect_line(self, key: str, *, gaps: ReadGaps | None = None) -> LineInfo:
        """The line of waiters of ``key`` (empty if there is none)."""
        return self._reader.inspect_line(key, gaps=gaps)

    def scan_lines(self, *, count: int = 500, gaps: ReadGaps | None = None) -> Iterator[LineInfo]:
        """Every line of waiters under this prefix, read in batches with ``SCAN``."""
        return self._reader.scan_lines(count=count, gaps=gaps)

    def fence_state(self, key: str, *, gaps: ReadGaps | None = None) -> dict[str, int]:
        """The fence counter of ``key``: last ``fence`` granted, last ``released``, last ``expired``; for a key
        held by several at once, also ``width`` and each slot's ``g:<slot>`` (last granted), ``r:<slot>``
        (released) and ``e:<slot>`` (found expired): see :attr:`LeaseInfo.per_slot`. Empty if there is none."""
        return self._reader.fence_state(key, gaps=gaps)

    def rate_states(self, key: str) -> list[RateState]:
        """Where ``key`` stands against each of its rates (``lock_rate``): grants in the last window, and how long
        until one more is allowed; empty for a key granted under none (see :mod:`.rates`)."""
        return self._reader.rate_states(key)

    def fence_states(self, keys: Sequence[str], *, gaps: ReadGaps | None = None) -> list[dict[str, int]]:
        """:meth:`fence_state` of many keys in one round trip per master, in order."""
        return self._reader.fence_states(keys, gaps=gaps)


def _server_ms(raw: Any) -> int:
    """A time field of a fence counter (whole server ms, as the scripts write it), 0 if absent or not a number."""
    if raw is None:
        return 0
    try:
        return max(0, int(float(text(raw))))
    except (ValueError, OverflowError):  # written by hand
        return 0


def _line_info(name: str, head: Any, length: Any, entries: Any, now_ms: int, until: Sequence[Any]) -> LineInfo:
    states: dict[str, int] = {}
    actors: dict[str, int] = {}
    for raw in entries:
        entry = text(raw)
        if entry.startswith("L "):  # the pointer to the key's latest waiter (lock_on_busy="latest"), not a waiter
            continue
        parts = entry.split(" ", 3)
        state = _STATES.get(parts[0], parts[0])
        states[state] = states.get(state, 0) + 1
        actor = parts[3] if len(parts) > 3 else ""
        actors[actor] = actors.get(actor, 0) + 1
    first = head[0] if head else (b"", 0)
    rate_until_ms = max((_server_ms(raw) for raw in until), default=0)
    return LineInfo(name, int(length), text(first[0]), int(first[1]), now_ms, states, actors, rate_until_ms)
