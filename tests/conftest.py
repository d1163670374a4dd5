"""Shared fixtures: private Redis servers on free ports (helpers live in tests/support/)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from dramatiq_leases.embedded import EmbeddedRedis


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    """A private redis-server for one test."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """A client of the test's private Redis, database 0."""
    client = redis.Redis.from_url(redis_server.url(0), socket_timeout=2)
    yield client
    client.close()
