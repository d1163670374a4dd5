"""Waiting on a condition with a deadline: tests never sleep and hope."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

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
