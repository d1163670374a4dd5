"""Bursts of sends of one key, and the one message of each burst that runs (``lock_debounce``).

Sends of a key form a *burst* while each comes within the quiet window of the previous one. Each send takes a
sequence at send time (:meth:`Debounces.send`: above every one the key handed out, and at least the Redis
server's clock in µs), which extends the burst's *due* instant: the quiet window after it, or the burst's first
send plus the cap, whichever is sooner. The cap is stored with the burst, in the key's record, not in a key
that expires. The producer then confirms that the send reached its broker (:meth:`Debounces.confirm`). At
delivery, :meth:`Debounces.pick` decides, in one script, whether the message runs (the newest send in the
broker, once its burst is due), waits, or gives way to the message it names. See ``lua/debounce.lua``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from . import scripts
from .client import unavailable
from .keys import debounce_name, validate_key
from .runner import ScriptRunner

#: How long a newer send may take to confirm that it reached the broker before an older message runs in its
#: stead (ms): its producer failed between the send and the broker, or is that slow.
CONFIRM_MS = 10_000


#: How far a genuine sequence may be from its message's ``message_timestamp`` (ms): the producer's clock against
#: the Redis server's. One further off was not handed out at that send (made up, or garbled).
STAMP_SKEW_MS = 600_000


def genuine(seq: object, sent_ms: object) -> bool:
    """Whether ``seq`` (a message option: input from whoever writes to the broker) can be a sequence a send took:
    a whole number, in µs of a clock within :data:`STAMP_SKEW_MS` of the message's own send time (ms)."""
    if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= scripts.MAX_ORDER:
        return False
    if isinstance(sent_ms, bool) or not isinstance(sent_ms, int):
        return False
    return abs(seq // 1000 - sent_ms) <= STAMP_SKEW_MS


class Verdict(IntEnum):
    """What becomes of one delivery of a debounced message (``lua/debounce.lua``'s verdicts)."""

    #: It is its burst's run (picked now, or a copy or retry of the one picked).
    RUN = scripts.DEBOUNCE_RUN
    #: Not yet: it comes back in :attr:`Pick.wait_ms`.
    WAIT = scripts.DEBOUNCE_WAIT
    #: Not run: a newer message runs instead (:attr:`Pick.by`).
    DEBOUNCED = scripts.DEBOUNCED


@dataclass(frozen=True)
class Pick:
    """The verdict on one delivery, how long it waits (ms, for :attr:`Verdict.WAIT`), and the message that runs
    in its stead (for :attr:`Verdict.DEBOUNCED`; ``""`` if unknown)."""

    verdict: Verdict
    wait_ms: int = 0
    by: str = ""


@dataclass(frozen=True)
class Stamp:
    """A send's sequence among its key's sends, and how long until its burst's run is due (ms)."""

    seq: int
    due_in_ms: int


class Debounces:
    """The debounce records of a lease store's keys: for the middleware, not a user API.

    Parameters:
      runner: the store's script runner; prefix: its key prefix.
    """

    def __init__(self, runner: ScriptRunner, prefix: str) -> None:
        self.runner = runner
        self.prefix = prefix
        self._script = runner.register(scripts.DEBOUNCE)

    def _call(self, what: str, key: str, args: list[str | int]) -> object:
        validate_key(key)
        with unavailable(f"{what} for {key!r}", key):
            return self.runner.call(self._script, [debounce_name(self.prefix, key)], args)

    def send(self, key: str, message_id: str, quiet: int, cap: int | None, *, in_broker: bool = False) -> Stamp:
        """Register a send of ``key`` (``quiet`` and ``cap`` in ms, checked by the caller); ``in_broker``: the
        message is in its broker already (a delivery without a sequence), so it is confirmed too.

        Raises:
          LeaseUnavailableError: Redis could not be asked.
        """
        args: list[str | int] = ["send", 0, message_id, quiet, cap or 0, 1 if in_broker else 0, 0]
        reply: Any = self._call("debounce a send", key, args)
        seq, due_in = reply  # {seq, ms}: lua/debounce.lua
        return Stamp(int(seq), max(0, int(due_in)))

    def confirm(self, key: str, seq: int, message_id: str) -> None:
        """The send of ``seq`` reached its broker.

        Raises:
          LeaseUnavailableError: Redis could not be asked.
        """
        self._call("confirm a debounced send", key, ["confirm", seq, message_id, 0, 0, 0, 0])

    def pick(
        self, key: str, seq: int, message_id: str, quiet: int, cap: int | None, *, confirm_ms: int = CONFIRM_MS
    ) -> Pick:
        """The verdict on a delivery of the message sent as ``seq`` (a genuine sequence: see :func:`genuine`). One
        the key's record never saw (the store lost the record that handed it out) is registered as the send it
        was, at ``seq``, with ``quiet`` and ``cap``.

        Raises:
          LeaseUnavailableError: Redis could not be asked.
        """
        args: list[str | int] = ["pick", seq, message_id, quiet, cap or 0, 0, confirm_ms]
        reply: Any = self._call("pick a debounced run", key, args)
        verdict, wait, by = reply  # {verdict, wait_ms, id}: lua/debounce.lua
        return Pick(Verdict(int(verdict)), int(wait), by.decode() if isinstance(by, bytes) else str(by))
