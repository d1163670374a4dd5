"""Helpers for web handlers that start a job only if none is running for the same key.

The flow: the handler calls :meth:`Leases.try_acquire` on the job's key. If
it gets :class:`Busy`, it answers ``423 Locked`` at once, with
``Retry-After``; otherwise it sends the message with
``send_with_options(lease=lease)``, so the worker adopts that very lease,
and answers ``202 Accepted``. These helpers build the parts of those
answers; they use no web framework, so any of them can use them (see
``examples/flask_app.py`` and ``examples/fastapi_app.py``).
"""

from __future__ import annotations

from typing import Any, Final

from .core import Busy, Lease

#: ``423 Locked`` (RFC 4918): the resource is locked; here, a job for it is running.
HTTP_423_LOCKED: Final = 423

#: ``202 Accepted``: the job was queued.
HTTP_202_ACCEPTED: Final = 202


def locked_response_headers(busy: Busy) -> dict[str, str]:
    """Headers of a 423 answer: ``Retry-After``, whole seconds until the holder's lease ends at the latest."""
    return {"Retry-After": str(busy.retry_after)}


def locked_body(busy: Busy, detail: str | None = None) -> dict[str, Any]:
    """A JSON-ready body for a 423 answer: what is locked and when to retry."""
    return {
        "error": "locked",
        "detail": detail or f"A job for {busy.key!r} is already running; retry in {busy.retry_after} s.",
        "key": busy.key,
        "retry_after": busy.retry_after,
    }


def accepted_body(lease: Lease, message_id: str) -> dict[str, Any]:
    """A JSON-ready body for a 202 answer: the queued message and the fencing token its job will hold."""
    return {"key": lease.key, "fence": lease.fence, "message_id": message_id}


class LockedError(Exception):
    """Raise from a handler when the key is busy; turn it into a 423 in one error handler.

    Attributes:
      busy: the :class:`Busy` answer of the acquire.
      status_code: always :data:`HTTP_423_LOCKED`.
    """

    status_code: Final = HTTP_423_LOCKED

    def __init__(self, busy: Busy, detail: str | None = None) -> None:
        self.busy = busy
        self.detail = detail
        super().__init__(locked_body(busy, detail)["detail"])

    @property
    def headers(self) -> dict[str, str]:
        """The response headers (``Retry-After``)."""
        return locked_response_headers(self.busy)

    @property
    def body(self) -> dict[str, Any]:
        """The JSON-ready response body."""
        return locked_body(self.busy, self.detail)


__all__ = [
    "HTTP_202_ACCEPTED",
    "HTTP_423_LOCKED",
    "LockedError",
    "accepted_body",
    "locked_body",
    "locked_response_headers",
]
