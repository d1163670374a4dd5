"""Waiting on a condition with a deadline: tests never sleep and hope (and :func:`busy_for`, a key sampled
over a span)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from dramatiq_leases import Busy, Leases

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "condition",
    *,
    details: Callable[[], str] | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test at the deadline, with what ``details``
    tells then (logs, records). The one poll loop of the tests: the others add their checks around it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            if details is None:
                pytest.fail(f"timed out after {timeout}s waiting for {what}")
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{details()}", pytrace=False)
        time.sleep(interval)


def busy_for(leases: Leases, key: str, seconds: float) -> bool:
    """True if a rival asking for ``key`` every 50 ms during ``seconds`` was turned away every time."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rival = leases.try_acquire(key, ttl=5_000)
        if not isinstance(rival, Busy):
            leases.release(rival)
            return False
        time.sleep(0.05)  # sampling the key over a span of time, not waiting for an event
    return True
