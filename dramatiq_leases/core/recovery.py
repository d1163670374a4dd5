"""Releasing a lease whose holder cannot be running any more: the operator's way out of an orphan."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from . import scripts
from .client import unavailable
from .errors import LeaseStateError
from .info import LeaseInfo
from .keys import fence_name, history_name, lease_name, validate_key
from .numbers import whole_count
from .protocol import operator_name
from .reading import Reader
from .runner import ScriptRunner


class DeadRelease(NamedTuple):
    """What :meth:`~dramatiq_leases.core.store.Leases.release_if_dead` did.

    Attributes:
      released: ``True`` if released, ``False`` if refused, ``None`` if there is no such lease.
      deadline_in: seconds until the lease may be released, its holder's
        deadline plus safety margin (negative: past it), or ``None`` when the
        key does not say (it then expires by its TTL), or when another grant
        holds the slot now.
      fence: the fence of the lease found (0 if unknown). Given a ``fence``, a refusal with another one says
        that the grant asked for ended meanwhile and that grant holds its slot now: nothing was touched.
    """

    released: bool | None
    deadline_in: float | None
    fence: int


class Recovery:
    """:meth:`~.store.Leases.release_if_dead` of a store's keys under ``prefix`` (for the store, not a user API):
    the holders read with ``reader``, the script run by ``runner``. ``fence_retention`` and ``history`` are the
    store's (0: none)."""

    def __init__(
        self, runner: ScriptRunner, reader: Reader, prefix: str, *, fence_retention: int, history: int
    ) -> None:
        self.runner = runner
        self.reader = reader
        self.prefix = prefix
        self.fence_retention = fence_retention
        self.history = history
        self._script = runner.register(scripts.RELEASE_IF_DEAD)

    def call(self, keys: list[str], args: list[Any]) -> Any:
        """Run the ``RELEASE_IF_DEAD`` script with ``keys`` and ``args``."""
        return self.runner.call(self._script, keys, args)

    def release_if_dead(self, key: str, *, fence: int | None, by: str | None) -> DeadRelease:
        """:meth:`~.store.Leases.release_if_dead`."""
        who = operator_name(by)
        if fence is not None:
            fence = whole_count(fence, "fence", maximum=2**53, owner="release_if_dead")
        holder = target(validate_key(key), self.reader.holders(key), fence)
        if holder is None:
            return DeadRelease(None, None, 0)
        return release_if_dead(
            self.call, self.prefix, self.fence_retention, key, holder, history=self.history or -1, by=who
        )


def target(key: str, holders: Sequence[LeaseInfo], fence: int | None) -> LeaseInfo | None:
    """The holder of ``key`` that :meth:`Leases.release_if_dead` judges: the one of ``fence``, else the only one.

    Raises:
      LeaseStateError: no ``fence`` and several holders: which one to release must be said, never guessed.
    """
    if fence is not None:
        return next((info for info in holders if info.fence == fence), None)
    if len(holders) > 1:
        which = ", ".join(f"fence {info.fence} in slot {info.slot} ({info.state.value})" for info in holders)
        raise LeaseStateError(
            f"{key!r} has {len(holders)} holders ({which}): name the one to release by its fence "
            "(release_if_dead(key, fence=N); the CLI's --fence N)",
            key=key,
        )
    return holders[0] if holders else None


def release_if_dead(
    call: Callable[[list[str], list[Any]], Any],
    prefix: str,
    fence_retention: int,
    key: str,
    holder: LeaseInfo,
    *,
    history: int = 0,
    by: str = "",
) -> DeadRelease:
    """:meth:`Leases.release_if_dead` of ``holder``, a holder of ``key`` as read: ``call`` runs the
    ``RELEASE_IF_DEAD`` script with its keys and arguments, on ``holder``'s slot and for its fence only (a hash
    without a fence, written by hand: whatever holds that slot). ``history``: the key's history cap (-1: its
    own, if it has one), recording the release as ``force_released`` ``by`` whom."""
    keys = [lease_name(prefix, validate_key(key), holder.slot), fence_name(prefix, key), history_name(prefix, key)]
    args: list[Any] = [fence_retention, holder.fence]
    if history:
        args += [history, by]
    with unavailable(f"release lease {key!r}", key):
        reply = call(keys, args)
    code = int(reply[0])
    if code == -1:
        return DeadRelease(None, None, 0)
    if code == -2:  # another grant holds the slot now: the one asked for ended meanwhile
        return DeadRelease(False, None, int(reply[1]))
    ms, fence = int(reply[1]), int(reply[2])
    if code == 1:
        return DeadRelease(True, -ms / 1000, fence)
    return DeadRelease(False, ms / 1000 if ms >= 0 else None, fence)
