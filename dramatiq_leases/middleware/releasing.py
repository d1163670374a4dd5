"""Releases sent from a thread of their own, so a worker thread never waits for one's reply.

A release is owner-checked (by token, and by fence when known): sent late, or twice, it can never free
another holder's grant, and Dramatiq's ack of the message does not depend on it. So the worker thread whose
actor returned only hands the release over (one C-level ``put``, which an asynchronous exception cannot
split) and takes its next message; this process's releaser thread sends it at once. A key whose actor
returned is therefore free a moment after, not before, its message is acknowledged. (The release of an
actor that raised is sent by its worker thread, so that the retry Retries sends never finds it held; so is
a ``lock_unique`` actor's, whose record's end, at the ack, reads whether its lease is still held.)

A worker's stop sends every release handed over before the worker's ``after_worker_shutdown`` goes on;
a SIGKILL in between costs the key at most its TTL (docs/guarantees.md). A lease handed over is renewed
until its release is sent (``Runs.send_release`` untracks it), for one more TTL at most. Until
:meth:`Releaser.start` (a middleware used without a worker), after :meth:`Releaser.stop`, and in a child
after ``fork()``, a release is sent on the calling thread.
"""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar, cast

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STOP = object()

_instances: weakref.WeakSet[Releaser[object]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for releaser in list(_instances):
        releaser._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Releaser(Generic[T]):
    """Sends each item handed to :meth:`submit` with ``send``, in order, from one thread of its own.

    ``send`` must not raise (it logs and counts its own failures); it is what a worker thread would
    otherwise have called itself.
    """

    def __init__(self, send: Callable[[T], None]) -> None:
        self._send = send
        self._reset()
        _instances.add(cast("Releaser[object]", self))

    def _reset(self) -> None:
        # Also in a child after fork(): the thread is the parent's, and so are the releases pending (and the
        # lock may have been held at the fork). The child sends its own releases inline until start().
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping = False
        # Whether the releaser thread runs, kept by this class: worker threads must not ask Thread.is_alive(),
        # which an asynchronous exception landing in it can turn false for good (before Python 3.13: its
        # handler releases the live thread's state lock), leaving every later release sent inline and the
        # stop waiting for none of those pending.
        self._alive = False

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called: from then on, each release is sent by the thread submitting it."""
        return self._stopping

    @property
    def running(self) -> bool:
        """Whether a releaser thread sends the releases (else each is sent by the thread submitting it)."""
        return self._alive

    def start(self) -> None:
        """Start the releaser thread (idempotent): from now on :meth:`submit` does not wait."""
        with self._lock:
            if self._alive:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="dramatiq-leases-releaser", daemon=True)
            self._alive = True
            try:
                self._thread.start()
            except BaseException:
                self._alive = False
                raise

    def submit(self, item: T) -> None:
        """Hand ``item`` over to be sent; sent here and now if no releaser thread runs.

        It is sent in a copy of the caller's context: a span it opens is a child of the caller's (the message's).
        """
        # Under the lock, so that nothing is put behind the stop's marker: from then on, sent here.
        with self._lock:
            handed = self.running and not self._stopping
            if handed:
                self._queue.put((contextvars.copy_context(), item))
        if not handed:
            self._send(item)
            return
        # Let the releaser thread, just woken, take the GIL now rather than after this thread's next switch
        # interval (5 ms) behind CPU-bound actors: measured, the key is free sooner (p99 10 -> 6 ms, no-op jobs).
        time.sleep(0)

    def stop(self, timeout: float = 10.0) -> bool:
        """Send what is pending, then end the thread; ``False`` if it had not ended within ``timeout`` (s)."""
        with self._lock:
            self._stopping = True
            thread = self._thread
            if thread is None or not self._alive:
                return True
            self._queue.put(_STOP)
        thread.join(timeout)
        if self._alive:
            logger.warning("Releases still pending %.1f s into the worker's stop; their keys expire by TTL.", timeout)
            return False
        return True

    def _loop(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                context, sent = cast("tuple[contextvars.Context, T]", item)  # what submit puts
                try:
                    context.run(self._send, sent)
                except Exception:  # send logs its own failures; this thread must outlive any other
                    logger.exception("Unexpected error while releasing a lease; it expires by its TTL.")
        finally:
            self._alive = False  # from now on each release is sent by the thread submitting it
