"""The runs of one worker process: which thread runs which message under which lease, and how each ends."""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ..core.errors import LeaseStateError, LeaseUnavailableError
from ..core.heartbeat import Heartbeat
from ..core.lease import Lease
from ..core.metrics import LeaseMetrics
from ..core.store import Leases
from .errors import RateLimited
from .guard import DONE, READY, LeaseLost, Run, call_under, coroutine_under
from .releasing import Releaser
from .waiting import waiter_id

logger = logging.getLogger(__name__)

#: How many times the releaser thread asks Redis for one release, and the first pause between two (s; then
#: four times longer): a connection gone stale while the thread was idle costs a pause, not the key's TTL.
RELEASE_TRIES = 3
RELEASE_PAUSE_S = 0.05

_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("dramatiq_leases_current", default=None)

_DIRECT = object()  # marks a call of the actor outside a worker's message


def current_lease() -> Lease:
    """The lease held by the running actor (works in sync and async actors).

    Raises:
      LeaseStateError: outside an actor that holds a lease (a ``RuntimeError`` too).
    """
    lease = _current.get()
    if lease is None:
        raise LeaseStateError("current_lease() was called outside an actor that holds a lease (is lock_key set?)")
    return lease


class Runs:
    """Each worker thread's current :class:`Run`, and the ending of runs (stop renewing, release).

    A thread maps to ``None`` while its lease is being asked for: the guarded
    actor refuses to run then, because Dramatiq swallows unexpected errors
    from ``before_process_message`` and would run the actor anyway.
    """

    def __init__(self, leases: Leases, heartbeat: Heartbeat, metrics: LeaseMetrics) -> None:
        self.leases = leases
        self.heartbeat = heartbeat
        self.metrics = metrics
        self._runs: dict[int, Run | None] = {}
        # Token -> run of an async actor whose coroutine outlived the worker's wait: its lease is kept.
        self._deferred: dict[str, Run] = {}
        self.releaser: Releaser[tuple[Run, bool]] = Releaser(self.send_release)

    def pending(self) -> None:
        """This thread is asking for a lease: its actor must not run yet. Ends a stale run first."""
        thread_id = threading.get_ident()
        stale = self._runs.get(thread_id)
        if stale is not None:
            self.end(stale)  # a previous message's after-hooks never ran (interrupted): end its hold now
        self._runs[thread_id] = None

    def unleased(self) -> None:
        """This thread's message has no lease to hold (its actor has no ``lock_key``)."""
        self._runs.pop(threading.get_ident(), None)

    def register(self, run: Run) -> None:
        """``run`` is this thread's, from before its lease is asked for (it can be released by token)."""
        self._runs[run.thread_id] = run

    def not_granted(self) -> None:
        """This thread's lease was refused (busy): there is nothing to release, and the actor must not run."""
        self._runs[threading.get_ident()] = None

    def granted(self, run: Run, lease: Lease) -> None:
        """``run``'s lease was granted: renew it, and expose it to :func:`current_lease`."""
        run.lease = lease
        _current.set(lease)
        self.heartbeat.track(lease, run.lost)

    def forget(self) -> None:
        """This thread's message is done (processed or skipped): end its run, if any."""
        run = self._runs.pop(threading.get_ident(), None)
        if run is not None:
            run.finish()
            self.end(run)
        _current.set(None)

    def active_tokens(self) -> set[str]:
        """Tokens of runs whose actor has not finished (or whose coroutine still runs)."""
        tokens = {r.token for r in list(self._runs.values()) if r is not None and r.state != DONE}
        return tokens | set(self._deferred)

    def shutdown(self) -> None:
        """At the worker's stop: release every lease this process holds for an actor no longer running.

        An actor still running (or about to) keeps its lease, renewed, until the process exits; it then
        expires within its TTL. Releasing it would let another worker run the same key while this one still does.
        """
        # The releases handed over by the worker threads first; any later one is sent by its own thread.
        self.releaser.stop()
        # Not only running actors: one still being set up (its lease taken, its actor about to start) too.
        running = self.active_tokens()
        for lease in self.heartbeat.tracked():
            if lease.token in running:
                logger.warning(
                    "Actor holding lease %r is still running at shutdown; the lease is kept until "
                    "this process exits, then expires within %d ms.",
                    lease.key,
                    lease.ttl,
                )
                continue
            self.heartbeat.untrack(lease)
            try:
                self.leases.release(lease)
            except Exception as e:
                logger.warning("Could not release lease %r at shutdown: %s.", lease.key, e)
        if not running:
            self.heartbeat.stop()

    def guarded(
        self, fn: Callable[..., Any], rate_limited: Callable[[Run, RateLimited], NoReturn] | None = None
    ) -> Callable[..., Any]:
        """Wrap an actor's function so it runs only under its message's lease, released the moment it returns.

        ``rate_limited``: what becomes of a delivery whose actor raised :class:`RateLimited` (its lease released
        with a hold, as :meth:`end` does): it must not return (the middleware sends the message back and skips
        the delivery); without it, the exception fails the message as any other.
        """
        runs = self._runs
        end = self.end

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            run = runs.get(threading.get_ident(), _DIRECT)
            if run is _DIRECT:
                return fn(*args, **kwargs)  # called directly, not by a worker
            if run is None:
                raise LeaseLost("the actor was about to run without its lease; refusing (see the log)")
            assert isinstance(run, Run)
            if run.state is not READY:
                return fn(*args, **kwargs)  # a direct call from inside the running actor
            if rate_limited is None:
                return call_under(run, fn, args, kwargs, end)
            try:
                return call_under(run, fn, args, kwargs, end)
            except RateLimited as e:
                rate_limited(run, e)

        return guarded

    def tracking_coroutine(self, async_fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap an async actor's function so its coroutine keeps the lease until it ends, even past the wait."""
        runs = self._runs
        end = self.end

        @functools.wraps(async_fn)
        def start(*args: Any, **kwargs: Any) -> Any:
            run = runs.get(threading.get_ident())
            coro = async_fn(*args, **kwargs)
            return coroutine_under(run, coro, end) if isinstance(run, Run) else coro

        return start

    def end(self, run: Run) -> None:
        """Hand the release over to the releaser (:mod:`.releasing`), which stops the renewals as it sends it;
        or, for an actor that raised (or ``release_inline``), stop renewing and release here. Idempotent, and
        never raises but for an interruption.

        Nothing after a completed actor may turn it into a failure: any error
        here is logged, and the lease then ends by its TTL. While an async
        actor's coroutine still runs (it ignored cancellation), the lease is
        kept, renewed, and ended when the coroutine ends.
        """
        with run.lock:
            if run.coroutine_running:
                run.end_deferred = True
                self._deferred[run.token] = run
                return
        self._deferred.pop(run.token, None)
        lease = run.lease
        handed = bool(run.returned) and not run.release_inline
        if lease is not None:
            if handed:
                # Renewed until the releaser sends its release (it untracks it then): a release queued or slow
                # past the TTL would find the lease expired, and skip the waiter's 'done' record and the
                # line's wake-up. Not past one more TTL, should the releaser never send it. (Called again, the
                # earliest deadline stands; once released, the lease is no longer tracked.)
                self.heartbeat.renew_until(lease, time.monotonic() + lease.ttl / 1000)
            else:
                self.heartbeat.untrack(lease)
        if run.released:
            return
        first_try = not run.release_tried
        run.release_tried = True
        # An actor that returned: handed over, not waited for (see .releasing). One that raised is released
        # here and now: Retries, after this, sends its retry, which must never find this grant still held;
        # so is one whose message's ack reads its lease (see Run.release_inline). Interrupted before
        # `released` is set, it is released again: the second release finds the grant already released, and
        # says nothing of it.
        if handed:
            self.releaser.submit((run, first_try))
        else:
            self.send_release((run, first_try), tries=1)
        run.released = True

    def send_release(self, item: tuple[Run, bool], *, tries: int = RELEASE_TRIES) -> None:
        """Release ``run``'s lease in Redis (the releaser's ``send``): log and count a failure, never raise.

        An attempt Redis could not be asked for (a connection gone stale while idle, a server restarted) is
        made again after a short pause, ``tries`` in all: a release is owner-checked, so one applied whose
        reply was lost is then found released by its fence, and frees nothing else.
        """
        run = item[0]
        if run.release_sent:
            # Handed over twice: an interruption landed in end() after the first hand-over, before `released`
            # was set. The releaser thread sends one release, logged and counted once.
            return
        self._send_release(item, tries)
        # Not set if an interruption cut an inline release short: end() then sends it again.
        run.release_sent = True

    def _send_release(self, item: tuple[Run, bool], tries: int) -> None:
        run, first_try = item
        lease = run.lease
        if lease is not None:
            self.heartbeat.untrack(lease)  # renewed until now if it was handed over (see end)
        for attempt in range(tries):
            try:
                released = self._release(run)
            except LeaseUnavailableError as e:
                if attempt + 1 < tries:
                    first_try = False  # this attempt may have been applied
                    time.sleep(RELEASE_PAUSE_S * 4**attempt)
                    continue
                error: Exception = e
            except Exception as e:
                error = e
            else:
                if not released and first_try and lease is not None and run.lost_reason is None:
                    logger.warning("Lease %r (fence %d) was no longer held at release.", run.key, lease.fence)
                return
            break
        self.metrics.redis_error("release")
        # Never confirmed granted (the acquire failed too): released in case the grant was applied all the
        # same, quietly, since the acquire's failure was logged already.
        logger.log(
            logging.WARNING if lease is not None else logging.DEBUG,
            "Could not release lease %r: %s: %s. It expires within its TTL.",
            run.key,
            type(error).__name__,
            error,
        )

    def _release(self, run: Run) -> bool:
        """One release of ``run``'s grant by its token; whether it held it."""
        lease = run.lease
        # Only a run whose actor returned is remembered as done: a message that failed may be
        # re-driven from the dead-letter queue (same id, same retry count), and must then run.
        # A grant whose reply never came (lease None) is looked for by its token in every slot of the key.
        fence, slot = (lease.fence, lease.slot) if lease else (None, None)
        error = run.error
        if isinstance(error, RateLimited) and run.message is not None and not run.returned:
            # Held back, its message first in the line once the hold ends (see .held_back).
            waiter = waiter_id(run.message)
            run.held = self.leases.line.hold_back(
                run.key, run.token, hold=error.retry_after, waiter=waiter, fence=fence, slot=slot
            )
            return run.held
        if run.returned and run.waiter:
            return self.leases.line.release(run.key, run.token, waiter=run.waiter, fence=fence, slot=slot)
        return self.leases.release_token(run.key, run.token, fence=fence, slot=slot)
