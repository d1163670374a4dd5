"""Shared fixtures: private Redis servers on free ports, and deadline-based waiting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import redis

from dramatiq_leases.embedded import EmbeddedRedis

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


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
