"""The stop budget: a leased run must end before the worker's shutdown timeout does.

On SIGTERM a Dramatiq worker stops taking messages and waits up to its shutdown timeout
(``dramatiq --worker-shutdown-timeout``, ms, default 600 000) for running actors; one still running then
is cut off when the process exits, its lease left to expire within its ``lock_ttl`` instead of being
released. A run ends at its ``time_limit`` (TimeLimit interrupts it, up to one check interval late) or its
``lock_max_hold`` (the lease ends on the server), whichever comes first. :func:`check_stop_budget` warns of
each leased actor whose run may outlast the shutdown timeout; :func:`worker_shutdown_timeout` learns that
timeout inside a worker process. docs/deployment.md has the whole arithmetic, up to the process manager's
stop timeout.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import dramatiq
from dramatiq.middleware.time_limit import TimeLimit

logger = logging.getLogger(__name__)

#: Environment variable giving the shutdown timeout (ms) of a worker not started by the ``dramatiq`` command.
SHUTDOWN_TIMEOUT_ENV = "DRAMATIQ_LEASES_SHUTDOWN_TIMEOUT"

#: Time (ms) an interrupted actor is given to unwind and its lease to be released, within the shutdown timeout.
UNWIND_MS = 1_000


def worker_shutdown_timeout(environ: Mapping[str, str] | None = None) -> int | None:
    """The shutdown timeout (ms) of the worker this process runs, if it can be known; from any thread.

    Under the ``dramatiq`` command (or a runner calling ``dramatiq.cli.main``), the value the worker
    process will pass to ``Worker.stop``: Dramatiq exposes it to no hook and reads no environment
    variable, so it is read from the arguments of ``dramatiq.cli.worker_process`` on the process's main
    thread. Otherwise ``$DRAMATIQ_LEASES_SHUTDOWN_TIMEOUT`` (whole ms), for a worker started another way;
    else ``None``.
    """
    from_cli = _from_dramatiq_cli()
    if from_cli is not None:
        return from_cli
    raw = (os.environ if environ is None else environ).get(SHUTDOWN_TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        logger.warning("Ignoring %s=%r: not a whole number of milliseconds above 0.", SHUTDOWN_TIMEOUT_ENV, raw)
        return None
    return value


def _from_dramatiq_cli() -> int | None:
    """``args.worker_shutdown_timeout`` of the ``worker_process`` frame on the main thread, if there is one."""
    cli = sys.modules.get("dramatiq.cli")  # never imported here: a process that has not imported it is no CLI worker
    target = getattr(cli, "worker_process", None)
    code = getattr(target, "__code__", None)
    if code is None:
        return None
    try:
        frame = _main_thread_frame()
        while frame is not None:
            if frame.f_code is code:
                value = getattr(frame.f_locals.get("args"), "worker_shutdown_timeout", None)
                return value if isinstance(value, int) and not isinstance(value, bool) else None
            frame = frame.f_back
    except Exception:  # another Python or Dramatiq than the ones this reads: no value, never a failed boot
        logger.debug("Could not read the dramatiq command's shutdown timeout.", exc_info=True)
    return None


def _main_thread_frame() -> Any:
    """The main thread's current frame: this thread's own, else from ``sys._current_frames()`` with the cyclic
    garbage collector off meanwhile. CPython 3.11 builds those frames holding its lock of the thread states; a
    collection started meanwhile that frees a ``threading.local`` takes that lock again, and the process hangs
    (seen in the test suite, at a worker's boot)."""
    if threading.current_thread() is threading.main_thread():
        return sys._getframe()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames().get(threading.main_thread().ident or 0)
    finally:
        if enabled:
            gc.enable()


def check_stop_budget(
    broker: dramatiq.Broker, shutdown_timeout_ms: int, *, default_max_hold: int | None = None
) -> list[str]:
    """Warn, once per leased actor (one declared with ``lock_key``), of a run that may outlast the shutdown timeout.

    A run is bounded by its ``time_limit`` plus TimeLimit's check interval and :data:`UNWIND_MS`, and by its
    ``lock_max_hold`` (the actor's, else ``default_max_hold``, the middleware's), whichever is smaller;
    without TimeLimit (or with an infinite limit) and without ``lock_max_hold`` it is unbounded. A message
    can override both: only the actors' options are checked. Each warning names the actor, the option
    that bounds its run, its value and the timeout. Returns the warnings logged.
    """
    time_limit = next((m for m in broker.middleware if isinstance(m, TimeLimit)), None)
    interval = math.ceil(getattr(time_limit.manager, "interval", 1.0) * 1000) if time_limit else 0
    warnings = []
    for name in sorted(broker.actors):
        options = broker.actors[name].options
        if options.get("lock_key") is None:
            continue
        bounds: list[tuple[float, str]] = []
        limit = (options.get("time_limit") or time_limit.time_limit) if time_limit else None
        if limit is not None and limit != math.inf:
            bounds.append(
                (
                    limit + interval + UNWIND_MS,
                    f"time_limit={_ms(limit)} ms (plus TimeLimit's {interval} ms check interval and "
                    f"{UNWIND_MS} ms to unwind and release)",
                )
            )
        max_hold = options.get("lock_max_hold")
        if max_hold is None:
            max_hold = default_max_hold
        if max_hold is not None and max_hold != math.inf:
            bounds.append((max_hold, f"lock_max_hold={_ms(max_hold)} ms"))
        if not bounds:
            what = "has no time_limit and no lock_max_hold: its run is unbounded and"
        else:
            bound, option = min(bounds, key=lambda b: b[0])
            if bound <= shutdown_timeout_ms:
                continue
            what = f"runs up to its {option}, which"
        warnings.append(
            f"Actor {name!r} {what} may outlast the worker shutdown timeout of {shutdown_timeout_ms} ms: "
            "a run still going when a stop reaches that timeout is cut off and its lease left to expire "
            "(within its lock_ttl) instead of being released. Lower the actor's limit or raise "
            "--worker-shutdown-timeout, and keep the process manager's stop timeout above it "
            "(docs/deployment.md)."
        )
    for warning in warnings:
        logger.warning("%s", warning)
    return warnings


def warn_stop_budget(broker: dramatiq.Broker, *, default_max_hold: int | None = None) -> list[str]:
    """:func:`check_stop_budget` against :func:`worker_shutdown_timeout`, if known: the worker-boot check.

    Call it once the actors are declared (``after_worker_boot``). Returns the warnings logged.
    """
    timeout = worker_shutdown_timeout()
    if timeout is None:
        logger.debug(
            "Worker shutdown timeout unknown (not the dramatiq command, no %s): stop budget not checked.",
            SHUTDOWN_TIMEOUT_ENV,
        )
        return []
    return check_stop_budget(broker, timeout, default_max_hold=default_max_hold)


def _ms(value: Any) -> str:
    """A time in ms as written: whole numbers without a decimal point."""
    return str(int(value)) if float(value).is_integer() else str(value)
