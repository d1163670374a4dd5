"""Errors the middleware raises to producers and stores on messages."""

from __future__ import annotations

from dramatiq.middleware import SkipMessage
from dramatiq.middleware.middleware import MiddlewareError

from ..core.errors import LeaseBusyError, LeaseConfigError, LeaseError, LeaseKeyError, LeaseUnavailableError
from ..core.lease import Busy


class LeaseOptionError(LeaseConfigError, MiddlewareError):
    """An actor or message declares lease options that cannot work."""


class LeaseKeyRenderError(LeaseKeyError, MiddlewareError):
    """A message's arguments do not render its actor's ``lock_key``; raised to the producer."""


class LeaseLimitError(LeaseError, MiddlewareError):
    """Stored as the failure of a message whose actor's ``lock_limit`` callable raised on the worker (a tier
    service or database briefly down): the message did not run and took no lease, and fails as if its actor
    had raised, so Retries retries it (its backoff, ``max_retries``, ``retry_when``, ``throws``) and, once it
    gives up, dead-letters it. The callable's own exception is its ``__cause__``. (At send time, the same
    failure refuses the send with :class:`LeaseOptionError`.)

    Attributes:
      key: the message's lease key.
      actor: the message's actor.
      limit: the ``lock_limit`` callable that raised.
    """

    def __init__(self, *args: object, limit: object, key: str | None = None, actor: str | None = None) -> None:
        super().__init__(*args, key=key, actor=actor)
        self.limit = limit


class LeaseBusyFailed(LeaseBusyError, SkipMessage):  # noqa: N818 (as LeaseWaitExceeded)
    """Stored as the failure of a message whose key was full with ``lock_on_busy="fail"``: it was
    dead-lettered at once, without running and without a retry.

    Attributes:
      key: the lease key that was full.
      actor: the message's actor.
      busy: the busy answer (the holders' remaining TTL, the newest holder's fence).
    """

    def __init__(self, busy: Busy, *, actor: str, limit: int) -> None:
        LeaseError.__init__(
            self, f"lease {busy.key!r} was full (lock_limit={limit}, lock_on_busy='fail')", key=busy.key, actor=actor
        )
        self.busy = busy


class LeaseWaitExceeded(LeaseError, SkipMessage):  # noqa: N818 (named as Dramatiq's TimeLimitExceeded)
    """Stored as the failure of a message that waited longer than ``lock_max_wait`` for its lease.

    Attributes:
      key: the lease key it waited for.
      actor: the message's actor.
    """


class DuplicateMessage(LeaseError, MiddlewareError):  # noqa: N818 (the name the issue and peers use)
    """Raised to the producer by a send refused under ``lock_unique``: another message of the key holds its
    record (queued, or with ``"until_done"`` not yet done for good). Nothing was enqueued.

    Attributes:
      key: the lease key.
      message_id: the id of the message holding the record (the one already queued or running).
      actor: the refused message's actor.
      refused_id: the id the refused message would have had.
    """

    def __init__(self, *, key: str, message_id: str, actor: str, refused_id: str, mode: str) -> None:
        LeaseError.__init__(
            self,
            f"actor {actor!r}: message {refused_id} not sent: key {key!r} already has message {message_id} "
            f"(lock_unique={mode!r})",
            key=key,
            actor=actor,
        )
        self.message_id = message_id
        self.refused_id = refused_id


class LeaseSendUnavailableError(LeaseUnavailableError, MiddlewareError):
    """Raised to the producer by a send of a ``lock_unique`` actor whose record could not be asked for (Redis
    unreachable): refused, nothing enqueued, rather than sent unchecked."""
