"""Where the demo writes: news stamped with the seconds since its workers started, and plain lines."""

from __future__ import annotations

import time
from typing import TextIO


class Console:
    """The demo's output stream and the clock its news is stamped with."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.t0 = time.monotonic()

    def restart_clock(self) -> None:
        """Stamp news from now on with the seconds since this call."""
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the clock was (re)started."""
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        """Write one line of news, stamped with the time it happened."""
        self.out.write(f"{self.elapsed():6.2f}  {text}\n")
        self.out.flush()

    def line(self, text: str = "") -> None:
        """Write one plain line."""
        self.out.write(text + "\n")
        self.out.flush()
