"""Run in a fresh interpreter by tests/test_interrupts.py: a worker's first messages through the lease path
(a grant, a wait in place, a handoff, a park and its promotion, a skip, a superseded message, a rate, a
debounced burst, a unique send, a lease lost mid-run), recording every import a worker thread starts
meanwhile, printed as JSON: ``[[module, the first file of this package asking], ...]``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import redis
from dramatiq.worker import WorkerThread

import dramatiq_leases
from dramatiq_leases import LeaseLost
from dramatiq_leases.core.keys import DEFAULT_PREFIX, lease_name
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
    started, release, lost = threading.Event(), threading.Event(), threading.Event()

    @stack.actor(lock_key="k:{n}", lock_ttl=2_000, max_retries=0)
    def job(n: int, hold: bool) -> None:
        if hold:
            started.set()
            release.wait(10)

    @stack.actor(lock_key="k:{n}", lock_ttl=2_000, max_retries=0, lock_on_busy="skip")
    def skipping(n: int) -> None:
        pass

    @stack.actor(lock_key="k:{n}", lock_ttl=2_000, max_retries=0, lock_on_busy="latest")
    def newest(n: int) -> None:
        pass

    @stack.actor(lock_key="r:{n}", max_retries=0, lock_rate="1/200ms")
    def rated(n: int) -> None:
        pass

    @stack.actor(lock_key="d:{n}", max_retries=0, lock_debounce=50)
    def debounced(n: int) -> None:
        pass

    @stack.actor(lock_key="u:{n}", max_retries=0, lock_unique="until_done")
    def unique(n: int) -> None:
        pass

    @stack.actor(lock_key="lost:{n}", lock_ttl=1_000, max_retries=0)
    def losing(n: int) -> None:
        try:
            for _ in range(1_000):  # short sleeps: an exception raised into a thread lands between two bytecodes
                time.sleep(0.01)
        except LeaseLost:
            lost.set()
            raise

    sys.meta_path.insert(0, Recording)
    stack.start()
    try:
        held = job.send(1, True)
        assert started.wait(10), "the holder never started"
        waiters = [job.send(1, False) for _ in range(3)]  # one waits in place, the others park
        later = [newest.send(1) for _ in range(2)]  # the first is superseded by the second
        settled = [skipping.send(1), *(rated.send(1) for _ in range(2)), *(debounced.send(1) for _ in range(2))]
        settled.append(unique.send(1))
        deadline = time.monotonic() + 10
        while not any(stack.recorder.delays(w.message_id) for w in waiters) and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        for message in [held, *waiters, *later, *settled]:
            assert stack.recorder.wait_settled(message.message_id) in ("acked", "nacked")
        losing.send(1)
        client = redis.Redis.from_url(leases_url)
        while not client.exists(lease_name(DEFAULT_PREFIX, "lost:1")) and time.monotonic() < deadline:
            time.sleep(0.01)
        client.delete(lease_name(DEFAULT_PREFIX, "lost:1"))  # its heartbeat finds it gone: LeaseLost
        assert lost.wait(10), "the lease was never lost"
    finally:
        stack.stop()
        sys.meta_path.remove(Recording)
    print(json.dumps(imports))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
