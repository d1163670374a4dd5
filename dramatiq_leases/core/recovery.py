"""Releasing a lease whose holder cannot be running any more: the operator's way out of an orphan."""

from __future__ import annotations

from typing import Any, NamedTuple

from .client import unavailable
from .keys import fence_name, lease_name, validate_key


class DeadRelease(NamedTuple):
    """What :meth:`~dramatiq_leases.core.store.Leases.release_if_dead` did.

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


class LeaseRecovery:
    """The recovery side of :class:`~dramatiq_leases.core.store.Leases` (its base class)."""

    prefix: str
    fence_retention_ms: int
    _release_if_dead: Any

    def release_if_dead(self, key: str) -> DeadRelease:
        """Release the lease on ``key`` only if no holder can still be running under it.

        Decided inside one script from facts the holder wrote itself: its
        deadline and the margin its actor has to stop have passed
        (:attr:`LeaseInfo.ends_ms`; the key outlived them because its TTL was
        changed by hand); or the hash does not say and the key has no TTL
        (written by hand). A holder whose heartbeat is merely overdue keeps
        its lease: it may still be running, and the key expires by itself at
        that same instant.

        The release is recorded in the key's fence counter (so the exporter
        does not count it as an expiry), keeping the counter's TTL; a counter
        that a fleet's ``fence_retention`` expired during the leak is made
        again with this store's ``fence_retention_ms``, or for an hour when
        this store has none (the CLI's, which cannot know the fleet's): never
        without a TTL. A counter of another type is left alone.
        """
        keys = [lease_name(self.prefix, validate_key(key)), fence_name(self.prefix, key)]
        with unavailable(f"release lease {key!r}", key):
            reply = self._release_if_dead(keys=keys, args=[self.fence_retention_ms])
        code = int(reply[0])
        if code < 0:
            return DeadRelease(None, None, 0)
        ms, fence = int(reply[1]), int(reply[2])
        if code == 1:
            return DeadRelease(True, -ms / 1000, fence)
        return DeadRelease(False, ms / 1000 if ms >= 0 else None, fence)
