"""A lease for a process that must run alone: a scheduler in every container, exactly one of them active.

:class:`Leader` stands by until it holds its key, renews it with a heartbeat of its own, and tells the
process when it loses it, in time: no later than the lease's local deadline (``ttl - margin`` after the
last renewal Redis confirmed), while the key still has ``margin`` ms to live on the server, so a
deposed leader has stopped before any other process can be granted the key: unless it was paused past that
deadline, or Redis forgot the grant (a restart without persistence, a failover); docs/guarantees.md says
what holds then. It sits on the lease core alone (no Dramatiq, no middleware).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType, TracebackType
from typing import Any, Literal

from ._descendants import kill_descendants
from .core.errors import LeaseConfigError, LeaseStateError, LeaseUnavailableError
from .core.heartbeat import Heartbeat
from .core.info import meta_args
from .core.interrupts import cancel_async_exc
from .core.keys import validate_key
from .core.lease import Busy, Lease, LostReason, new_token
from .core.numbers import whole_ms
from .core.store import Leases

logger = logging.getLogger(__name__)

#: The exit code of a process whose leader lease was lost with ``on_lost="exit"``: 75, ``EX_TEMPFAIL`` of
#: sysexits.h ("try again later"): a supervisor that restarts the process puts it back in standby.
EXIT_CODE = 75

#: The shortest TTL a leader may have, in ms: below it, one slow renewal round is already a loss.
MIN_TTL = 100

#: The signal that wakes the main thread to raise :class:`LeaderLost` in it. SIGURG: its default action is to
#: be ignored, so one arriving after the handler was put back harms nothing, and programs rarely use it.
_SIGNAL: int | None = getattr(signal, "SIGURG", None)

#: How long the SIGURG handler has to take a LeaderLost before it is raised asynchronously instead: the signal
#: reaches a running main thread within a switch interval (5 ms), one blocked in a call at once.
_SIGNAL_GRACE_S = 0.05

#: How long an exiting leader waits for its last log line (and the flush of stdout and stderr) at most.
_LAST_WORDS_S = 0.05

#: What to do when leadership is lost: ``"raise"``, ``"exit"`` or a function called with the lease and the reason.
OnLost = Literal["raise", "exit"] | Callable[[Lease, LostReason], None]

_NO_HANDLER = object()  # no signal handler of ours to put back

# One SIGURG handler, _dispatch, serves every Leader held in the main thread, however many and in whatever
# order they are released or lost: the handler it replaced is kept once, here, and put back when the last
# of them is done (a chain of handlers, one per Leader, lost its head when the outer one went first).
_users: list[Leader] = []  # the Leaders held in the main thread that rely on _dispatch (append/remove: atomic)
_previous: Any = _NO_HANDLER  # the handler _dispatch replaced, called for the SIGURGs that are not ours
_spent: list[None] = []  # signals whose LeaderLost went asynchronously (see Leader._escalate): not passed on


class LeaderLost(BaseException):
    """Raised in the thread that entered a :class:`Leader`'s ``with`` (``on_lost="raise"``) when it lost the key.

    A ``BaseException``, as ``KeyboardInterrupt``: a scheduler loop's ``except Exception`` around each job
    cannot swallow it and go on scheduling beside the new leader. Leaving the ``with`` puts the
    :class:`Leader` back to where it can stand by again.

    Attributes:
      key: the leader key.
      fence: the fence of the grant that was lost.
      reason: why (:class:`~dramatiq_leases.core.lease.LostReason`): gone, stolen, or unreachable.
    """

    def __init__(self, *args: object, key: str = "", fence: int = 0, reason: LostReason | None = None) -> None:
        super().__init__(*args)
        self.key = key
        self.fence = fence
        self.reason = reason


class Leader:
    """Hold ``key`` as this process's leadership: ``with Leader(leases, "scheduler", ttl=15_000) as leader:``.

    Entering the ``with`` stands by until this process is granted the key (every ``poll`` ms at most, and as
    soon as the holder's TTL runs out: a SIGKILLed leader is replaced within its TTL), then returns with the
    key held and renewed every ``ttl // 3`` ms on a heartbeat of its own. Leaving it releases the key
    (owner-checked; a ``with`` nested in another of the same Leader leaves it to the outer one), so a standby
    takes over at once.

    Losing the key (found gone or taken by another owner, or Redis unreachable until the lease's local
    deadline) is told no later than that deadline, ``ttl - margin`` after the last confirmed renewal, while
    the key still lives ``margin`` (a tenth of the TTL) on the server: the deadline is the watchdog's, which
    never waits on a hung socket. How depends on ``on_lost``:

    * ``"raise"`` (the default): :class:`LeaderLost` is raised in the thread that entered the ``with`` (or
      last called :meth:`wait`). In the main thread it is raised by a handler of ``SIGURG``, installed for
      the time the key is held and sent to that thread alone: a signal interrupts a blocking ``time.sleep``,
      ``Event.wait`` or socket read at once, where an asynchronous exception would wait for it to return.
      (The handler calls a previous Python handler for SIGURGs that are not its own.) In another thread it is
      an asynchronous exception (``PyThreadState_SetAsyncExc``, as Dramatiq's time limits): it lands at that
      thread's next Python instruction, so such a thread should not block for long.
    * ``"exit"``: every process this one started (and theirs) is killed, then the process ends at once with
      ``os._exit(exit_code)`` (default :data:`EXIT_CODE`, 75): nothing of it runs on, for a supervisor
      (Docker, Kubernetes, systemd) to restart into standby. A loop that saw the loss and stands by again
      meanwhile is not granted the key: its :meth:`wait` blocks until the exit. ``kill_children=False``
      leaves the children running; a process that left the tree before (a double-forked daemon), or that
      another thread starts after the last look at the tree, is out of reach either way.
    * a function ``on_lost(lease, reason)``: called on the heartbeat's thread; the process must stop acting
      as leader itself (:attr:`is_leader` is already ``False``).

    Parameters:
      leases: the store of the key.
      key: the leader key, such as ``"scheduler"``.
      ttl: the lease's TTL in whole milliseconds (at least 100): how long a dead leader keeps the key.
      on_lost: how a loss is told: ``"raise"``, ``"exit"`` or a function (see above).
      poll: the longest a standby waits between two asks, in whole ms (default ``ttl // 3``).
      meta: holder metadata stored with the lease (strings), besides ``host`` and ``pid``.
      exit_code: the exit code of ``on_lost="exit"`` (1 to 255; default 75).
      kill_children: with ``on_lost="exit"``, SIGKILL this process's descendants before it exits (Linux,
        found in ``/proc``; default ``True``).

    Raises:
      LeaseConfigError: an argument that cannot work, named with its value (checked here, before Redis).
      LeaseKeyError: an empty key.

    Attributes:
      key, ttl, poll: as given.

    Example:
      >>> with Leader(leases, "scheduler", ttl=15_000) as leader:
      ...     run_scheduler(fence=leader.fence)  # LeaderLost is raised here if the key is lost
    """

    def __init__(
        self,
        leases: Leases,
        key: str,
        *,
        ttl: int,
        on_lost: OnLost = "raise",
        poll: int | None = None,
        meta: Mapping[str, str] | None = None,
        exit_code: int = EXIT_CODE,
        kill_children: bool = True,
    ) -> None:
        if not isinstance(leases, Leases):
            raise LeaseConfigError(f"Leader: leases must be a dramatiq_leases.Leases, got {type(leases).__name__}")
        self.key = validate_key(key, what="Leader key")
        owner = f"Leader {key!r}"
        self.ttl = whole_ms(ttl, "ttl", minimum=MIN_TTL, owner=owner)
        self.poll = max(1, self.ttl // 3) if poll is None else whole_ms(poll, "poll", owner=owner)
        if on_lost not in ("raise", "exit") and not callable(on_lost):
            raise LeaseConfigError(f"{owner}: on_lost must be 'raise', 'exit' or a function, got {on_lost!r}")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 1 <= exit_code <= 255:
            raise LeaseConfigError(f"{owner}: exit_code must be a whole number from 1 to 255, got {exit_code!r}")
        if not isinstance(kill_children, bool):
            raise LeaseConfigError(f"{owner}: kill_children must be True or False, got {kill_children!r}")
        self._meta = dict(meta or {})
        meta_args(key, self._meta)  # refused here rather than at the first grant
        if 0 < leases.failover_grace < self.ttl:  # the grace covers holders of its length only
            logger.warning(
                "%s: ttl=%d is longer than the store's failover_grace=%d: after a failover, a standby may be "
                "granted the key while a leader the store forgot still leads",
                owner,
                self.ttl,
                leases.failover_grace,
            )
        self._leases = leases
        self._on_lost = on_lost
        self._exit_code = exit_code
        self._kill_children = kill_children
        self._heartbeat = Heartbeat(leases)
        # Between the heartbeat's thread (a loss) and the holding thread (release): who is told, once.
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._last: Lease | None = None
        self._reason: LostReason | None = None
        self._target = 0  # the thread told with "raise"
        self._thread: threading.Thread | None = None  # its Thread: an ended thread's ident can be reused
        self._by_signal = False  # told by our SIGURG handler (the main thread), else by an asynchronous exception
        self._armed = False
        self._injected = False  # an asynchronous LeaderLost set on the target thread, perhaps not yet raised
        self._pending: list[LeaderLost] = []  # for the signal handler: list.pop/clear are atomic
        self._closing = threading.Event()
        # Set (for good) when a loss with on_lost="exit" is being acted on: the process is about to end, and
        # must not be granted the key again meanwhile by a loop that saw the loss and stood by again.
        self._exiting = False
        # Open `with` blocks on this Leader: a nested one (a helper entering it again) leaves the key to the
        # outermost, which still acts as leader; releasing at the inner exit would let another process lead too.
        self._entered = 0

    # State -------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Whether this process holds the key now and may rely on it (``False`` from the instant of a loss)."""
        lease = self._lease
        return lease is not None and lease.remaining() > 0

    @property
    def lease(self) -> Lease | None:
        """The lease held now, or ``None`` (standing by, released or lost)."""
        return self._lease

    @property
    def fence(self) -> int:
        """The fence of the current grant (of the last one, once lost or released): send it with what the
        leader does, so that a deposed leader's late work, carrying a smaller fence, can be refused.

        Raises:
          LeaseStateError: this leader was never granted the key.
        """
        lease = self._lease or self._last
        if lease is None:
            raise LeaseStateError(f"Leader {self.key!r} has not been granted its key: it has no fence yet")
        return lease.fence

    @property
    def lost_reason(self) -> LostReason | None:
        """Why the last grant was lost, or ``None`` (held, released, or never granted)."""
        return self._reason

    # Standby, hold, release ------------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Stand by until this process holds the key; ``False`` if ``timeout`` seconds passed first (or
        :meth:`release` was called from another thread meanwhile). ``True`` at once if it holds it already.

        Once granted, the key is renewed until :meth:`release` or a loss; with ``on_lost="raise"``, the
        thread whose call was granted the key is the one :class:`LeaderLost` is raised in (if that thread
        has ended by then, no thread is: :attr:`lost_reason` tells). Redis being unreachable while standing
        by is logged and asked again every ``poll``.
        """
        if self._lease is not None:
            return True
        deadline = math.inf if timeout is None else time.monotonic() + max(0.0, timeout)
        self._closing.clear()
        standby = _Standby()
        try:
            while True:
                if self._exiting:
                    threading.Event().wait()  # until os._exit ends the process
                got = self._ask(standby)
                if isinstance(got, Lease):
                    if self._closing.is_set():  # released from another thread while this ask was in flight
                        with contextlib.suppress(LeaseUnavailableError):
                            self._leases.release(got)
                        return False
                    self._hold(got)
                    return True
                delay = self.poll / 1000 if got is None else _busy_delay(got, self.poll / 1000)
                left = deadline - time.monotonic()
                if left <= 0 or self._closing.wait(min(delay, left)):
                    return False
        except BaseException:
            # Interrupted while asking (KeyboardInterrupt, a time limit): a grant made under this token is
            # released, whether or not its reply arrived.
            if self._lease is not None:
                self.release()  # granted and taken: nothing may stay held behind a failed wait
            else:
                with contextlib.suppress(LeaseUnavailableError):
                    self._leases.release_token(self.key, standby.token)
            raise

    def release(self) -> None:
        """Stop renewing and release the key (owner-checked), or stop standing by; idempotent.

        A release that cannot reach Redis is logged: the key then ends by its TTL.
        """
        self._closing.set()
        with self._lock:
            lease, self._lease = self._lease, None
            self._armed = False
            self._pending.clear()
            if self._injected:  # a LeaderLost not yet raised must not land in the code after the block
                cancel_async_exc(self._target)
                self._injected = False
        _uninstall(self)
        if lease is not None:
            self._heartbeat.untrack(lease)
        self._heartbeat.stop(timeout=0)  # its threads end by themselves; a hung renewal is not waited for
        if lease is None:
            # Never held, or lost: nothing to release. A lost lease is not asked for again either, so that
            # leaving the block after a loss never waits on Redis (the key ends by its TTL, soon after).
            return
        try:
            if self._leases.release(lease):
                logger.info("Leader %r: released the key (fence %d).", self.key, lease.fence)
        except LeaseUnavailableError as e:
            logger.warning("Leader %r: could not release the key (it ends by its TTL): %s", self.key, e)

    def __enter__(self) -> Leader:
        if not self.wait():
            raise LeaseStateError(f"Leader {self.key!r} was released while it stood by")
        self._entered += 1
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._entered = max(0, self._entered - 1)
        if self._entered == 0 or self._lease is None:  # the outermost block, or a loss to clean up after
            self.release()

    def __repr__(self) -> str:
        state = "leader" if self.is_leader else f"lost ({self._reason})" if self._reason else "not leader"
        return f"Leader(key={self.key!r}, ttl={self.ttl}, {state})"

    # Internals ---------------------------------------------------------------

    def _holder_meta(self) -> dict[str, str]:
        return {"host": socket.gethostname(), "pid": str(os.getpid()), **self._meta}

    def _ask(self, standby: _Standby) -> Lease | Busy | None:
        """One ask of a standby: the grant, the holder's answer, or ``None`` if Redis could not be asked."""
        if standby.unsure:
            with contextlib.suppress(LeaseUnavailableError):
                self._leases.release_token(self.key, standby.unsure)
            standby.unsure = ""  # else it ends by its TTL: nobody renews it
        try:
            got = self._leases.try_acquire(self.key, self.ttl, meta=self._holder_meta(), token=standby.token)
        except LeaseUnavailableError as e:
            if not standby.down:
                logger.warning("Leader %r: cannot ask for the key (standing by): %s", self.key, e)
            # Its grant may have been made, its reply lost: released at the next ask, under a new token.
            standby.down, standby.unsure, standby.token = True, standby.token, new_token()
            return None
        if isinstance(got, Busy):
            if standby.down:
                logger.info("Leader %r: Redis answers again.", self.key)
            if not standby.announced:
                logger.info("Leader %r: standing by (held by fence %d).", self.key, got.fence)
            standby.announced, standby.down = True, False
        return got

    def _hold(self, lease: Lease) -> None:
        """Take the grant: arm the loss signal for this thread, then let the heartbeat renew it."""
        target = threading.get_ident()
        main = target == threading.main_thread().ident
        by_signal = self._on_lost == "raise" and main and _install(self)
        with self._lock:
            self._lease = self._last = lease
            self._reason = None
            self._target = target
            self._thread = threading.current_thread()
            # Only the main thread runs signal handlers: another thread is told by an asynchronous exception.
            self._by_signal = by_signal
            self._armed = self._on_lost == "raise"
            self._injected = False
        self._heartbeat.track(lease, self._lost)
        logger.info("Leader %r: this process leads (fence %d).", self.key, lease.fence)

    def _lost(self, lease: Lease, reason: LostReason) -> None:
        """The heartbeat's callback (on its thread), at the latest at the lease's local deadline."""
        with self._lock:
            if self._lease is not lease:
                return  # released meanwhile: nobody is to be told
            self._exiting = self._on_lost == "exit"
            self._lease = None
            self._reason = reason
            armed, self._armed = self._armed, False
            if armed:
                self._raise_in_target(lease, reason)
        if self._on_lost == "exit":
            # The children first: they may act on the old fence, and the log write below may block.
            killed = kill_descendants() if self._kill_children else 0

            def last_words() -> None:
                logger.critical(
                    "Leader %r (fence %d) lost: %s; killed %d child processes; exiting with code %d.",
                    self.key,
                    lease.fence,
                    reason.description,
                    killed,
                    self._exit_code,
                )
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()

            # A log handler or a flush can block (a full pipe): the exit waits for them a moment at most.
            words = threading.Thread(target=last_words, name="dramatiq-leases-leader-exit", daemon=True)
            words.start()
            words.join(_LAST_WORDS_S)
            os._exit(self._exit_code)
        if callable(self._on_lost):
            self._on_lost(lease, reason)

    def _raise_in_target(self, lease: Lease, reason: LostReason) -> None:
        """Raise LeaderLost in the target thread (the caller holds ``_lock``)."""
        detail = f"leader lease {self.key!r} (fence {lease.fence}) was lost: {reason.value} ({reason.description})"
        if self._by_signal and _SIGNAL is not None:
            if self._handler_reaches_us():
                lost = LeaderLost(detail, key=self.key, fence=lease.fence, reason=reason)
                self._pending.append(lost)
                signal.pthread_kill(self._target, _SIGNAL)
                # The handler may be replaced between the check and the signal's arrival: if ours has not
                # taken the exception by then, it is raised asynchronously instead (one of the two, never both).
                timer = threading.Timer(_SIGNAL_GRACE_S, self._escalate, (lost, detail, lease.fence, reason))
                timer.daemon = True
                timer.start()
                return
            logger.warning(
                "Leader %r: the app replaced the SIGURG handler while it led (%r); LeaderLost is raised as an "
                "asynchronous exception instead.",
                self.key,
                signal.getsignal(_SIGNAL),
            )
            self._inject(detail, lease.fence, reason)
            # The app's handler, run by the signal, is where the exception lands if the thread is blocked in a
            # sleep or a read: the signal interrupts the call, the handler's first instruction raises it.
            signal.pthread_kill(self._target, _SIGNAL)
            return
        self._inject(detail, lease.fence, reason)

    def _inject(self, detail: str, fence: int, reason: LostReason) -> None:
        """Set LeaderLost as an asynchronous exception of the target thread (the caller holds ``_lock``)."""
        lost = _leader_lost_with(detail, self.key, fence, reason)
        thread = self._thread
        # A thread that ended (one that called wait() and returned) is gone: its ident may be another's now.
        done = 0
        if thread is not None and thread.is_alive() and thread.ident == self._target:
            done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), ctypes.py_object(lost))
        self._injected = done == 1
        if not self._injected:
            logger.error("Leader %r: the thread that held the key is gone; LeaderLost was not raised.", self.key)

    def _escalate(self, lost: LeaderLost, detail: str, fence: int, reason: LostReason) -> None:
        """The signal's LeaderLost still not taken after a grace: raise it asynchronously (a Timer's thread)."""
        with self._lock:
            try:
                self._pending.remove(lost)  # atomic, as the handler's pop: exactly one of the two takes it
            except ValueError:
                return  # raised by the handler, or cancelled by release
            _spent.append(None)  # the signal, if it still arrives, is ours: not passed on
            logger.warning(
                "Leader %r: the SIGURG handler did not take LeaderLost within %d ms; raised asynchronously.",
                self.key,
                _SIGNAL_GRACE_S * 1000,
            )
            self._inject(detail, fence, reason)

    def _handler_reaches_us(self) -> bool:
        """Whether a SIGURG now runs our handler (the app has not put one of its own over it)."""
        return _SIGNAL is not None and signal.getsignal(_SIGNAL) is _dispatch and self in _users


def _install(leader: Leader) -> bool:
    """Handle SIGURG in the main thread for ``leader`` while it holds the key (called on the main thread);
    whether the handler is ours."""
    global _previous
    if _SIGNAL is None or not hasattr(signal, "pthread_kill"):
        return False
    if signal.getsignal(_SIGNAL) is not _dispatch:
        try:
            # Over the app's handler, which replaced ours while another Leader led: that is the one to keep.
            _previous = signal.signal(_SIGNAL, _dispatch)
        except ValueError:  # not the main interpreter: the asynchronous exception it is
            return False
    if leader not in _users:
        _users.append(leader)
    return True


def _uninstall(leader: Leader) -> None:
    """``leader`` no longer relies on the handler: put the one it replaced back if no Leader does (on the main
    thread; from another, ours stays, passing SIGURGs on, until the main thread is done with it)."""
    global _previous
    with contextlib.suppress(ValueError):
        _users.remove(leader)
    if _users or _SIGNAL is None or threading.get_ident() != threading.main_thread().ident:
        return
    if signal.getsignal(_SIGNAL) is not _dispatch:
        return  # the app put a handler of its own over ours: it stays
    previous = _previous
    if previous is _NO_HANDLER or previous is None:  # None: a handler not set from Python, which cannot be put back
        return
    signal.signal(_SIGNAL, previous)
    _previous = _NO_HANDLER
    _spent.clear()  # a signal still on its way goes to the handler put back


def _dispatch(signum: int, frame: FrameType | None) -> None:
    """The SIGURG handler: raise a held Leader's pending LeaderLost, else pass the signal on (the main thread)."""
    for leader in list(_users):
        try:
            lost = leader._pending.pop()  # atomic, as _escalate's remove: exactly one of the two takes it
        except IndexError:
            continue
        _uninstall(leader)
        raise lost
    try:
        _spent.pop()
        return  # a signal of ours whose exception was raised asynchronously after the grace
    except IndexError:
        pass
    previous = _previous
    if callable(previous):
        previous(signum, frame)  # not ours


class _Standby:
    """What one :meth:`Leader.wait` knows between its asks."""

    __slots__ = ("announced", "down", "token", "unsure")

    def __init__(self) -> None:
        self.token = new_token()
        self.unsure = ""  # a token whose grant may have been made though its reply was lost
        self.announced = False
        self.down = False


def _busy_delay(busy: Busy, poll: float) -> float:
    """How long a standby waits before asking again: until the holder's TTL runs out, ``poll`` at most."""
    if busy.ttl_left < 0:
        return poll
    return min(poll, (busy.ttl_left + 5) / 1000)  # a few ms past the expiry, so the key is gone by then


def _leader_lost_with(detail: str, key: str, fence: int, reason: LostReason) -> type[LeaderLost]:
    """A LeaderLost subclass that carries its details: an exception raised in another thread is given as a class."""

    class DetailedLeaderLost(LeaderLost):
        def __init__(self, *args: object) -> None:
            super().__init__(*(args or (detail,)), key=key, fence=fence, reason=reason)

    DetailedLeaderLost.__name__ = DetailedLeaderLost.__qualname__ = "LeaderLost"
    return DetailedLeaderLost
