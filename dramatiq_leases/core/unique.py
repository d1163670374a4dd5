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
from typing import Any, Literal, Protocol

from . import scripts
from .client import unavailable
from .errors import LeaseConfigError
from .keys import fence_name, history_name, lease_name, slot_names, unique_name, validate_key
from .numbers import whole_limit, whole_ms
from .runner import ScriptRunner

#: What a record waits for: ``"queued"`` ends when its message starts, ``"until_done"`` when it is done for good.
UNIQUE_MODES = ("queued", "until_done")

Mode = Literal["queued", "until_done"]

#: Each mode's code in the records (and in the mark a sent message carries).
MODE_CODES = {"queued": "q", "until_done": "d"}
_MODE_NAMES = {code: mode for mode, code in MODE_CODES.items()}


@dataclass(frozen=True)
class UniqueRecord:
    """One message's unique record on a key."""

    #: The message it belongs to.
    message_id: str
    #: ``"queued"`` or ``"until_done"``.
    mode: str
    #: Server time (ms) at which it ends unless its message shows a sign of life or holds the key.
    ends_ms: int
    #: The newest attempt of its message (Dramatiq's ``retries``) it was taken or kept for.
    attempt: int = 0


class Store(Protocol):
    """What the records take from their :class:`~.store.Leases`: its prefix, history cap and script runner."""

    @property
    def prefix(self) -> str: ...

    @property
    def history_cap(self) -> int: ...

    @property
    def runner(self) -> ScriptRunner: ...


class UniqueRecords:
    """The unique records of a lease store's keys.

    Parameters:
      leases: the store whose keys (and prefix, client, Cluster handling) the records live beside.
    """

    def __init__(self, leases: Store) -> None:
        self.leases = leases
        self.runner = leases.runner
        self._script = self.runner.register(scripts.UNIQUE)

    def _run(self, what: str, key: str, args: list[str | int]) -> list[object]:
        validate_key(key)
        prefix = self.leases.prefix
        fixed = [lease_name(prefix, key), fence_name(prefix, key), unique_name(prefix, key), history_name(prefix, key)]
        with unavailable(f"{what} the unique record of {key!r}", key):
            # As many slots as its limit reads (args[3]; 1 for 'end', which reads none), or the key's width.
            reply, _ = self.runner.call_slots(
                key,
                self._script,
                lambda width: ([*fixed, *slot_names(prefix, key, max(width, int(args[3])))], args),
            )
        return list(reply)

    def take(
        self, key: str, message_id: str, *, mode: Mode, limit: int = 1, grace: int, attempt: int = 0, actor: str = ""
    ) -> str | None:
        """Take a record for ``message_id`` on ``key``; ``None`` if taken, else the id of a message holding one.

        ``mode``: ``"queued"`` refuses while ``limit`` messages of the key are queued (sent, not started);
        ``"until_done"`` while ``limit`` are queued or running. ``grace``: how long (ms) the record lives
        before :meth:`keep` confirms it (the broker has the message). ``attempt``: the message's retry count.
        Taking again a record the message already holds succeeds. A refusal is a ``duplicate`` event of the
        key's history (reason ``unique``, by the holder's message id; ``actor``: the refused message's).

        Raises:
          LeaseConfigError: a bad ``mode``, ``limit``, ``grace`` or ``attempt``.
          LeaseUnavailableError: Redis could not be asked (nothing is known: the caller must not send).
        """
        code = MODE_CODES.get(mode)
        if code is None:
            raise LeaseConfigError(f"UniqueRecords.take: mode must be one of {UNIQUE_MODES}, got {mode!r}")
        limit = whole_limit(limit, "limit", maximum=scripts.MAX_LIMIT, owner="UniqueRecords.take")
        grace = whole_ms(grace, "grace", owner="UniqueRecords.take")
        args: list[str | int] = [
            "take",
            message_id,
            code,
            limit,
            grace,
            _attempt(attempt, "take"),
            self.leases.history_cap,
            actor,
        ]
        reply = self._run("take", key, args)
        if reply[0] == 1:
            return None
        holder = reply[2]
        return holder.decode() if isinstance(holder, bytes) else str(holder)

    def keep(
        self,
        key: str,
        message_id: str,
        ms: int,
        *,
        retake: Mode | None = None,
        limit: int = 1,
        attempt: int = 0,
        exact: bool = False,
    ) -> bool:
        """Push the end of ``message_id``'s record on ``key`` to ``ms`` from now (never earlier), as of
        ``attempt`` (a newer attempt is remembered); ``False`` if it has none (ended, or never taken).

        ``retake``: a message with no record takes one of this mode again if the key has room under
        ``limit`` (a message re-driven from its dead letters, a retry of a started "queued" message: queued
        again), and is never refused. ``exact``: the end is set to ``ms`` from now, earlier too (a delivery
        that enqueued its own message again: the longest hold its run was kept for no longer counts).
        """
        ms = whole_ms(ms, "ms", owner="UniqueRecords.keep")
        code = "-" if retake is None else MODE_CODES.get(retake)
        if code is None:
            raise LeaseConfigError(f"UniqueRecords.keep: retake must be None or one of {UNIQUE_MODES}, got {retake!r}")
        limit = whole_limit(limit, "limit", maximum=scripts.MAX_LIMIT, owner="UniqueRecords.keep")
        op = "renew" if exact else "keep"
        return self._run("keep", key, [op, message_id, code, limit, ms, _attempt(attempt, "keep")])[0] == 1

    def end(self, key: str, message_id: str, *, attempt: int = 2**31) -> bool:
        """End ``message_id``'s record on ``key`` (its message is done for good), unless the record was kept for
        a newer attempt than ``attempt`` (a stray copy of an attempt that failed, whose retry is pending);
        ``False`` if nothing ended."""
        return self._run("end", key, ["end", message_id, "-", 1, 1, _attempt(attempt, "end")])[0] != 0

    def records(self, key: str) -> list[UniqueRecord]:
        """The records of ``key`` as stored, oldest end first (some may be over, not yet swept by a send)."""
        validate_key(key)
        with unavailable(f"read the unique records of {key!r}", key):
            rows: Any = self.runner.client.zrange(unique_name(self.leases.prefix, key), 0, -1, withscores=True)
        found = []
        for member, score in rows:
            text = member.decode() if isinstance(member, bytes) else str(member)
            code, _, rest = text.partition(":")
            attempt, _, message_id = rest.partition(":")
            if code in _MODE_NAMES and attempt.isdigit():
                found.append(UniqueRecord(message_id, _MODE_NAMES[code], int(score), int(attempt)))
        return found


def _attempt(value: int, op: str) -> int:
    """``value`` if it is a retry count (a whole number from 0 to 2**31), else :class:`LeaseConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**31:
        raise LeaseConfigError(f"UniqueRecords.{op}: attempt must be a whole number from 0 to 2**31, got {value!r}")
    return value
