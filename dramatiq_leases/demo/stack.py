"""The processes the demo starts (Redis, the metrics server, the worker instances), and their cleanup."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from ..core.client import client_from_url, is_cluster_url
from ..urls import redact_url
from .console import Console
from .settings import (
    ENV_EVENTS_KEY,
    ENV_LOCK_TTL,
    ENV_NAMESPACE,
    ENV_PARENT_PID,
    ENV_PREFIX,
    ENV_PRIVATE_REDIS,
    ENV_REDIS_URL,
    LOCK_TTL_MS,
    POLL_INTERVAL,
    RunNames,
)


def _parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` from ``/proc`` (``None`` where there is no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


class Stack:
    """What one run started: its Redis client (and private Redis), metrics server, workers and files."""

    def __init__(self, names: RunNames, workers: int, threads: int, console: Console) -> None:
        self.names = names
        self.workers = workers
        self.threads = threads
        self.console = console
        self.tmp = Path(tempfile.mkdtemp(prefix="dramatiq-leases-demo-"))
        self.metrics_dir = self.tmp / "metrics"
        self.metrics_dir.mkdir()
        self.embedded: Any = None
        self.client: redis.Redis | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.metrics_server: Any = None
        self.registry: Any = None
        self.announced_exit: set[int] = set()

    # Starting ----------------------------------------------------------------

    def start_redis(self, redis_url: str | None) -> str | None:
        """The Redis URL to use (a private Redis if ``redis_url`` is ``None``), or ``None`` after saying why not."""
        from ..embedded import EmbeddedRedis

        url = redis_url
        if url is None:
            try:
                self.embedded = EmbeddedRedis().start()
            except RuntimeError as e:
                sys.stderr.write(f"dramatiq-leases: cannot start a private Redis for the demo: {e}\n")
                return None
            url = self.embedded.url()

        try:
            if is_cluster_url(url):
                raise ValueError("the demo needs a standalone Redis: its Dramatiq broker lives there too")
            client = client_from_url(url)
            assert isinstance(client, redis.Redis)  # not a cluster URL
            self.client = client
            self.client.ping()
        except (redis.RedisError, ValueError) as e:
            reason = " ".join(str(e).split())
            sys.stderr.write(f"dramatiq-leases: cannot use Redis at {redact_url(url)}: {reason}\n")
            return None
        return url

    def start_metrics(self) -> str:
        """Serve the workers' shared metrics directory; returns its URL."""
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector

        from ..embedded import free_port

        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=str(self.metrics_dir))  # type: ignore[no-untyped-call]
        port = free_port()
        self.metrics_server, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        return f"http://127.0.0.1:{port}/metrics"

    def start_workers(self, url: str) -> None:
        """Start the worker instances on the Redis at ``url``, each logging to its own file."""
        env = {
            **os.environ,
            ENV_REDIS_URL: url,
            ENV_PREFIX: self.names.prefix,
            ENV_NAMESPACE: self.names.namespace,
            ENV_EVENTS_KEY: self.names.events_key,
            ENV_LOCK_TTL: str(LOCK_TTL_MS),
            ENV_PARENT_PID: str(os.getpid()),
            ENV_PRIVATE_REDIS: "1" if self.embedded else "",
            # Lease metrics and Dramatiq's metrics go to one shared directory the demo serves.
            "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
            "dramatiq_prom_db": str(self.metrics_dir),
            "PYTHONUNBUFFERED": "1",
        }
        # One process per `dramatiq` command: Dramatiq stops a whole instance when one of its
        # processes dies, and the point is to watch the surviving workers carry on.
        for i in range(self.workers):
            with open(self.tmp / f"worker-{i + 1}.log", "wb") as log:  # the child keeps its own copy
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "dramatiq",
                            "dramatiq_leases.demo.app",
                            "--processes",
                            "1",
                            "--threads",
                            str(self.threads),
                            "--worker-shutdown-timeout",
                            "5000",
                        ],
                        cwd=self.tmp,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        # Its own process group: stopped as one, and spared the terminal's Ctrl-C.
                        start_new_session=True,
                    )
                )

    def wait_for_workers(self, timeout: float = 30.0) -> bool:
        """Wait until every worker process polls the queue, so that all of them get messages."""
        assert self.client is not None
        deadline = time.monotonic() + timeout
        while self.client.zcard(f"{self.names.namespace}:__heartbeats__") < self.workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.console.line(f"demo FAILED: the workers did not start within {timeout:g}s")
                self.show_logs()
                return False
            time.sleep(POLL_INTERVAL)
        self.console.say(f"{self.workers} workers are polling the queue")
        return True

    # Looking -----------------------------------------------------------------

    def instance_of(self, pid: int) -> int | None:
        """Which worker instance (1-based) the worker process ``pid`` belongs to."""
        parent = _parent_pid(pid)
        for i, proc in enumerate(self.procs):
            if parent == proc.pid:
                return i + 1
        return None

    def label(self, pid: int) -> str:
        """How the news names the worker process ``pid``."""
        instance = self.instance_of(pid)
        return f"worker {instance} (pid {pid})" if instance else f"pid {pid}"

    def server_ms(self) -> int:
        """Redis server time in milliseconds: the clock the workers stamp their events with."""
        assert self.client is not None
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def busy_retries(self) -> int:
        """Messages parked (or sent back) so far because their lease was busy, from the workers' metrics."""
        total = 0.0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == "dramatiq_lease_busy_retries_total":
                    total += sample.value
        return int(total)

    def watch_instances(self) -> None:
        """Tell of each worker instance that has exited, once."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None and i not in self.announced_exit:
                self.announced_exit.add(i)
                self.console.say(
                    f"worker {i + 1} (instance pid {proc.pid}) exited ({proc.returncode}): Dramatiq "
                    "stops an instance when one of its processes dies; the other workers carry on"
                )

    def show_logs(self, lines: int = 15) -> None:
        """Write the last ``lines`` lines of every worker's log."""
        for path in sorted(self.tmp.glob("worker-*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            self.console.line(f"--- last lines of {path.name} ---")
            for text in tail:
                self.console.line(text)

    # Cleanup -----------------------------------------------------------------

    def cleanup(self) -> None:
        """Stop every process the demo started and delete what it wrote; safe to call at any point."""
        # SIGTERM first, so workers shut down cleanly; SIGKILL what is left after the grace period.
        # Only the instance's main process gets it: it forwards it to its workers, and a worker
        # that gets a second SIGTERM stops at once instead of cleanly.
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 8
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            # The group may outlive its leader (a worker whose instance died), so always sweep it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self.client is not None:
            if self.embedded is None:
                with contextlib.suppress(redis.RedisError):
                    for pattern in (f"{self.names.prefix}:*", f"{self.names.namespace}:*"):
                        names = list(self.client.scan_iter(match=pattern, count=500))
                        for i in range(0, len(names), 500):
                            self.client.unlink(*names[i : i + 500])
            self.client.close()
        if self.embedded is not None:
            self.embedded.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
