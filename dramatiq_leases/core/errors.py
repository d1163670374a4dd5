"""Errors of the lease core."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lease import Busy


class LeaseError(Exception):
    """Base class of every error this package raises: ``except LeaseError`` catches them all.

    One exception is deliberately not an error: ``LeaseLost``, raised *into* an actor whose lease was lost,
    derives from Dramatiq's ``Interrupt`` (a ``BaseException``), as Dramatiq's own ``TimeLimitExceeded``
    does, so that an actor's ``except Exception`` cannot swallow it and run on without its lease.

    Attributes:
      key: the lease key concerned, when there is one.
      actor: the actor concerned, when there is one (errors of the Dramatiq middleware).
    """

    def __init__(self, *args: object, key: str | None = None, actor: str | None = None) -> None:
        super().__init__(*args)
        self.key = key
        self.actor = actor


class LeaseConfigError(LeaseError, ValueError):
    """An option has a value that cannot work (raised where it is declared)."""


class LeaseKeyError(LeaseError, ValueError):
    """A lease key is not a non-empty string, or cannot be rendered from arguments."""


class LeaseUnavailableError(LeaseError):
    """Redis could not be reached or answered with an error; nothing was granted."""


class LeaseBusyError(LeaseError):
    """Raised by :meth:`~dramatiq_leases.core.store.Leases.lease` when another holder has the key.

    Attributes:
      busy: the :class:`~dramatiq_leases.core.lease.Busy` answer (``retry_after``, the holder's fence).
    """

    def __init__(self, busy: Busy) -> None:
        super().__init__(f"lease {busy.key!r} is held by another owner; retry in {busy.retry_after} s", key=busy.key)
        self.busy = busy
