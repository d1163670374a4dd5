"""What actors did, recorded from worker threads."""

from __future__ import annotations

import threading
from typing import Any


class Runs:
    """Records dicts from actors (any thread) and finds them again."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[dict[str, Any]] = []

    def add(self, **item: Any) -> None:
        with self.lock:
            self.items.append(item)

    def where(self, **match: Any) -> list[dict[str, Any]]:
        with self.lock:
            return [i for i in self.items if all(i.get(k) == v for k, v in match.items())]

    def count(self, **match: Any) -> int:
        return len(self.where(**match))
