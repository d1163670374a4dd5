"""One message's hold on its lease, and the call of its actor under that hold.

The worker thread and the heartbeat share a :class:`Run`. The heartbeat may
declare the lease lost at any instant and then interrupts the actor with
:class:`LeaseLost`, an asynchronous exception; the worker thread may itself be
interrupted by Dramatiq's ``TimeLimitExceeded`` or ``Shutdown`` at any
instant. Two rules follow:

* ``LeaseLost`` is injected only while the actor's function runs, and a
  pending one is cancelled the moment it returns (both under the run's lock,
  a C lock, which an interruption cannot leave held).
* Whether the actor *returned* is decided by C code, not by a bytecode of
  ours: the function is called through ``list.extend`` over ``starmap``, so
  its return value is stored before any instruction of the guard runs. An
  interruption landing after that is absorbed; one landing inside the
  function fails the message as usual.

CPython delivers asynchronous exceptions only at calls, function entries and
backward jumps; the bookkeeping after the actor is written without backward
jumps and retried a bounded number of times, once per interrupt source.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from dramatiq.middleware import Interrupt
from dramatiq.threading import raise_thread_exception

from ..core.interrupts import cancel_async_exc
from ..core.lease import Lease, LostReason

READY, RUNNING, DONE = "ready", "running", "done"


class LeaseLost(Interrupt):
    """Raised inside an actor whose lease was lost while it ran.

    The actor stops and the message fails like any other exception (Retries
    retries it). It never reaches an actor that has already returned.

    Attributes:
      key: the lease key.
      fence: the fence of the grant that was lost (0 if it was never granted).
      reason: the :class:`LostReason`, or ``None`` when the actor was refused before it started.
    """

    def __init__(self, *args: object, key: str | None = None, fence: int = 0, reason: LostReason | None = None) -> None:
        super().__init__(*args)
        self.key = key
        self.fence = fence
        self.reason = reason


def _lease_lost_with(detail: str, key: str, fence: int, reason: LostReason | None) -> type[LeaseLost]:
    """A LeaseLost subclass that carries its details: an exception raised in another thread is given as a class."""

    class DetailedLeaseLost(LeaseLost):
        def __init__(self, *args: object) -> None:
            super().__init__(*(args or (detail,)), key=key, fence=fence, reason=reason)

    DetailedLeaseLost.__name__ = DetailedLeaseLost.__qualname__ = "LeaseLost"
    return DetailedLeaseLost


class Run:
    """One message's hold on its lease, shared by its worker thread and the heartbeat.

    Created, with its token, before the lease is asked for: whatever
    interrupts the worker after that, the message's after-hook can still
    release by token.
    """

    __slots__ = (
        "coroutine_running",
        "end_deferred",
        "error",
        "held",
        "injected",
        "key",
        "lease",
        "lock",
        "lost_reason",
        "message",
        "release_inline",
        "release_sent",
        "release_tried",
        "released",
        "returned",
        "state",
        "thread_id",
        "token",
        "waiter",
    )

    def __init__(self, key: str, token: str, thread_id: int) -> None:
        self.key = key
        self.token = token
        self.thread_id = thread_id
        self.lease: Lease | None = None
        # Its id in the key's line, if it waited there (see dramatiq_leases.core.line).
        self.waiter: str | None = None
        # The delivery it runs (its waiter id in the line is the message's, waited there or not).
        self.message: Any = None
        # What the actor raised, if it did: a RateLimited holds the key back at the release; `held` once it did.
        self.error: BaseException | None = None
        self.held = False
        # What the actor returned, stored by C code the instant it returns: empty if it never did
        # (it raised, was interrupted, or never ran). Only a run that returned is remembered as done.
        self.returned: list[Any] = []
        self.lock = threading.Lock()
        self.state = READY
        self.lost_reason: LostReason | None = None
        self.injected = False
        self.release_tried = False
        # Set once a release of the run was sent to the end (Runs.send_release): a second copy sends nothing.
        self.release_sent = False
        self.released = False
        # Released by the worker thread itself, not handed to the releaser (see Runs.end).
        self.release_inline = False
        # An async actor's coroutine may outlive the worker's wait for it (Dramatiq gives up after 1 s
        # of ignored cancellation): the lease is then ended by the coroutine's own end.
        self.coroutine_running = False
        self.end_deferred = False

    def begin(self) -> None:
        """Enter the actor; raises :class:`LeaseLost` if the lease can no longer be trusted."""
        with self.lock:
            lease = self.lease
            if self.lost_reason is None and (lease is None or lease.remaining() <= 0):
                past_hold = lease is not None and time.monotonic() >= lease.hold_until
                self.lost_reason = LostReason.MAX_HOLD if past_hold else LostReason.UNREACHABLE
            if self.lost_reason is not None:
                self.state = DONE
                raise LeaseLost(
                    self.describe(), key=self.key, fence=lease.fence if lease else 0, reason=self.lost_reason
                )
            self.state = RUNNING

    def finish(self) -> None:
        """Leave the actor: no LeaseLost may reach this thread from now on. Idempotent."""
        with self.lock:
            self.state = DONE
            if self.injected:
                # Cancel a LeaseLost injected but not yet delivered: the actor has finished.
                cancel_async_exc(self.thread_id)

    def lost(self, lease: Lease, reason: LostReason) -> None:
        """The heartbeat's callback: record the loss, and interrupt the actor if it is running."""
        with self.lock:
            self.lost_reason = reason
            if self.state == RUNNING and not self.injected:
                self.injected = True
                lost = _lease_lost_with(self.describe(), self.key, lease.fence, reason)
                raise_thread_exception(self.thread_id, lost)  # type: ignore[no-untyped-call]

    def describe(self) -> str:
        """What happened to the lease, for ``LeaseLost`` and logs."""
        fence = self.lease.fence if self.lease is not None else 0
        reason = self.lost_reason
        if reason is None:
            return f"lease {self.key!r} (fence {fence}) was lost"
        return f"lease {self.key!r} (fence {fence}) was lost: {reason.value} ({reason.description})"


async def coroutine_under(run: Run, coro: Coroutine[Any, Any, Any], end: Callable[[Run], None]) -> Any:
    """Await an async actor's coroutine; if the worker stopped waiting for it meanwhile, end ``run`` here."""
    with run.lock:
        run.coroutine_running = True
    try:
        return await coro
    finally:
        with run.lock:
            run.coroutine_running = False
            deferred = run.end_deferred
        if deferred:
            end(run)


def call_under(
    run: Run, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], end: Callable[[Run], None]
) -> Any:
    """Call ``fn`` while ``run`` holds its lease, then ``end(run)``; return what ``fn`` returned.

    ``end`` must be idempotent: it is called again if an interruption lands
    in it. An interruption that lands after ``fn`` returned never fails the
    call; one raised inside ``fn`` propagates as ``fn``'s own exception.
    """
    out = run.returned
    error: BaseException | None = None
    try:
        run.begin()
        # C code calls fn and stores its result: no bytecode of ours runs in between.
        out.extend(itertools.starmap(functools.partial(fn, **kwargs) if kwargs else fn, (args,)))
    except BaseException as e:
        error = e
        run.error = e  # no call in between: the release reads it
    # Settle: each level absorbs one interruption (there are few sources: our LeaseLost, which
    # finish() cancels, TimeLimit's and Shutdown's). No loop: a backward jump is a delivery point.
    try:
        run.finish()
        end(run)
    except BaseException as e1:
        error = error if error is not None or out else e1
        try:
            run.finish()
            end(run)
        except BaseException as e2:
            error = error if error is not None or out else e2
            try:
                run.finish()
                end(run)
            except BaseException as e3:
                error = error if error is not None or out else e3
                try:
                    run.finish()
                    end(run)
                except BaseException as e4:  # a fourth: give up settling here; the after-hook ends the run
                    error = error if error is not None or out else e4
    if out:
        return out[0]
    assert error is not None
    raise error
