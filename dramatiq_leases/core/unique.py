"""Unique records: at most ``limit`` messages of a key queued (or queued and running) at once.

A record names its message by id and carries the server time at which it ends unless its message shows a
sign of life (sent, delivered, parked, retried: :meth:`UniqueRecords.keep`). Each decision (is the key
taken? is this record over?) is made in one script (``lua/unique.lua``) from facts no other process can
contradict later: the records' own end times, and the holders' hashes, which name the message they run.
A grant ends its message's "queued" record in the grant's own step (``lua/acquire.lua``), so there is no
instant in which neither the record nor the lease is held. Only a message's own id ends its record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from . import scripts
from .client import unavailable
from .errors import LeaseConfigError
from .keys import fence_name, lease_name, unique_name, validate_key
from .numbers import whole_limit, whole_ms

if TYPE_CHECKING:
    from .store import Leases

#: What a record waits for: ``"queued"`` ends when its message starts, ``"until_done"`` when it is done for good.
UNIQUE_MODES = ("queued", "until_done")

Mode = Literal["queued", "until_done"]

_MODE_CODES = {"queued": "q", "until_done": "d"}
_MODE_NAMES = {code: mode for mode, code in _MODE_CODES.items()}


@dataclass(frozen=True)
class UniqueRecord:
    """One message's unique record on a key."""

    #: The message it belongs to.
    message_id: str
    #: ``"queued"`` or ``"until_done"``.
    mode: str
    #: Server time (ms) at which it ends unless its message shows a sign of life or holds the key.
    ends_ms: int


class UniqueRecords:
    """The unique records of a lease store's keys.

    Parameters:
      leases: the store whose keys (and prefix, client, Cluster handling) the records live beside.
    """

    def __init__(self, leases: Leases) -> None:
        self.leases = leases
        self._script = leases.client.register_script(scripts.UNIQUE)

    def _run(self, what: str, key: str, args: list[str | int]) -> list[object]:
        validate_key(key)
        prefix = self.leases.prefix
        with unavailable(f"{what} the unique record of {key!r}", key):
            reply: list[object] = self.leases._call(
                self._script, [lease_name(prefix, key), fence_name(prefix, key)], args
            )
        return reply

    def take(self, key: str, message_id: str, *, mode: Mode, limit: int = 1, grace: int) -> str | None:
        """Take a record for ``message_id`` on ``key``; ``None`` if taken, else the id of a message holding one.

        ``mode``: ``"queued"`` refuses while ``limit`` messages of the key are queued (sent, not started);
        ``"until_done"`` while ``limit`` are queued or running. ``grace``: how long (ms) the record lives
        before :meth:`keep` confirms it (the broker has the message). Taking again a record the message
        already holds succeeds.

        Raises:
          LeaseConfigError: a bad ``mode``, ``limit`` or ``grace``.
          LeaseUnavailableError: Redis could not be asked (nothing is known: the caller must not send).
        """
        code = _MODE_CODES.get(mode)
        if code is None:
            raise LeaseConfigError(f"UniqueRecords.take: mode must be one of {UNIQUE_MODES}, got {mode!r}")
        limit = whole_limit(limit, "limit", maximum=scripts.MAX_LIMIT, owner="UniqueRecords.take")
        grace = whole_ms(grace, "grace", owner="UniqueRecords.take")
        reply = self._run("take", key, ["take", message_id, code, limit, grace])
        if reply[0] == 1:
            return None
        holder = reply[2]
        return holder.decode() if isinstance(holder, bytes) else str(holder)

    def keep(self, key: str, message_id: str, ms: int, *, retake: Mode | None = None, limit: int = 1) -> bool:
        """Push the end of ``message_id``'s record on ``key`` to ``ms`` from now (never earlier); ``False`` if
        it has none (ended, or never taken).

        ``retake``: a message with no record takes one of this mode again if the key has room under
        ``limit`` (a message re-driven from its dead letters, a retry of a started "queued" message: queued
        again), and is never refused.
        """
        ms = whole_ms(ms, "ms", owner="UniqueRecords.keep")
        code = "-" if retake is None else _MODE_CODES.get(retake)
        if code is None:
            raise LeaseConfigError(f"UniqueRecords.keep: retake must be None or one of {UNIQUE_MODES}, got {retake!r}")
        limit = whole_limit(limit, "limit", maximum=scripts.MAX_LIMIT, owner="UniqueRecords.keep")
        return self._run("keep", key, ["keep", message_id, code, limit, ms])[0] == 1

    def end(self, key: str, message_id: str) -> bool:
        """End ``message_id``'s record on ``key`` (its message is done for good); ``False`` if it had none."""
        return self._run("end", key, ["end", message_id, "-", 1, 1])[0] != 0

    def records(self, key: str) -> list[UniqueRecord]:
        """The records of ``key`` as stored, oldest end first (some may be over, not yet swept by a send)."""
        validate_key(key)
        with unavailable(f"read the unique records of {key!r}", key):
            rows: Any = self.leases.client.zrange(unique_name(self.leases.prefix, key), 0, -1, withscores=True)
        found = []
        for member, score in rows:
            text = member.decode() if isinstance(member, bytes) else str(member)
            code, _, message_id = text.partition(":")
            found.append(UniqueRecord(message_id, _MODE_NAMES.get(code, code), int(score)))
        return found
