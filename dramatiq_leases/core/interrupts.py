"""Cancelling an asynchronous exception (``PyThreadState_SetAsyncExc``) that has not been raised yet."""

from __future__ import annotations

import ctypes
import sys
import threading

# CPython 3.11 (and 3.12, same code) keeps one interpreter-wide "asynchronous exception pending" flag: every
# PyThreadState_SetAsyncExc sets it, a cancel (NULL) too, and only a thread raising one clears it. After a
# cancel it stays set for good: every thread then takes the eval loop's slow path at each check, and on 3.11
# a thread with a trace or profile function (coverage, a profiler, a debugger) spins for ever at its next
# function entry. 3.10 and 3.13 do not leave it set.
_FLAG_STICKS = (3, 11) <= sys.version_info[:2] < (3, 13)


class _Cleared(BaseException):
    """Raised in the cancelling thread, and absorbed there, only to clear the flag."""


def _delivery_point() -> None:
    """A function entry: where a pending asynchronous exception is raised."""


def cancel_async_exc(thread_id: int) -> None:
    """Cancel the asynchronous exception set for ``thread_id`` and not yet raised, if any.

    Where the cancel leaves the interpreter's flag set (see above), the calling thread then raises one of
    its own and absorbs it, which clears it. Any asynchronous exception arriving meanwhile is raised as usual.
    """
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)
    if not _FLAG_STICKS:
        return
    try:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), ctypes.py_object(_Cleared))
        _delivery_point()
    except _Cleared:
        pass
