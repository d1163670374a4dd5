"""Cancelling an asynchronous exception leaves the interpreter as it was (dramatiq_leases/core/interrupts.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a child process: a thread with a profile function that, before the fix, spins for ever on CPython 3.11.
_CHILD = """
import sys, threading
{cancel}
calls = []
def f():
    calls.append(1)
def traced():
    sys.setprofile(lambda *args: None)
    for _ in range(100):
        f()
    sys.setprofile(None)
thread = threading.Thread(target=traced, daemon=True)
thread.start()
thread.join(5)
print(len(calls))
"""


def run_child(cancel: str) -> str:
    code = _CHILD.format(cancel=textwrap.dedent(cancel))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


def test_a_cancelled_async_exception_leaves_no_thread_with_a_profiler_spinning() -> None:
    """CPython 3.11: PyThreadState_SetAsyncExc(id, NULL) left the interpreter's "asynchronous exception
    pending" flag set for good; a thread with a trace or profile function (coverage, a profiler, a debugger)
    then spun for ever at its next function entry."""
    cancel = """
        from dramatiq_leases.core.interrupts import cancel_async_exc
        cancel_async_exc(threading.get_ident())
    """
    assert run_child(cancel) == "100"


def test_a_run_that_cancels_its_lease_lost_leaves_no_thread_with_a_profiler_spinning() -> None:
    """Run.finish() cancels a LeaseLost injected but not yet raised: the worker thread's next traced call,
    or any other thread's, must still return (the releasing test's injector hung there on 3.11)."""
    cancel = """
        from dramatiq_leases.middleware.guard import Run
        run = Run("key", "token", threading.get_ident())
        run.injected = True
        run.finish()
    """
    assert run_child(cancel) == "100"


def test_the_cancel_still_cancels_what_was_pending() -> None:
    cancel = """
        import ctypes
        from dramatiq_leases.core.interrupts import cancel_async_exc
        class Lost(BaseException):
            pass
        go, landed = threading.Event(), []
        def blocked():
            try:
                go.wait()  # in C: nothing is raised here
                sum(i for i in range(1000))
            except Lost:
                landed.append(1)
        other = threading.Thread(target=blocked)
        other.start()
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(other.ident), ctypes.py_object(Lost))
        cancel_async_exc(other.ident)
        go.set()
        other.join(5)
        assert not landed, "an asynchronous exception was raised after its cancel"
    """
    assert run_child(cancel) == "100"
