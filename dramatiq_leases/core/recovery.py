"""Releasing a lease whose holder cannot be running any more: the operator's way out of an orphan."""

from __future__ import annotations

from collections.abc import Callable
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


def release_if_dead(
    call: Callable[[list[str], list[Any]], Any], prefix: str, fence_retention: int, key: str
) -> DeadRelease:
    """:meth:`Leases.release_if_dead`: ``call`` runs the ``RELEASE_IF_DEAD`` script with its keys and arguments."""
    keys = [lease_name(prefix, validate_key(key)), fence_name(prefix, key)]
    with unavailable(f"release lease {key!r}", key):
        reply = call(keys, [fence_retention])
    code = int(reply[0])
    if code < 0:
        return DeadRelease(None, None, 0)
    ms, fence = int(reply[1]), int(reply[2])
    if code == 1:
        return DeadRelease(True, -ms / 1000, fence)
    return DeadRelease(False, ms / 1000 if ms >= 0 else None, fence)
