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


class LeaseURLError(LeaseConfigError):
    """A Redis URL that cannot be used: unparsable, or naming what its scheme cannot have (the message never
    repeats the URL, which may hold a password)."""


class LeaseStateError(LeaseError, RuntimeError):
    """Called where it cannot work: ``current_lease()`` outside an actor that holds a lease, an embedded
    ``redis-server`` that cannot be found or started."""


class LeaseExpiredError(LeaseError):
    """Raised at the end of a :meth:`~dramatiq_leases.core.store.Leases.lease` block whose lease ended before
    the block did (lost, expired or taken): the block's work may have overlapped another holder's.

    Attributes:
      lease: the lease the block held.
    """

    def __init__(self, message: str, *, lease: object) -> None:
        super().__init__(message, key=getattr(lease, "key", None))
        self.lease = lease


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
