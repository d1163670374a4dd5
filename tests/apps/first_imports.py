"""Run in a fresh interpreter by tests/test_interrupts.py: a worker's first messages through the lease path
(a grant, a wait in place, a handoff, a park and its promotion, a skip), recording every import a worker thread
starts meanwhile, printed as JSON: ``[[module, the first file of this package asking], ...]``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from dramatiq.worker import WorkerThread

import dramatiq_leases
from tests.support.stack import Stack

PACKAGE = os.path.dirname(dramatiq_leases.__file__) + os.sep
imports: list[list[str]] = []


class Recording:
    """A finder that finds nothing: it notes each import a worker thread starts, and who in this package asked."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> None:
        if isinstance(threading.current_thread(), WorkerThread):
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE):
                frame = frame.f_back  # type: ignore[assignment]
            imports.append([name, "" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"])


def main(broker_url: str, leases_url: str) -> None:
    stack = Stack(broker_url, leases_url, threads=3, lock_min_backoff=1, lock_max_backoff=5)
    started, release = threading.Event(), threading.Event()

    @stack.actor(lock_key="k:{n}", lock_ttl=2_000, max_retries=0)
    def job(n: int, hold: bool) -> None:
        if hold:
            started.set()
            release.wait(10)

    @stack.actor(lock_key="k:{n}", lock_ttl=2_000, max_retries=0, lock_on_busy="skip")
    def skipping(n: int) -> None:
        pass

    sys.meta_path.insert(0, Recording)
    stack.start()
    try:
        held = job.send(1, True)
        assert started.wait(10), "the holder never started"
        waiters = [job.send(1, False) for _ in range(3)]  # one waits in place, the others park
        skipped = skipping.send(1)
        assert stack.recorder.wait_settled(skipped.message_id) == "acked"
        deadline = time.monotonic() + 10
        while not any(stack.recorder.delays(w.message_id) for w in waiters) and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        for message in [held, *waiters]:
            assert stack.recorder.wait_settled(message.message_id) == "acked"
    finally:
        stack.stop()
        sys.meta_path.remove(Recording)
    print(json.dumps(imports))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
