"""Errors the middleware raises to producers and stores on messages."""

from __future__ import annotations

from dramatiq.middleware import SkipMessage
from dramatiq.middleware.middleware import MiddlewareError

from ..core.errors import LeaseConfigError, LeaseError, LeaseKeyError


class LeaseOptionError(LeaseConfigError, MiddlewareError):
    """An actor or message declares lease options that cannot work."""


class LeaseKeyRenderError(LeaseKeyError, MiddlewareError):
    """A message's arguments do not render its actor's ``lock_key``; raised to the producer."""


class LeaseWaitExceeded(LeaseError, SkipMessage):  # noqa: N818 (named as Dramatiq's TimeLimitExceeded)
    """Stored as the failure of a message that waited longer than ``lock_max_wait`` for its lease.

    Attributes:
      key: the lease key it waited for.
      actor: the message's actor.
    """
