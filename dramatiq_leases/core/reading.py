"""Reading leases without changing them: inspect, scan, lines, fence counters (one round trip per master).

On a Redis Cluster each master is read on a connection of its own, without redis-py's cluster retries,
so a master that hangs costs one socket timeout, not a read of the whole cluster (redis-py's client
retried and read the slot map again for 22 s). A read that is given a :class:`ReadGaps` goes on past
a master that does not answer and past a key of the wrong type, and records them there: what the
masters that answered hold is read, and the blind spots are named rather than hiding everything.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from . import cluster, scripts
from .client import RedisClient, unavailable
from .errors import LeaseUnavailableError
from .info import NOT_UTF8, LeaseInfo, UnreadableKey, parse_info, text
from .keys import fence_name, lease_name, lease_pattern, line_name, line_pattern, validate_key

#: The fence counter's fields a reader returns: the key's last fence granted, the legacy records of a key never
#: held by several at once, the width (how many slots may be held), and each slot's records (``g:<slot>`` last
#: granted, ``r:<slot>`` released, ``e:<slot>`` found expired).
_FENCE_FIELDS = frozenset({"fence", "released", "expired", "width"})
_SLOT_RECORD = re.compile(r"[gre]:\d{1,3}")
#: What follows a lease hash's tag: nothing (slot 0), or ``:<slot>``.
_SLOT_SUFFIX = re.compile(r":[1-9]\d{0,2}")

#: Errors of a node that did not answer (or of a slot no node serves).
_NODE_ERRORS = (redis.RedisError, RedisClusterException)

#: How many keys of the wrong type one read asks the type of (to say what they are); the rest are named only.
_TYPES_ASKED = 100


@dataclass(frozen=True)
class _Read:
    """One pipelined read's constants: where its blind spots go, what it is (for errors), the commands per
    name, and whether it asks each node's clock."""

    gaps: ReadGaps | None
    what: str
    commands: Callable[[Any, str], None]
    clock: bool


@dataclass
class ReadGaps:
    """What a read could not see, for a caller that wants what could be read rather than an error.

    Attributes:
      nodes: each Redis Cluster master that did not answer (``host:port``), with its error. (A single
        server, or every master, not answering fails the read instead: there is nothing to report.)
      keys: each Redis key found of the wrong type (by name), which the read left out.
    """

    nodes: dict[str, str] = field(default_factory=dict)
    keys: dict[str, UnreadableKey] = field(default_factory=dict)


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


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def _wrong_type(reply: Any) -> bool:
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")


def _redirected(reply: Any) -> bool:
    """A reply saying the key's slot is served elsewhere now (a migration since the slot map was read)."""
    return isinstance(reply, (redis.exceptions.AskError, redis.exceptions.TryAgainError))  # MOVED: an AskError


class Reader:
    """The read side of a :class:`~dramatiq_leases.core.store.Leases` (its ``_reader`` part).

    Every read takes an optional ``gaps``: without it, a master that does not answer fails the read
    (:class:`LeaseUnavailableError`); with it, that master is recorded there and the read goes on with
    the others, failing only if none answered. Keys of the wrong type are always left out (lease keys
    excepted: see :meth:`inspect_names`), and recorded in ``gaps`` when given.
    """

    def __init__(self, client: RedisClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._cluster = isinstance(client, RedisCluster)
        self._inspect_many = client.register_script(scripts.INSPECT_MANY)

    # Nodes ------------------------------------------------------------------

    def node_name(self, name: str) -> str:
        """The Cluster master serving the Redis key ``name`` (``host:port``, from the slot map: no call);
        ``""`` on a single server."""
        if not self._cluster:
            return ""
        client: Any = self.client
        try:
            return str(client.get_node_from_key(name).name)
        except _NODE_ERRORS:
            return f"slot {key_slot(name.encode())}"  # no master serves it: a gap of its own

    def _masters(self, gaps: ReadGaps | None) -> list[tuple[str, Any]]:
        """``(name, client)`` of each node to read: the masters of a Cluster (each on its own connection,
        without retries) but those already known not to answer; or the one client."""
        if not self._cluster:
            return [("", self.client)]
        client: Any = self.client
        return [
            (node.name, client.get_redis_connection(node))
            for node in client.get_primaries()
            if gaps is None or node.name not in gaps.nodes
        ]

    def _by_node(self, names: Sequence[str], gaps: ReadGaps | None) -> dict[str, tuple[Any, list[int]]]:
        """The positions of ``names`` by the node serving them, with its client; names of nodes already
        known not to answer are left out."""
        if not self._cluster:
            return {"": (self.client, list(range(len(names))))}
        client: Any = self.client
        out: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            try:
                node = client.get_node_from_key(name)
            except _NODE_ERRORS as e:
                # The slot, not the name: a name holds its lease key, which a masked exporter must not show.
                self._failed(gaps, self.node_name(name), e, f"find the master of slot {key_slot(name.encode())}")
                continue
            if gaps is not None and node.name in gaps.nodes:
                continue
            if node.name not in out:
                out[node.name] = (client.get_redis_connection(node), [])
            out[node.name][1].append(i)
        return out

    def _failed(self, gaps: ReadGaps | None, node: str, error: BaseException | str, what: str) -> None:
        """Record that ``node`` did not answer (``error``: why), or (no ``gaps``, or a single server) raise."""
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if gaps is None or not self._cluster:
            where = f" (master {node})" if node else ""
            raise LeaseUnavailableError(f"could not {what}{where}: {why}") from (
                None if isinstance(error, str) else error
            )
        gaps.nodes.setdefault(node, why)

    def _none_answered(self, asked: Iterable[str], gaps: ReadGaps | None, what: str) -> None:
        """Raise if every node asked failed (``gaps`` says which): then nothing was read at all."""
        asked = list(asked)
        if gaps is not None and asked and all(node in gaps.nodes for node in asked):
            why = "; ".join(f"{node}: {gaps.nodes[node]}" for node in asked)
            raise LeaseUnavailableError(f"could not {what}: no master answered ({why})")

    def _refresh(self) -> None:
        """Read the slot map again after a master failed (a replica may have replaced it); keep the old one if
        no node answers."""
        with contextlib.suppress(*_NODE_ERRORS):
            self.client.nodes_manager.initialize()  # type: ignore[union-attr]

    def _key_types(self, names: Sequence[str]) -> dict[str, str]:
        """The Redis type of each of ``names`` (at most :data:`_TYPES_ASKED`), asked of its node; ``""`` where
        it could not be asked."""
        out = dict.fromkeys(names, "")
        gaps = ReadGaps()  # a master that does not answer now just leaves its keys' types unsaid
        for client, positions in self._by_node(names[:_TYPES_ASKED], gaps).values():
            pipe = client.pipeline(transaction=False)
            for i in positions:
                pipe.type(names[i])
            with contextlib.suppress(*_NODE_ERRORS):
                for i, kind in zip(positions, pipe.execute(raise_on_error=False)):
                    if not isinstance(kind, Exception):
                        out[names[i]] = text(kind)
        return out

    def _unreadable(self, gaps: ReadGaps | None, found: dict[str, str]) -> None:
        """Record the keys ``found`` of the wrong type (name -> the kind its name says), with their types."""
        if gaps is None or not found:
            return
        types = self._key_types(list(found))
        for name, kind in found.items():
            gaps.keys[name] = UnreadableKey(name, kind, types.get(name, ""))

    def _pipelined(
        self,
        names: Sequence[str],
        gaps: ReadGaps | None,
        what: str,
        commands: Callable[[Any, str], None],
        *,
        clock: bool = False,
    ) -> tuple[dict[int, tuple[list[Any], int]], set[str]]:
        """The replies of ``commands(pipe, name)`` for each of ``names``, by position, with the server clock in
        ms if ``clock`` (else 0), and the nodes asked: each node's names on one pipeline of that node's
        connection. A name whose node did not answer is left out (:meth:`_failed`). One whose slot is moving
        goes again once: answered ``ASK``, to the importing master with ``ASKING``; ``MOVED``, to its new
        master once the slot map is read again."""
        read = _Read(gaps, what, commands, clock)
        out: dict[int, tuple[list[Any], int]] = {}
        groups = self._by_node(names, gaps)
        asked = set(groups)
        moved: list[int] = []
        again: dict[str, tuple[Any, list[int]]] = {}
        for node, (client, positions) in groups.items():
            for i, reply in self._send(read, node, client, positions, names, asking=False).items():
                redirect = next((r for r in reply[0] if _redirected(r)), None)
                if redirect is None:
                    out[i] = reply
                elif isinstance(redirect, redis.exceptions.MovedError):
                    moved.append(i)
                elif isinstance(redirect, redis.exceptions.AskError):
                    target = f"{redirect.host}:{redirect.port}"
                    if target not in again:
                        again[target] = (self._node_client(redirect.host, redirect.port), [])
                    again[target][1].append(i)
                else:
                    self._failed(gaps, node, redirect, what)
        for target, (client, positions) in again.items():
            asked.add(target)
            if client is None:
                self._failed(gaps, target, "not in the slot map", what)
                continue
            out.update(self._settled(read, target, client, positions, names, asking=True))
        if moved:
            self._refresh()
            for node, (client, positions) in self._by_node([names[i] for i in moved], gaps).items():
                asked.add(node)
                again_names = [names[moved[j]] for j in positions]
                replies = self._settled(read, node, client, list(range(len(positions))), again_names, asking=False)
                out.update({moved[positions[j]]: reply for j, reply in replies.items()})
        return out, asked

    def _node_client(self, host: str, port: int) -> Any:
        """The client of the Cluster node at ``host:port`` (its own connection), or ``None`` if the map lacks it."""
        client: Any = self.client
        node = client.get_node(host=host, port=port)
        return None if node is None else client.get_redis_connection(node)

    def _settled(
        self, read: _Read, node: str, client: Any, positions: list[int], names: Sequence[str], *, asking: bool
    ) -> dict[int, tuple[list[Any], int]]:
        """:meth:`_send`, for names sent again: one still redirected (its slot still moving) fails as its node's."""
        out = {}
        for i, reply in self._send(read, node, client, positions, names, asking=asking).items():
            redirect = next((r for r in reply[0] if _redirected(r)), None)
            if redirect is not None:
                self._failed(read.gaps, node, redirect, read.what)
            else:
                out[i] = reply
        return out

    def _send(
        self, read: _Read, node: str, client: Any, positions: list[int], names: Sequence[str], *, asking: bool
    ) -> dict[int, tuple[list[Any], int]]:
        """The replies of ``names[i]``'s commands for each of ``positions``, on one pipeline of ``client``
        (``asking``: each name's commands after ``ASKING``), with that node's clock if ``read.clock``; ``{}``
        if the node did not answer (:meth:`_failed`)."""
        commands, clock = read.commands, read.clock
        pipe = client.pipeline(transaction=False)
        staged = _Asking(pipe) if asking else pipe
        counts = []
        for i in positions:
            before = len(pipe)
            commands(staged, names[i])
            counts.append(len(pipe) - before)
        if clock:
            pipe.time()
        try:
            replies = pipe.execute(raise_on_error=False)
            now_ms = 0
            if clock:
                if isinstance(replies[-1], Exception):
                    raise replies[-1]
                seconds, micros = replies[-1]
                now_ms = int(seconds) * 1000 + int(micros) // 1000
        except _NODE_ERRORS as e:
            self._failed(read.gaps, node, e, read.what)
            return {}
        out = {}
        start = 0
        for i, n in zip(positions, counts):
            mine = list(replies[start : start + n])
            out[i] = (mine[1::2] if asking else mine, now_ms)  # without ASKING's OKs
            start += n
        return out

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
        self._none_answered(asked, gaps, "read leases")
        return out

    def _read_leases(self, names: Sequence[str], gaps: ReadGaps | None) -> tuple[list[LeaseInfo], set[str]]:
        """:meth:`inspect_names`, and the nodes asked, without failing when none of them answered (a scan
        judges that over all its masters)."""
        by_slot: dict[int, list[str]] = defaultdict(list)
        for name in names:
            if gaps is None or self.node_name(name) not in gaps.nodes:
                by_slot[key_slot(name.encode()) if self._cluster else 0].append(name)
        groups = list(by_slot.values())
        replies: list[Any]
        if not self._cluster:
            with unavailable("read leases"):
                replies = [self._inspect_many(keys=group, args=[]) for group in groups]
        else:
            # Node by node, one socket timeout for a master that hangs (cluster.run): a reply is None if its
            # master did not answer.
            try:
                replies = cluster.run(self.client, self._inspect_many, [(group, []) for group in groups])
            except _NODE_ERRORS as e:
                for group in groups:
                    self._failed(gaps, self.node_name(group[0]), e, "read leases")
                replies = [None] * len(groups)
        out: list[LeaseInfo] = []
        not_hashes: dict[str, str] = {}
        for group, reply in zip(groups, replies):
            if reply is None:
                self._failed(gaps, self.node_name(group[0]), "did not answer", "read leases")
                continue
            now_ms = int(reply[0])
            for name, (pttl, flat) in zip(group, reply[1:]):
                if int(pttl) == -2:
                    continue
                if not flat:  # a hash always has a field: this key is of another type
                    not_hashes[name] = "lease"
                out.append(parse_info(name, int(pttl), flat, now_ms))
        self._unreadable(gaps, not_hashes)
        return out, {self.node_name(group[0]) for group in groups}

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

    def _scan_batches(
        self, pattern: str, count: int, gaps: ReadGaps | None, keep: Callable[[str], bool] = lambda name: True
    ) -> Iterator[list[str]]:
        """The Redis keys matching ``pattern`` that ``keep`` keeps, by ``SCAN`` of each master in turn (each
        key once), in batches of at most ``count``, each of one master."""
        masters = self._masters(gaps)
        if not masters:  # every master already failed this read
            self._none_answered(gaps.nodes if gaps else [], gaps, "scan keys")
        seen: set[str] = set()  # a key moved to a master scanned later (a slot migration) is listed twice
        failed = False
        for node, client in masters:
            batch: list[str] = []
            try:
                for raw in client.scan_iter(match=pattern, count=count):
                    name = text(raw)
                    if isinstance(raw, bytes) and not _utf8(raw):
                        # Written by hand: no str names it for redis-py to ask again. A blind spot, said.
                        if gaps is not None:
                            kind = "line" if ":line:" in pattern else "lease"
                            gaps.keys[name] = UnreadableKey(name, kind, NOT_UTF8)
                        continue
                    if not keep(name) or (self._cluster and name in seen):
                        continue
                    if self._cluster:
                        seen.add(name)
                    batch.append(name)
                    if len(batch) >= count:
                        yield batch
                        batch = []
            except _NODE_ERRORS as e:
                self._failed(gaps, node, e, f"scan {pattern!r}")
                failed = True
            if batch:
                yield batch
        if failed:
            self._refresh()
        self._none_answered([node for node, _ in masters], gaps, f"scan {pattern!r}")

    def _scan(
        self, pattern: str, count: int, gaps: ReadGaps | None, keep: Callable[[str], bool] = lambda name: True
    ) -> Iterator[LeaseInfo]:
        for batch in self._scan_batches(pattern, count, gaps, keep):
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
        self._none_answered(asked, gaps, "read lines")
        return out

    def _read_lines(self, names: Sequence[str], gaps: ReadGaps | None) -> tuple[list[LineInfo], set[str]]:
        """:meth:`inspect_lines`, and the nodes asked, without failing when none of them answered."""

        def commands(pipe: Any, name: str) -> None:
            pipe.zrange(name, 0, 0, withscores=True)
            pipe.zcard(name)
            pipe.hvals(name.replace(":line:", ":waiters:", 1))

        replies, asked = self._pipelined(names, gaps, "read lines", commands, clock=True)
        out = []
        bad: dict[str, str] = {}
        for i, name in enumerate(names):
            if i not in replies:
                continue
            (head, length, entries), now_ms = replies[i]
            if _wrong_type(head) or _wrong_type(length):
                bad[name] = "line"
            if _wrong_type(entries):
                bad[name.replace(":line:", ":waiters:", 1)] = "waiters"
            errors = [r for r in (head, length, entries) if isinstance(r, Exception) and not _wrong_type(r)]
            if errors:  # an error of the node itself (a script killed, OOM...): it did not answer this
                self._failed(gaps, self.node_name(name), errors[0], "read lines")
                continue
            if any(_wrong_type(r) for r in (head, length, entries)):
                continue
            out.append(_line_info(name, head, length, entries, now_ms))
        self._unreadable(gaps, bad)
        return out, asked

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
        for batch in self._scan_batches(line_pattern(self.prefix), count, gaps, keep=self._is_line):
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
        replies, asked = self._pipelined(names, gaps, "read fence counters", lambda pipe, name: pipe.hgetall(name))
        out: list[dict[str, int]] = []
        bad: dict[str, str] = {}
        for i, name in enumerate(names):
            raw = replies[i][0][0] if i in replies else {}
            if _wrong_type(raw):
                bad[name] = "fence"
                raw = {}
            elif isinstance(raw, Exception):
                self._failed(gaps, self.node_name(name), raw, "read fence counters")
                raw = {}
            state = {}
            for k, v in raw.items():
                if (field_name := text(k)) in _FENCE_FIELDS or _SLOT_RECORD.fullmatch(field_name):
                    with contextlib.suppress(ValueError):  # a field written by hand is not a number
                        state[field_name] = int(v)
            out.append(state)
        self._unreadable(gaps, bad)
        self._none_answered(asked, gaps, "read fence counters")
        return out


class _Asking:
    """A pipeline whose every command is sent after ``ASKING`` (which lets one command through a slot being
    imported: a name answered ``ASK`` is read at the importing master)."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._pipe, name)

        def asking(*args: Any, **kwargs: Any) -> Any:
            self._pipe.execute_command("ASKING")
            return method(*args, **kwargs)

        return asking


def _line_info(name: str, head: Any, length: Any, entries: Any, now_ms: int) -> LineInfo:
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
    return LineInfo(name, int(length), text(first[0]), int(first[1]), now_ms, states, actors)
