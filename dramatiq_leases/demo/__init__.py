"""``dramatiq-leases demo``: leases at work in under a minute, with nothing installed but this package.

It starts a private Redis (unless given a Redis URL), a few independent
Dramatiq worker instances running :mod:`dramatiq_leases.demo.app`, and sends
several messages per invoice, all contending for the lease ``invoice:N``.
While a worker holds a lease mid-job, the demo SIGKILLs it. That lease,
which nobody will ever release, goes through the states every observer
(``dramatiq-leases list``, the exporter) reports: ``heartbeat_overdue`` once
renewals are late (the holder might still be running, so nobody may release
it), ``holder_dead`` once the holder's own deadline (last renewal + TTL - a
10% safety margin) has passed, and then it expires by its TTL. Another worker
takes the invoice over with a higher fencing token, and the killed job's
message is redelivered and completes. A summary checks all of it, and every
process the demo started is stopped before it returns.

Every Redis name the demo writes is specific to the run (a lease prefix and
a Dramatiq namespace with a random suffix), so pointing it at a shared Redis
touches nothing else; it deletes those keys at the end.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from ..core import Leases, stale_after
from ..core.keys import DEFAULT_PREFIX
from ..core.lease import margin_ms
from ..urls import redact_url
from . import report
from .chaos import KILL_AFTER, PREFER_SINGLE_FOR, Chaos
from .console import Console
from .events import Jobs
from .report import max_overlap
from .settings import (
    ACTOR_NAME,
    ENV_EVENTS_KEY,
    ENV_LOCK_TTL,
    ENV_NAMESPACE,
    ENV_PARENT_PID,
    ENV_PREFIX,
    ENV_PRIVATE_REDIS,
    ENV_REDIS_URL,
    HEARTBEAT_TIMEOUT_MS,
    LOCK_TTL_MS,
    POLL_INTERVAL,
    QUEUE_NAME,
    STATUS_INTERVAL,
    THREADS,
    WORKER_INSTANCES,
    RunNames,
)
from .stack import Stack

# The names this package has always offered; demo.app imports its settings from here.
__all__ = [
    "ACTOR_NAME",
    "ENV_EVENTS_KEY",
    "ENV_LOCK_TTL",
    "ENV_NAMESPACE",
    "ENV_PARENT_PID",
    "ENV_PREFIX",
    "ENV_PRIVATE_REDIS",
    "ENV_REDIS_URL",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_UNREACHABLE",
    "HEARTBEAT_TIMEOUT_MS",
    "KILL_AFTER",
    "LOCK_TTL_MS",
    "POLL_INTERVAL",
    "PREFER_SINGLE_FOR",
    "QUEUE_NAME",
    "STATUS_INTERVAL",
    "THREADS",
    "WORKER_INSTANCES",
    "max_overlap",
    "run",
]

#: Exit codes, as documented by the CLI.
EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 4, 130, 143


class _Terminated(BaseException):
    """SIGTERM arrived; unwinds like Ctrl-C so that cleanup runs."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Demo:
    """One run of the demo: sets its processes up, plays the story until it settles, and sums it up."""

    def __init__(
        self,
        redis_url: str | None,
        *,
        prefix: str,
        invoices: int,
        per_invoice: int,
        job_seconds: float,
        workers: int,
        threads: int,
        timeout: float,
        out: TextIO,
    ) -> None:
        self.redis_url = redis_url
        self.invoices = invoices
        self.per_invoice = per_invoice
        self.job_seconds = job_seconds
        self.timeout = timeout
        self.names = RunNames.new(prefix)
        self.console = Console(out)
        self.stack = Stack(self.names, workers, threads, self.console)
        self.jobs = Jobs(self.names.events_key, per_invoice, self.console)
        self.chaos = Chaos(self.console, self.stack, self.jobs)

    def finished(self) -> bool:
        """Whether the orphans of the kill are all gone and every message completed."""
        kill = self.chaos.kill
        settled = kill is not None and all(o.gone_at is not None for o in kill.orphans)
        return settled and self.jobs.messages.keys() <= self.jobs.done_ids()

    def run(self) -> int:
        """Play the story; returns the exit code. Cleanup is the caller's, whatever happens."""
        stack, line = self.stack, self.console.line
        url = stack.start_redis(self.redis_url)
        if url is None:
            return EXIT_UNREACHABLE
        assert stack.client is not None

        metrics_url = stack.start_metrics()
        total = self.invoices * self.per_invoice
        line(
            f"dramatiq-leases demo: {self.invoices} invoices x {self.per_invoice} messages, "
            f"~{self.job_seconds:g}s each, at most one job per invoice at a time"
        )
        where = "a private redis-server that stops with the demo" if stack.embedded else "the given Redis"
        line(f"  redis     {redact_url(url)}  ({where})")
        line(f"  metrics   {metrics_url}")
        interval = LOCK_TTL_MS // 3
        line(
            f"  leases    lock_ttl {LOCK_TTL_MS / 1000:g}s, renewed every {interval / 1000:g}s; after the "
            f"last renewal: heartbeat overdue at {stale_after(interval) / 1000:g}s, holder's deadline at "
            f"{(LOCK_TTL_MS - margin_ms(LOCK_TTL_MS)) / 1000:g}s, expired at {LOCK_TTL_MS / 1000:g}s"
        )
        line(f"  inspect   dramatiq-leases --redis-url {redact_url(url)} --prefix {self.names.prefix} list")
        self.console.restart_clock()
        stack.start_workers(url)
        line(
            f"  workers   {stack.workers} Dramatiq instances x {stack.threads} threads "
            f"(pids {', '.join(str(p.pid) for p in stack.procs)})"
        )
        line()
        if not stack.wait_for_workers():
            return EXIT_FAILED
        self.jobs.send(stack.client, self.names.namespace, self.invoices, self.job_seconds)
        self.console.say(f"sent {total} messages")
        leases = Leases(stack.client, prefix=self.names.prefix)
        deadline = time.monotonic() + self.timeout
        next_status = time.monotonic() + STATUS_INTERVAL
        while not self.finished():
            if time.monotonic() > deadline:
                line(f"\ndemo FAILED: not finished after {self.timeout:g}s")
                stack.show_logs()
                return EXIT_FAILED
            if all(p.poll() is not None for p in stack.procs):
                line("\ndemo FAILED: every worker exited")
                stack.show_logs()
                return EXIT_FAILED
            self.jobs.read(stack.client, stack.label, self.chaos.kill.pid if self.chaos.kill else None)
            self.chaos.watch_leases(leases)
            self.chaos.maybe_kill(leases)
            stack.watch_instances()
            if time.monotonic() >= next_status:
                report.status(self.console, self.jobs, self.chaos.leases_seen, stack.busy_retries())
                next_status += STATUS_INTERVAL
            time.sleep(POLL_INTERVAL)
        took = self.console.elapsed()
        assert self.chaos.kill is not None  # finished() needs one
        failures = report.summary(self.console, self.jobs, self.chaos.kill, stack, metrics_url=metrics_url, took=took)
        if failures:
            line("demo FAILED: " + "; ".join(failures))
            stack.show_logs()
            return EXIT_FAILED
        line("demo OK")
        return EXIT_OK


def run(
    redis_url: str | None,
    *,
    prefix: str = DEFAULT_PREFIX,
    invoices: int = 3,
    per_invoice: int = 4,
    job_seconds: float = 1.0,
    workers: int = WORKER_INSTANCES,
    threads: int = THREADS,
    timeout: float = 45.0,
    out: TextIO | None = None,
) -> int:
    """Run the demo; returns the exit code (0 when every check passed).

    Parameters:
      redis_url: the Redis to use; ``None`` starts a private ``redis-server``.
      prefix: the lease prefix, to which the demo appends a run-specific suffix.
      invoices: how many lease keys the jobs contend for.
      per_invoice: messages sent per key.
      job_seconds: how long each job runs.
      workers: independent ``dramatiq`` instances (one process each).
      threads: worker threads per instance.
      timeout: seconds after which the demo gives up and fails.
      out: where to write (default standard output).

    Returns:
      0 if every check passed, 1 if one failed, 4 if Redis could not be
      used, 130 on Ctrl-C, 143 on SIGTERM.
    """
    demo = _Demo(
        redis_url,
        prefix=prefix,
        invoices=invoices,
        per_invoice=per_invoice,
        job_seconds=job_seconds,
        workers=workers,
        threads=threads,
        timeout=timeout,
        out=out or sys.stdout,
    )
    code = EXIT_FAILED
    with _sigterm_unwinds():
        try:
            code = demo.run()
        except KeyboardInterrupt:
            demo.console.line("\ninterrupted; stopping everything the demo started")
            code = EXIT_INTERRUPTED
        except _Terminated:
            code = EXIT_TERMINATED
        finally:
            # A second Ctrl-C or a SIGTERM must not stop cleanup half-way and leave workers behind.
            in_main = threading.current_thread() is threading.main_thread()
            signals = (signal.SIGINT, signal.SIGTERM) if in_main else ()
            previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
            try:
                demo.stack.cleanup()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
    return code
