"""Reading many Redis keys node by node: the masters of a Cluster each on a connection of their own.

On a Redis Cluster each master is read on a connection of its own, without redis-py's cluster retries,
so a master that hangs costs one socket timeout, not a read of the whole cluster (redis-py's client
retried and read the slot map again for 22 s). A read that is given a :class:`ReadGaps` goes on past
a master that does not answer and past a key of the wrong type, and records them there. :class:`Nodes`
is the reader's (:mod:`.reading`) way to its keys: which master serves a name, pipelines per master, slots
being moved (``ASK``, ``MOVED``), ``SCAN`` master by master.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from .client import RedisClient
from .errors import LeaseUnavailableError
from .info import NOT_UTF8, UnreadableKey, text

#: Errors of a node that did not answer (or of a slot no node serves).
NODE_ERRORS = (redis.RedisError, RedisClusterException)

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


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def wrong_type(reply: Any) -> bool:
    """A reply saying the key is of another type than the command reads."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")


def _redirected(reply: Any) -> bool:
    """A reply saying the key's slot is served elsewhere now (a migration since the slot map was read)."""
    return isinstance(reply, (redis.exceptions.AskError, redis.exceptions.TryAgainError))  # MOVED: an AskError


class Nodes:
    """The nodes a read asks (for the reader, not a user API): the one server, or each master of a Cluster.

    Every method that takes ``gaps`` records there a master that does not answer and goes on (failing only
    when none answered); without it, such a master fails the read (:class:`LeaseUnavailableError`).
    """

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        #: Whether the client is a Redis Cluster's.
        self.cluster = isinstance(client, RedisCluster)

    def node_name(self, name: str) -> str:
        """The Cluster master serving the Redis key ``name`` (``host:port``, from the slot map: no call);
        ``""`` on a single server."""
        if not self.cluster:
            return ""
        client: Any = self.client
        try:
            return str(client.get_node_from_key(name).name)
        except NODE_ERRORS:
            return f"slot {key_slot(name.encode())}"  # no master serves it: a gap of its own

    def masters(self, gaps: ReadGaps | None) -> list[tuple[str, Any]]:
        """``(name, client)`` of each node to read: the masters of a Cluster (each on its own connection,
        without retries) but those already known not to answer; or the one client."""
        if not self.cluster:
            return [("", self.client)]
        client: Any = self.client
        return [
            (node.name, client.get_redis_connection(node))
            for node in client.get_primaries()
            if gaps is None or node.name not in gaps.nodes
        ]

    def by_node(self, names: Sequence[str], gaps: ReadGaps | None) -> dict[str, tuple[Any, list[int]]]:
        """The positions of ``names`` by the node serving them, with its client; names of nodes already
        known not to answer are left out."""
        if not self.cluster:
            return {"": (self.client, list(range(len(names))))}
        client: Any = self.client
        out: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            try:
                node = client.get_node_from_key(name)
            except NODE_ERRORS as e:
                # The slot, not the name: a name holds its lease key, which a masked exporter must not show.
                self.failed(gaps, self.node_name(name), e, f"find the master of slot {key_slot(name.encode())}")
                continue
            if gaps is not None and node.name in gaps.nodes:
                continue
            if node.name not in out:
                out[node.name] = (client.get_redis_connection(node), [])
            out[node.name][1].append(i)
        return out

    def failed(self, gaps: ReadGaps | None, node: str, error: BaseException | str, what: str) -> None:
        """Record that ``node`` did not answer (``error``: why), or (no ``gaps``, or a single server) raise."""
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if gaps is None or not self.cluster:
            where = f" (master {node})" if node else ""
            raise LeaseUnavailableError(f"could not {what}{where}: {why}") from (
                None if isinstance(error, str) else error
            )
        gaps.nodes.setdefault(node, why)

    def none_answered(self, asked: Iterable[str], gaps: ReadGaps | None, what: str) -> None:
        """Raise if every node asked failed (``gaps`` says which): then nothing was read at all."""
        asked = list(asked)
        if gaps is not None and asked and all(node in gaps.nodes for node in asked):
            why = "; ".join(f"{node}: {gaps.nodes[node]}" for node in asked)
            raise LeaseUnavailableError(f"could not {what}: no master answered ({why})")

    def refresh(self) -> None:
        """Read the slot map again after a master failed (a replica may have replaced it); keep the old one if
        no node answers."""
        with contextlib.suppress(*NODE_ERRORS):
            self.client.nodes_manager.initialize()  # type: ignore[union-attr]

    def _key_types(self, names: Sequence[str]) -> dict[str, str]:
        """The Redis type of each of ``names`` (at most :data:`_TYPES_ASKED`), asked of its node; ``""`` where
        it could not be asked."""
        out = dict.fromkeys(names, "")
        gaps = ReadGaps()  # a master that does not answer now just leaves its keys' types unsaid
        for client, positions in self.by_node(names[:_TYPES_ASKED], gaps).values():
            pipe = client.pipeline(transaction=False)
            for i in positions:
                pipe.type(names[i])
            with contextlib.suppress(*NODE_ERRORS):
                for i, kind in zip(positions, pipe.execute(raise_on_error=False)):
                    if not isinstance(kind, Exception):
                        out[names[i]] = text(kind)
        return out

    def unreadable(self, gaps: ReadGaps | None, found: dict[str, str]) -> None:
        """Record the keys ``found`` of the wrong type (name -> the kind its name says), with their types."""
        if gaps is None or not found:
            return
        types = self._key_types(list(found))
        for name, kind in found.items():
            gaps.keys[name] = UnreadableKey(name, kind, types.get(name, ""))

    def pipelined(
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
        connection. A name whose node did not answer is left out (:meth:`failed`). One whose slot is moving
        goes again once: answered ``ASK``, to the importing master with ``ASKING``; ``MOVED``, to its new
        master once the slot map is read again."""
        read = _Read(gaps, what, commands, clock)
        out: dict[int, tuple[list[Any], int]] = {}
        groups = self.by_node(names, gaps)
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
                    self.failed(gaps, node, redirect, what)
        for target, (client, positions) in again.items():
            asked.add(target)
            if client is None:
                self.failed(gaps, target, "not in the slot map", what)
                continue
            out.update(self._settled(read, target, client, positions, names, asking=True))
        if moved:
            self.refresh()
            for node, (client, positions) in self.by_node([names[i] for i in moved], gaps).items():
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
                self.failed(read.gaps, node, redirect, read.what)
            else:
                out[i] = reply
        return out

    def _send(
        self, read: _Read, node: str, client: Any, positions: list[int], names: Sequence[str], *, asking: bool
    ) -> dict[int, tuple[list[Any], int]]:
        """The replies of ``names[i]``'s commands for each of ``positions``, on one pipeline of ``client``
        (``asking``: each name's commands after ``ASKING``), with that node's clock if ``read.clock``; ``{}``
        if the node did not answer (:meth:`failed`)."""
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
        except NODE_ERRORS as e:
            self.failed(read.gaps, node, e, read.what)
            return {}
        out = {}
        start = 0
        for i, n in zip(positions, counts):
            mine = list(replies[start : start + n])
            out[i] = (mine[1::2] if asking else mine, now_ms)  # without ASKING's OKs
            start += n
        return out

    def scan_batches(
        self, pattern: str, count: int, gaps: ReadGaps | None, keep: Callable[[str], bool] = lambda name: True
    ) -> Iterator[list[str]]:
        """The Redis keys matching ``pattern`` that ``keep`` keeps, by ``SCAN`` of each master in turn (each
        key once), in batches of at most ``count``, each of one master."""
        masters = self.masters(gaps)
        if not masters:  # every master already failed this read
            self.none_answered(gaps.nodes if gaps else [], gaps, "scan keys")
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
                    if not keep(name) or (self.cluster and name in seen):
                        continue
                    if self.cluster:
                        seen.add(name)
                    batch.append(name)
                    if len(batch) >= count:
                        yield batch
                        batch = []
            except NODE_ERRORS as e:
                self.failed(gaps, node, e, f"scan {pattern!r}")
                failed = True
            if batch:
                yield batch
        if failed:
            self.refresh()
        self.none_answered([node for node, _ in masters], gaps, f"scan {pattern!r}")


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
