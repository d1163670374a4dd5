"""The heartbeat that keeps a process's leases alive.

One :class:`Heartbeat` per process renews every lease the process holds, all
that are due in one round trip per round (on a Cluster too). A second thread, the
watchdog, declares a lease lost as soon as its local deadline passes without a
confirmed renewal (Redis unreachable, or the maximum hold reached), so the
verdict never waits on a hung socket; it also replaces a renewer that died or
hangs.

:meth:`Heartbeat.track`, :meth:`Heartbeat.untrack` and :meth:`Heartbeat.renew_until` are called on worker
threads, where an asynchronous exception (Dramatiq's ``TimeLimitExceeded`` or
``Shutdown``, a ``LeaseLost``) can land between any two bytecodes. So they
take no lock: each changes shared state with one operation that is atomic
under the GIL (a dict insert, an attribute store, a ``SimpleQueue.put``), and
both are idempotent, so a caller interrupted midway can call again. The two
heartbeat threads do everything else, including the ``held`` gauge and the
hold-time histogram, which therefore can never be left half counted.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from itertools import islice

from . import tracing
from .errors import LeaseUnavailableError
from .lease import Lease, LostReason, Renewal, declare_lost
from .metrics import NULL_METRICS, LeaseMetrics
from .store import Leases

logger = logging.getLogger(__name__)

#: Called with the lease and the reason when a tracked lease is lost. Runs on a heartbeat thread.
LostCallback = Callable[[Lease, LostReason], None]

#: Shortest pause before retrying a failed renewal, in seconds.
MIN_RETRY_DELAY = 0.05

#: Longest sleep of an idle heartbeat thread, in seconds: threads wake by
#: themselves this often, so a lease due later needs no wake-up call.
IDLE_WAKE = 1.0

#: A renewal round in flight for longer than the shortest interval among its
#: leases, and at least this long (seconds), is too slow for them: the watchdog
#: starts another renewer, well before any of those leases reaches its deadline
#: (a socket timeout longer than a TTL would come too late). The slow round
#: still reports its outcome when it ends; its thread then exits.
MIN_HUNG_AFTER = 0.25


class _Entry:
    """One tracked lease. Worker threads write only ``ended_at`` and ``ends_by``; heartbeat threads the rest."""

    __slots__ = ("context", "counted", "ended_at", "ends_by", "lease", "next_due", "on_lost", "started")

    def __init__(self, lease: Lease, on_lost: LostCallback) -> None:
        self.lease = lease
        self.on_lost = on_lost
        # The span current where the lease was tracked (its run): renewal spans link to it.
        self.context = tracing.current_context()
        self.started = time.monotonic()
        self.next_due = self.started + lease.interval / 1000
        self.ended_at: float | None = None
        # Renewed until then at the latest (monotonic): see Heartbeat.renew_until.
        self.ends_by = math.inf
        self.counted = False


_instances: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for heartbeat in list(_instances):
        heartbeat._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Heartbeat:
    """Renews the leases of this process until they are untracked.

    Parameters:
      leases: the store the leases came from.
      metrics: where renewals, rounds, losses, held leases and hold times are reported.

    Call :meth:`start` from a thread that no asynchronous exception can reach
    (the middleware does it at worker boot); :meth:`track` starts the threads
    itself if nobody did. After a ``fork()`` the child starts empty: the
    leases belong to the parent.
    """

    def __init__(self, leases: Leases, *, metrics: LeaseMetrics = NULL_METRICS) -> None:
        self.leases = leases
        self.metrics = metrics
        self._reset()
        _instances.add(self)

    def _reset(self) -> None:
        # token -> entry. Worker threads only insert; heartbeat threads remove.
        self._entries: dict[str, _Entry] = {}
        # Between the heartbeat's own threads (and stop()): never taken on a worker thread.
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._stopping = False
        self._renewer: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._renewer_wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._watchdog_wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        # When each thread will next wake by itself (0: awake): a lease due later needs no wake-up call.
        self._renewer_wakes_at = 0.0
        self._watchdog_wakes_at = 0.0
        # When the renewal round in flight started (0: none), and after how long it counts as hung.
        self._round_started = 0.0
        self._round_hung_after = math.inf

    # Public API ------------------------------------------------------------

    def start(self) -> None:
        """Start the renewer and the watchdog if they are not running."""
        with self._start_lock:
            self._stopping = False
            if self._renewer is None or not self._renewer.is_alive():
                self._spawn_renewer()
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(target=self._watch_loop, name="dramatiq-leases-watchdog", daemon=True)
                self._watchdog.start()

    def track(self, lease: Lease, on_lost: LostCallback) -> None:
        """Renew ``lease`` every ``lease.interval`` ms until :meth:`untrack`; call ``on_lost`` if it is lost.

        The span current here (the run holding the lease) is remembered: the
        spans of the rounds renewing the lease link to it.

        Safe on a thread that can be interrupted: calling it again for the
        same lease after an interruption changes nothing.
        """
        if self._renewer is None or self._stopping:
            self.start()
        entry = self._entries.get(lease.token)
        if entry is None:
            entry = _Entry(lease, on_lost)
            entry = self._entries.setdefault(lease.token, entry)  # one atomic insert
        if entry.next_due < self._renewer_wakes_at:
            self._renewer_wake.put(None)
        if lease.valid_until < self._watchdog_wakes_at:
            self._watchdog_wake.put(None)

    def untrack(self, lease: Lease) -> bool:
        """Stop renewing ``lease``. Returns ``False`` if it was not tracked (already lost or untracked).

        Safe on a thread that can be interrupted, and idempotent: the lease
        is marked ended with one store; a heartbeat thread removes it.
        """
        entry = self._entries.get(lease.token)
        if entry is None or entry.ended_at is not None:
            return False
        entry.ended_at = time.monotonic()
        return True

    def renew_until(self, lease: Lease, deadline: float) -> bool:
        """Renew ``lease`` until :meth:`untrack`, but not past ``deadline`` (``time.monotonic()``): then it is
        untracked as if :meth:`untrack` had been called at ``deadline``. Returns ``False`` if it was not tracked.

        For a lease whose holder is done but whose release another thread sends: kept alive until that
        release, and left to its TTL after ``deadline`` should the release never come. Safe on a thread
        that can be interrupted, and idempotent (the earliest deadline given stands): one store.
        """
        entry = self._entries.get(lease.token)
        if entry is None or entry.ended_at is not None:
            return False
        entry.ends_by = min(entry.ends_by, deadline)
        return True

    @property
    def running(self) -> bool:
        """Whether a heartbeat thread (the renewer or the watchdog) is alive."""
        return any(t is not None and t.is_alive() for t in (self._renewer, self._watchdog))

    def lose(self, lease: Lease, reason: LostReason) -> bool:
        """Declare a tracked lease lost now, as a renewal that found it gone would: stop, count, call back.

        For callers that learn of a loss elsewhere (a fenced write refused for
        a newer fence). Call it from a thread no asynchronous exception can
        reach. Returns ``False`` if ``lease`` is not tracked (or has ended).
        """
        with self._lock:
            entry = self._entries.get(lease.token)
            if entry is None or entry.ended_at is not None or not self._drop(entry, time.monotonic()):
                return False
        self._lose(entry, reason)
        return True

    def tracked(self) -> list[Lease]:
        """The leases being renewed now."""
        return [e.lease for e in list(self._entries.values()) if e.ended_at is None]

    def stop(self, timeout: float = 5.0) -> list[Lease]:
        """Stop both threads; returns the leases that were still tracked (now untracked)."""
        self._stopping = True
        left = self.tracked()
        for lease in left:
            self.untrack(lease)
        self._renewer_wake.put(None)
        self._watchdog_wake.put(None)
        for thread in (self._renewer, self._watchdog):
            if thread is not None and thread is not threading.current_thread():
                # RuntimeError: a replacement the watchdog is starting right now; it sees the stop and ends at once.
                with contextlib.suppress(RuntimeError):
                    thread.join(timeout)
        self._sweep()
        return left

    # Shared by both threads ----------------------------------------------------

    def _spawn_renewer(self) -> None:
        # Assigned before start(): the new thread checks that it is the current renewer.
        thread = threading.Thread(target=self._renew_loop, name="dramatiq-leases-heartbeat", daemon=True)
        self._renewer = thread
        thread.start()

    def _sweep(self) -> list[_Entry]:
        """Drop ended entries (and those past their :meth:`renew_until`), count new ones; return the live entries."""
        live: list[_Entry] = []
        now = time.monotonic()
        with self._lock:
            for entry in list(self._entries.values()):
                ends_by = entry.ends_by
                if entry.ended_at is None and ends_by <= now:
                    entry.ended_at = ends_by
                ended_at = entry.ended_at
                if ended_at is not None:
                    self._drop(entry, ended_at)
                    continue
                if not entry.counted:
                    entry.counted = True
                    self.metrics.held(entry.lease.meta, 1)
                live.append(entry)
        return live

    def _drop(self, entry: _Entry, at: float) -> bool:
        """Remove ``entry`` (the caller holds ``_lock``); ``False`` if someone else already did."""
        if self._entries.get(entry.lease.token) is not entry:
            return False
        del self._entries[entry.lease.token]
        if entry.counted:
            self.metrics.held(entry.lease.meta, -1)
        self.metrics.hold(entry.lease.meta, max(0.0, at - entry.started))
        return True

    def _sleep(self, wake: queue.SimpleQueue[None], until: float) -> None:
        try:
            wake.get(timeout=max(0.0, until - time.monotonic()))
            while True:
                wake.get_nowait()  # wake-ups that piled up meanwhile
        except queue.Empty:
            pass

    # The renewer ---------------------------------------------------------------

    def _renew_loop(self) -> None:
        me = threading.current_thread()
        while not self._stopping and self._renewer is me:
            now = time.monotonic()
            if self._watchdog is not None and not self._watchdog.is_alive():
                logger.error("Heartbeat watchdog died; restarting it.")
                self.start()
            live = self._sweep()
            due_at = min((e.next_due for e in live), default=now + IDLE_WAKE)
            if due_at > now:
                self._renewer_wakes_at = due_at
                # A lease tracked after the sweep did not see the new wake time: look once more.
                if any(e.next_due < due_at and e.ended_at is None for e in list(self._entries.values())):
                    continue
                self._sleep(self._renewer_wake, due_at)
                self._renewer_wakes_at = 0.0
                continue
            # Renew everything due within half an interval too: fewer, fuller rounds.
            batch = [e for e in live if e.next_due <= now + e.lease.interval / 2000]
            try:
                self._round(batch, me)
            except Exception:
                logger.exception("Heartbeat round failed; retrying.")
                for e in batch:
                    e.next_due = time.monotonic() + MIN_RETRY_DELAY

    def _round(self, batch: list[_Entry], me: threading.Thread) -> None:
        started = time.monotonic()
        self._round_hung_after = max(MIN_HUNG_AFTER, min(e.lease.interval for e in batch) / 1000)
        self._round_started = started
        if started + self._round_hung_after < self._watchdog_wakes_at:
            self._watchdog_wake.put(None)  # so it can tell if this round hangs
        try:
            links = list(islice((e.context for e in batch if e.context is not None), tracing.MAX_LINKS))
            results = self.leases.renew_many([e.lease for e in batch], links=links)
            failed = results.count(Renewal.ERROR)
            if failed:  # some hash slots of a Redis Cluster did not answer, or too few replicas acknowledged
                self.metrics.redis_error("renew")
                logger.warning(
                    "Could not renew %d of %d lease(s): their hash slots did not answer, or fewer "
                    "replicas than min_replicas acknowledged the round in time.",
                    failed,
                    len(batch),
                )
        except LeaseUnavailableError as e:
            self.metrics.redis_error("renew")
            logger.warning("Could not renew %d lease(s): %s", len(batch), e)
            results = [Renewal.ERROR] * len(batch)
        finally:
            if self._renewer is me:
                self._round_started = 0.0
        # A round that was too slow and replaced meanwhile still applies what it learnt: a
        # confirmation is true whenever it arrives, and a lease found gone or stolen stays lost.
        finished = time.monotonic()
        self.metrics.renew_round(finished - started)
        lost: list[tuple[_Entry, LostReason]] = []
        with self._lock:
            for entry, result in zip(batch, results):
                if entry.ended_at is not None or self._entries.get(entry.lease.token) is not entry:
                    continue  # untracked or lost meanwhile: this outcome no longer matters
                if result is Renewal.OK:
                    entry.next_due = finished + entry.lease.interval / 1000
                elif result is Renewal.ERROR:
                    # Retry sooner; the watchdog ends it if Redis stays away past its deadline.
                    entry.next_due = finished + max(MIN_RETRY_DELAY, entry.lease.interval / 4000)
                else:
                    self._drop(entry, finished)
                    lost.append((entry, _LOST[result]))
                self.metrics.renewal(entry.lease.meta, "lost" if result in _LOST else result.value)
        for entry, reason in lost:
            self._lose(entry, reason)

    # The watchdog --------------------------------------------------------------

    def _watch_loop(self) -> None:
        me = threading.current_thread()
        while not self._stopping and self._watchdog is me:
            try:
                self._watch()
            except Exception:
                logger.exception("Heartbeat watchdog round failed; going on.")
                time.sleep(MIN_RETRY_DELAY)

    def _watch(self) -> None:
        """One watchdog round: replace a dead or too-slow renewer, declare overdue leases lost, sleep."""
        now = time.monotonic()
        live = self._sweep()
        expired: list[_Entry] = []
        with self._lock:
            for e in live:
                if e.lease.valid_until <= now and self._drop(e, now):
                    expired.append(e)
        for e in expired:
            self._lose(e, LostReason.MAX_HOLD if now >= e.lease.hold_until else LostReason.UNREACHABLE)
        self._mind_renewer(now)  # after the losses: it logs, and a log handler can block
        deadline = min((e.lease.valid_until for e in live if e.lease.valid_until > now), default=math.inf)
        wake_at = min(now + IDLE_WAKE, deadline)
        started = self._round_started
        if started:
            wake_at = min(wake_at, started + self._round_hung_after)
        self._watchdog_wakes_at = wake_at
        # A lease tracked after the sweep did not see the new wake time: look once more.
        if any(e.lease.valid_until < wake_at and e.ended_at is None for e in list(self._entries.values())):
            return
        self._sleep(self._watchdog_wake, wake_at)
        self._watchdog_wakes_at = 0.0

    def _mind_renewer(self, now: float) -> None:
        renewer = self._renewer
        if renewer is None or self._stopping:
            return
        started = self._round_started  # read once: the renewer resets it when its round ends
        if not renewer.is_alive():
            logger.error("Heartbeat thread died; restarting it.")
        elif started and now - started > self._round_hung_after:
            logger.warning(
                "A lease renewal has been in flight for %.1fs, longer than its leases' renew interval; "
                "starting a new heartbeat thread.",
                now - started,
            )
        else:
            return
        self._round_started = 0.0
        with self._start_lock:
            self._spawn_renewer()

    def _lose(self, entry: _Entry, reason: LostReason) -> None:
        lease = entry.lease
        # The holder is told before anything is logged: a log handler can block (a full stderr pipe, a
        # stalled log shipper), and the loss must not wait on it.
        try:
            entry.on_lost(
                lease, reason
            )  # before declare_lost(): whoever reads remaining() == 0 next finds the reason set
        except Exception:
            logger.exception("Lost-lease callback failed for %r.", lease.key)
        finally:
            declare_lost(lease)
            logger.error("Lease %r (fence %d) lost: %s.", lease.key, lease.fence, reason.description)
            self.metrics.lost(lease.meta, reason.value)


_LOST = {Renewal.GONE: LostReason.GONE, Renewal.STOLEN: LostReason.STOLEN, Renewal.MAX_HOLD: LostReason.MAX_HOLD}
