"""Real Dramatiq workers for the benchmarks: the ``dramatiq`` CLI in a subprocess; feeding and reading it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

from dramatiq_leases.embedded import free_port

from .enqueues import EnqueueCounter
from .names import ENQUEUES_KEY, LOG_KEY

#: The repository root: workers run there so ``bench.app`` imports.
ROOT = Path(__file__).resolve().parent.parent

#: Where worker logs go (one file per group), kept for a look after a run.
LOG_DIR = Path(tempfile.gettempdir()) / "dramatiq-leases-bench"

NAMESPACE = "dramatiq"


def dramatiq_cli() -> list[str]:
    """The ``dramatiq`` entry point of this interpreter's environment (``python -m dramatiq`` if absent)."""
    script = Path(sys.executable).parent / "dramatiq"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dramatiq"]


class WorkerGroup:
    """One ``dramatiq bench.app`` command: a main process and its worker processes, in their own session.

    Parameters:
      url: the benchmark Redis.
      env: ``BENCH_*`` settings (see :mod:`bench.app`) and ``dramatiq_*`` ones.
      processes, threads: as the CLI's ``--processes`` and ``--threads``.
      queues: only consume these (``--queues``); all by default.
      name: for the log file.
    """

    def __init__(
        self,
        url: str,
        env: Mapping[str, str],
        *,
        processes: int = 2,
        threads: int = 8,
        queues: Sequence[str] = (),
        name: str = "workers",
    ) -> None:
        self.url = url
        self.env = {**os.environ, "BENCH_REDIS_URL": url, "PYTHONPATH": str(ROOT), **env}
        # Leave no multiprocess Prometheus directory from the caller's environment in the workers.
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        # LeaseMiddleware serves its own metrics endpoint (Dramatiq 2 has no Prometheus middleware by
        # default) on a fixed port with a machine-wide value directory: give each group its own, so two
        # groups at once (figure 5) or other work on the machine neither collide nor share values.
        self._metrics_dir: str | None = None
        self.env.setdefault("DRAMATIQ_LEASES_METRICS_PORT", str(free_port()))
        self.env.setdefault("DRAMATIQ_LEASES_METRICS_HOST", "127.0.0.1")
        self.args = [*dramatiq_cli(), "bench.app", "--processes", str(processes), "--threads", str(threads)]
        if queues:
            self.args += ["--queues", *queues]
        self.processes = processes
        LOG_DIR.mkdir(exist_ok=True)
        self.log_path = LOG_DIR / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerGroup:
        """Start the command (returns at once; see :func:`wait_ready`)."""
        if "DRAMATIQ_LEASES_METRICS_DIR" not in self.env:
            self._metrics_dir = tempfile.mkdtemp(prefix="dramatiq-leases-bench-metrics-")
            self.env["DRAMATIQ_LEASES_METRICS_DIR"] = self._metrics_dir
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the main process (Dramatiq's graceful stop); SIGKILL this group's session if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        # The session is ours alone (start_new_session): any worker left behind goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
            self.env.pop("DRAMATIQ_LEASES_METRICS_DIR", None)
            self._metrics_dir = None

    def __enter__(self) -> WorkerGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def reset_broker(client: redis.Redis) -> None:
    """Delete the broker's queues, acks, heartbeats, the job log and enqueue counts, so a run starts clean."""
    names = [*list(client.scan_iter(match=f"{NAMESPACE}:*", count=1000)), LOG_KEY, ENQUEUES_KEY]
    for i in range(0, len(names), 1000):
        client.delete(*names[i : i + 1000])


def wait_ready(client: redis.Redis, processes: int, timeout: float = 60.0, group: WorkerGroup | None = None) -> None:
    """Wait until ``processes`` worker processes have polled the broker (each registers a heartbeat)."""
    deadline = time.monotonic() + timeout
    while client.zcard(f"{NAMESPACE}:__heartbeats__") < processes:
        if group is not None and group.proc is not None and group.proc.poll() is not None:
            raise RuntimeError(f"workers exited with {group.proc.returncode}; see {group.log_path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready after {timeout}s" + (f"; see {group.log_path}" if group else ""))
        time.sleep(0.02)


def producer(url: str, *, count_enqueues: bool = False) -> RedisBroker:
    """A broker for sending only: no middleware (but the enqueue counter if asked), so nothing else reaches Redis."""
    middleware = [EnqueueCounter(redis.Redis.from_url(url))] if count_enqueues else []
    return RedisBroker(url=url, middleware=middleware)


def send(broker: RedisBroker, queue: str, actor: str, *args: Any) -> str:
    """Enqueue a message for ``actor`` without importing its module (no actor object needed); its id."""
    broker.declare_queue(queue)
    message = dramatiq.Message(queue_name=queue, actor_name=actor, args=args, kwargs={}, options={})
    broker.enqueue(message)
    return message.message_id


def read_log(client: redis.Redis) -> list[dict[str, Any]]:
    """Every record the jobs have logged so far."""
    return [json.loads(raw) for raw in client.lrange(LOG_KEY, 0, -1)]


def wait_log(client: redis.Redis, predicate: Any, timeout: float) -> list[dict[str, Any]]:
    """Poll the job log until ``predicate(records)`` holds; the records (maybe short, at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_log(client)
        if predicate(records) or time.monotonic() > deadline:
            return records
        time.sleep(0.01)


def wait_log_length(client: redis.Redis, n: int, timeout: float) -> list[dict[str, Any]]:
    """Wait until the job log holds ``n`` records; the records (maybe fewer, at the timeout).

    Polls the list's length only, so a long run's log is not parsed over and over
    on the machine the workers share.
    """
    deadline = time.monotonic() + timeout
    while client.llen(LOG_KEY) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return read_log(client)
