"""Errors the middleware raises to producers and stores on messages."""

from __future__ import annotations

import email.utils
import math
import time

from dramatiq.middleware import SkipMessage
from dramatiq.middleware.middleware import MiddlewareError

from ..core.errors import LeaseBusyError, LeaseConfigError, LeaseError, LeaseKeyError, LeaseUnavailableError
from ..core.lease import Busy
from ..core.numbers import whole_ms
from ..core.scripts import MAX_HOLD_BACK_MS


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


class RateLimited(Exception):  # noqa: N818 (what the actor says: its downstream rate-limited it)
    """Raise in an actor with ``lock_key`` whose downstream said "too many requests" (HTTP 429).

    The message neither fails nor spends a retry (even with ``max_retries=0``): its lease is released with a
    hold of ``retry_after`` ms, during which no message of its key starts (none of its ``lock_limit`` slots),
    and the message waits at the head of the key's line, to run again first once the hold ends. Its wait
    budget (``lock_max_wait``) starts again. Counted in ``dramatiq_lease_not_run_total{reason="rate_limited"}``
    and logged at INFO. In an actor without ``lock_key`` it fails the message as any exception does.

    Parameters:
      retry_after: how long to hold the key back, in ms: a whole number from 1 to 86 400 000 (a day).
        :meth:`after_header` reads an HTTP ``Retry-After`` value.

    Raises:
      LeaseConfigError: ``retry_after`` is out of range (raised where the actor raises this, so the
        message fails with it, as with any bug).
    """

    def __init__(self, retry_after: int, *args: object) -> None:
        self.retry_after = whole_ms(retry_after, "retry_after", owner="RateLimited", maximum=MAX_HOLD_BACK_MS)
        super().__init__(*(args or (f"rate limited: retry after {self.retry_after} ms",)))

    def __reduce__(self) -> tuple[type[RateLimited], tuple[object, ...]]:
        return type(self), (self.retry_after, *self.args)  # pickled (Results stores exceptions) as it was made

    @classmethod
    def after_header(cls, value: str | None, *, default: int = 1000, now: float | None = None) -> RateLimited:
        """The exception for an HTTP ``Retry-After`` header: seconds (``"120"``) or an HTTP date; ``default`` ms
        when it is missing or unreadable; at least 1 ms, at most a day. ``now``: the Unix time to count a date
        from (default: this machine's clock)."""
        ms: float = default
        text = (value or "").strip()
        if text.isdigit():
            ms = int(text) * 1000
        elif text:
            try:
                when = email.utils.parsedate_to_datetime(text)
            except (TypeError, ValueError):
                when = None
            if when is not None and when.tzinfo is not None:
                ms = (when.timestamp() - (time.time() if now is None else now)) * 1000
        return cls(int(min(max(math.ceil(ms), 1), MAX_HOLD_BACK_MS)))
