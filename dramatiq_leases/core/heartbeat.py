"""The heartbeat that keeps a process's leases alive.

One :class:`Heartbeat` per process renews every lease the process holds, all
that are due in one round trip per hash slot per round. A second thread, the
watchdog, declares a lease lost as soon as its local deadline passes without a
confirmed renewal (Redis unreachable, or the maximum hold reached), so the
verdict never waits on a hung socket.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from ..metrics import NULL_METRICS, LeaseMetrics
from .errors import LeaseUnavailableError
from .lease import Lease, Leases, Renewal

logger = logging.getLogger(__name__)

#: Called with the lease and the reason ("gone", "stolen", "unreachable" or
#: "max_hold") when a tracked lease is lost. Runs on a heartbeat thread.
LostCallback = Callable[[Lease, str], None]

#: Shortest pause before retrying a failed renewal, in seconds.
MIN_RETRY_DELAY = 0.05


@dataclass(eq=False)
class _Entry:
    lease: Lease
    on_lost: LostCallback
    next_due: float


_instances: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for heartbeat in list(_instances):
        heartbeat._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Heartbeat:
    """Renews the leases of this process until they are untracked.

    Parameters:
      leases: the store the leases came from.
      metrics: where renewals, rounds and losses are reported.

    Threads start on the first :meth:`track` and restart if they die. After a
    ``fork()`` the child starts empty: the leases belong to the parent.
    """

    def __init__(self, leases: Leases, *, metrics: LeaseMetrics = NULL_METRICS) -> None:
        self.leases = leases
        self.metrics = metrics
        self._reset()
        _instances.add(self)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[str, _Entry] = {}
        self._stopping = False
        self._renewer: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        # When each thread will next wake by itself: a new lease due later needs no wake-up call.
        self._renewer_wakes_at = 0.0
        self._watchdog_wakes_at = 0.0

    # Public API ------------------------------------------------------------

    def track(self, lease: Lease, on_lost: LostCallback) -> None:
        """Renew ``lease`` every ``lease.interval`` ms until :meth:`untrack`; call ``on_lost`` if it is lost."""
        entry = _Entry(lease, on_lost, time.monotonic() + lease.interval / 1000)
        with self._cond:
            self._stopping = False
            self._entries[lease.token] = entry
            self._ensure_threads()
            if entry.next_due < self._renewer_wakes_at or lease.valid_until < self._watchdog_wakes_at:
                self._cond.notify_all()

    def untrack(self, lease: Lease) -> bool:
        """Stop renewing ``lease``. Returns ``False`` if it was not tracked (already lost or untracked)."""
        with self._cond:
            return self._entries.pop(lease.token, None) is not None

    def tracked(self) -> list[Lease]:
        """The leases being renewed now."""
        with self._cond:
            return [e.lease for e in self._entries.values()]

    def stop(self, timeout: float = 5.0) -> list[Lease]:
        """Stop both threads; returns the leases that were still tracked (now untracked)."""
        with self._cond:
            self._stopping = True
            left = [e.lease for e in self._entries.values()]
            self._entries.clear()
            self._cond.notify_all()
        for thread in (self._renewer, self._watchdog):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
        return left

    # Threads ---------------------------------------------------------------

    def _ensure_threads(self) -> None:
        if self._renewer is None or not self._renewer.is_alive():
            self._renewer = threading.Thread(target=self._renew_loop, name="dramatiq-leases-heartbeat", daemon=True)
            self._renewer.start()
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(target=self._watch_loop, name="dramatiq-leases-watchdog", daemon=True)
            self._watchdog.start()

    def _renew_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    now = time.monotonic()
                    due_at = min((e.next_due for e in self._entries.values()), default=None)
                    if due_at is not None and due_at <= now:
                        break
                    # Idle, wake every second anyway: with an infinite wait, every track() would
                    # have to notify, and short jobs would wake both threads per message.
                    self._renewer_wakes_at = now + 1.0 if due_at is None else due_at
                    self._cond.wait(self._renewer_wakes_at - now)
                if self._stopping:
                    return
                # Renew everything due within half an interval too: fewer, fuller rounds.
                batch = [e for e in self._entries.values() if e.next_due <= now + e.lease.interval / 2000]
            try:
                self._round(batch)
            except Exception:
                logger.exception("Heartbeat round failed; retrying.")
                with self._cond:
                    for e in batch:
                        e.next_due = time.monotonic() + MIN_RETRY_DELAY

    def _round(self, batch: list[_Entry]) -> None:
        started = time.monotonic()
        try:
            results = self.leases.renew_many([e.lease for e in batch])
        except LeaseUnavailableError as e:
            self.metrics.redis_error("renew")
            logger.warning("Could not renew %d lease(s): %s", len(batch), e)
            results = [Renewal.ERROR] * len(batch)
        finished = time.monotonic()
        self.metrics.renew_round(finished - started)
        lost: list[tuple[_Entry, str]] = []
        with self._cond:
            for entry, result in zip(batch, results):
                lease = entry.lease
                if self._entries.get(lease.token) is not entry:
                    continue  # untracked meanwhile: its outcome no longer matters
                if result is Renewal.OK:
                    entry.next_due = finished + lease.interval / 1000
                elif result is Renewal.ERROR:
                    # Retry sooner; the watchdog ends it if Redis stays away past its deadline.
                    entry.next_due = finished + max(MIN_RETRY_DELAY, lease.interval / 4000)
                else:
                    del self._entries[lease.token]
                    lost.append((entry, result.value))
                self.metrics.renewal(lease.meta, "lost" if result.value in ("gone", "stolen", "max_hold")
                                     else result.value)
        for entry, reason in lost:
            self._lose(entry, reason)

    def _watch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    now = time.monotonic()
                    deadline = min((e.lease.valid_until for e in self._entries.values()), default=None)
                    if deadline is not None and deadline <= now:
                        break
                    # Wake at least every second to restart a dead renewer.
                    timeout = 1.0 if deadline is None else min(1.0, deadline - now)
                    self._watchdog_wakes_at = now + timeout
                    self._cond.wait(timeout)
                    if self._renewer is not None and not self._renewer.is_alive() and not self._stopping:
                        logger.error("Heartbeat thread died; restarting it.")
                        self._ensure_threads()
                if self._stopping:
                    return
                expired = [e for e in self._entries.values() if e.lease.valid_until <= now]
                for e in expired:
                    del self._entries[e.lease.token]
            for e in expired:
                self._lose(e, "max_hold" if now >= e.lease.hold_until else "unreachable")

    def _lose(self, entry: _Entry, reason: str) -> None:
        lease = entry.lease
        logger.error("Lease %r (fence %d) lost: %s.", lease.key, lease.fence, _REASONS.get(reason, reason))
        self.metrics.lost(lease.meta, reason)
        try:
            entry.on_lost(lease, reason)
        except Exception:
            logger.exception("Lost-lease callback failed for %r.", lease.key)


_REASONS = {
    "gone": "the key is gone from Redis (expired or deleted)",
    "stolen": "another owner holds the key",
    "unreachable": "Redis did not confirm a renewal before the local deadline",
    "max_hold": "the maximum hold time was reached",
}
