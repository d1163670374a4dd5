"""Counting every broker enqueue of every message: the producer's send, and each send back by a worker.

Both sides add :class:`EnqueueCounter` to their broker (workers when
``BENCH_COUNT_ENQUEUES=1``, see :mod:`bench.app`; the harness through
:func:`bench.workers.producer`). A message keeps its id through every copy
(a backoff, a parked copy, its return from the delay queue), so the count
per id is how many times the broker carried that message.
"""

from __future__ import annotations

from typing import Any

import dramatiq
import redis
from dramatiq.middleware import Middleware

from .names import ENQUEUES_KEY


class EnqueueCounter(Middleware):
    """``HINCRBY`` :data:`~bench.names.ENQUEUES_KEY` by message id after every enqueue."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        self.client.hincrby(ENQUEUES_KEY, message.message_id, 1)


def enqueue_counts(client: redis.Redis) -> dict[str, int]:
    """Enqueues so far, by message id."""
    return {k.decode(): int(v) for k, v in client.hgetall(ENQUEUES_KEY).items()}
