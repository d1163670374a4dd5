"""Injected interruptions and what survives them: an enqueue interrupted after the broker took it, and a log
handler an interruption cannot leave locked."""

from __future__ import annotations

import logging
from typing import Any

import dramatiq
from dramatiq.middleware import Middleware
from dramatiq.middleware.time_limit import TimeLimitExceeded


class InterruptAfterEnqueue(Middleware):
    """An asynchronous exception landing just after the broker took a copy, before the hooks learn of it.

    Added after LeaseMiddleware, its ``after_enqueue`` runs before LeaseMiddleware's (Dramatiq runs after-hooks
    in reverse): raising there is what ``raise_thread_exception`` does when it lands between ``do_enqueue``'s
    reply (redis-py's parsing is Python) and the hooks. Fires once, for an enqueue ``which`` accepts.
    """

    def __init__(self, which: Any, error: type[BaseException] = TimeLimitExceeded) -> None:
        self.which = which
        self.error = error
        self.fired: list[str] = []

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        if not self.fired and self.which(message, delay):
            self.fired.append(message.message_id)
            raise self.error


class LockFreeHandler(logging.Handler):
    """Keeps records in a list, without the handler lock an interruption could strand."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def createLock(self) -> None:  # noqa: N802 (logging's name)
        self.lock = None

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
