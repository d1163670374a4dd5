"""The brokers the cross-process tests run on: Redis (the test's private redis-server) and RabbitMQ.

RabbitMQ is the one server at ``$LEASES_TEST_RABBITMQ_URL`` (default ``amqp://guest:guest@127.0.0.1:5672/``),
shared by every test (and every engineer) using it: a test keeps to queues of its own
(:func:`unique_queue`) and deletes them, with their delay and dead-letter queues, when it ends
(:func:`delete_rabbitmq_queues`). Tests parametrized with :data:`BROKERS` skip the RabbitMQ variant, with
the reason, when that server cannot be reached.
"""

from __future__ import annotations

import functools
import os
import urllib.parse
import uuid
from typing import Any, cast

import pytest

RABBITMQ_URL = os.environ.get("LEASES_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")


def _rabbitmq_parameters() -> Any:
    import pika

    parameters = pika.URLParameters(RABBITMQ_URL)
    parameters.connection_attempts = 1
    parameters.socket_timeout = 2
    parameters.blocked_connection_timeout = 10
    return parameters


@functools.cache
def rabbitmq_up() -> bool:
    """Whether RabbitMQ answers at :data:`RABBITMQ_URL` (asked once per test session)."""
    try:
        import pika

        pika.BlockingConnection(_rabbitmq_parameters()).close()
        return True
    except Exception:
        return False


_where = urllib.parse.urlsplit(RABBITMQ_URL)  # no credentials in a skip reason

#: ``@pytest.fixture(params=BROKERS)``: a test's variants on each broker.
BROKERS = [
    "redis",
    pytest.param(
        "rabbitmq",
        marks=pytest.mark.skipif(
            not rabbitmq_up(),
            reason=f"RabbitMQ not reachable at {_where.hostname}:{_where.port or 5672} ($LEASES_TEST_RABBITMQ_URL)",
        ),
    ),
]


def unique_queue(prefix: str) -> str:
    """A queue name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def rabbitmq_consumers(queue: str) -> int:
    """How many consumers RabbitMQ's ``queue`` has now (0 if it is not declared yet)."""
    import pika
    import pika.exceptions

    connection = pika.BlockingConnection(_rabbitmq_parameters())
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.consumer_count)
    except pika.exceptions.ChannelClosedByBroker:  # NOT_FOUND: no worker declared it yet
        return 0
    finally:
        if connection.is_open:
            connection.close()


def delete_rabbitmq_queues(*queues: str) -> None:
    """Delete each of ``queues`` with the delay (``.DQ``) and dead-letter (``.XQ``) queues Dramatiq declares."""
    import pika

    connection = pika.BlockingConnection(_rabbitmq_parameters())
    try:
        channel = connection.channel()
        for name in (q + suffix for q in queues for suffix in ("", ".DQ", ".XQ")):
            channel.queue_delete(name)
    finally:
        connection.close()


def pending(server: Any, queue: str = "default") -> int:
    """Messages a Redis broker (an ``EmbeddedRedis``, database 0) holds for ``queue``: queued, delayed or
    being processed."""
    import redis

    client = redis.Redis.from_url(server.url(0))
    try:
        return int(client.hlen(f"dramatiq:{queue}.msgs")) + int(client.hlen(f"dramatiq:{queue}.DQ.msgs"))
    finally:
        client.close()


def redis_dead_letters(server: Any, queue: str = "default") -> list[Any]:
    """The messages in a Redis broker's dead-letter queue of ``queue`` (an ``EmbeddedRedis``, database 0)."""
    import dramatiq
    import redis

    client = redis.Redis.from_url(server.url(0))
    try:
        # A client without decode_responses answers bytes, which redis-py's return type does not narrow to.
        return [dramatiq.Message.decode(cast(bytes, data)) for data in client.hvals(f"dramatiq:{queue}.XQ.msgs")]
    finally:
        client.close()
