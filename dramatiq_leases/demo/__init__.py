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
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import redis

from ..core import LeaseInfo, Leases, State, stale_after
from ..core.keys import DEFAULT_PREFIX
from ..core.numbers import margin_ms
from ..core.store import client_from_url
from ..urls import redact_url

# Names shared with demo.app, which reads its settings from the environment.
ENV_REDIS_URL = "DRAMATIQ_LEASES_DEMO_REDIS_URL"
ENV_PREFIX = "DRAMATIQ_LEASES_DEMO_PREFIX"
ENV_NAMESPACE = "DRAMATIQ_LEASES_DEMO_NAMESPACE"
ENV_EVENTS_KEY = "DRAMATIQ_LEASES_DEMO_EVENTS_KEY"
ENV_LOCK_TTL = "DRAMATIQ_LEASES_DEMO_LOCK_TTL_MS"
ENV_PARENT_PID = "DRAMATIQ_LEASES_DEMO_PARENT_PID"
ENV_PRIVATE_REDIS = "DRAMATIQ_LEASES_DEMO_PRIVATE_REDIS"

#: The demo's queue and actor.
QUEUE_NAME = "invoices"
ACTOR_NAME = "process_invoice"

#: Lease TTL of the demo's actor: short, so the orphaned lease expires within seconds.
LOCK_TTL_MS = 3000

#: How long a Dramatiq worker may miss heartbeats before its unacked messages are requeued.
HEARTBEAT_TIMEOUT_MS = 3000

#: Worker instances (``dramatiq`` commands) and threads in each.
WORKER_INSTANCES = 3
THREADS = 2

#: How far into a job the holder is killed, in seconds.
KILL_AFTER = 0.4

#: Seconds after the first job starts during which the demo waits for a worker holding a
#: single lease to kill (the clearest story); after that it kills any holder.
PREFER_SINGLE_FOR = 1.5

#: Seconds between looks at Redis, and between status lines.
POLL_INTERVAL = 0.1
STATUS_INTERVAL = 1.0

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


@dataclass
class _Attempt:
    """One run of a job, as the actor recorded it."""

    key: str
    job: int
    fence: int
    message_id: str
    pid: int
    start_ms: int
    end_ms: int | None = None
    outcome: str = "running"


@dataclass
class _Orphan:
    """A lease whose holder the demo killed."""

    key: str
    fence: int
    last_seen: LeaseInfo
    gone_at: float | None = None
    released: bool = False
    #: States seen while it lingered, in order (observed by polling: a short one may be missed).
    seen: list[State] = field(default_factory=list)

    def timeline(self, kill_ms: int) -> tuple[float, float | None, float]:
        """Seconds after the kill at which its heartbeat turned overdue, its holder's deadline passed, and
        its TTL ran out: the facts stored in the last snapshot of it, not when the demo happened to look."""
        info = self.last_seen
        overdue = (info.renewed_ms + stale_after(info.interval) - kill_ms) / 1000
        deadline = info.holder_deadline_ms
        expiry = (info.now_ms + info.ttl_left - kill_ms) / 1000
        return overdue, (deadline - kill_ms) / 1000 if deadline is not None else None, expiry


@dataclass
class _Kill:
    """The worker process the demo killed, and the leases it left behind."""

    pid: int
    kill_ms: int
    killed_at: float
    orphans: list[_Orphan]


def _parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` from ``/proc`` (``None`` where there is no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def max_overlap(intervals: list[tuple[int, int]]) -> int:
    """The largest number of ``(start, end)`` intervals open at one instant; touching ends do not overlap."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = current = 0
    for _, step in points:  # at equal times -1 sorts first: one ending as the next starts is not overlap
        current += step
        best = max(best, current)
    return best


class _Demo:
    """One run of the demo: its processes, what it has seen, and its checks."""

    def __init__(self, redis_url: str | None, *, prefix: str, invoices: int, per_invoice: int,
                 job_seconds: float, workers: int, threads: int, timeout: float, out: TextIO) -> None:
        self.redis_url = redis_url
        self.invoices = invoices
        self.per_invoice = per_invoice
        self.job_seconds = job_seconds
        self.workers = workers
        self.threads = threads
        self.timeout = timeout
        self.out = out
        run_id = secrets.token_hex(3)
        self.prefix = f"{prefix}-demo-{run_id}"
        self.namespace = f"dramatiq-leases-demo-{run_id}"
        self.events_key = f"{self.namespace}:events"
        self.tmp = Path(tempfile.mkdtemp(prefix="dramatiq-leases-demo-"))
        self.metrics_dir = self.tmp / "metrics"
        self.metrics_dir.mkdir()
        self.embedded: Any = None
        self.client: redis.Redis | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.metrics_server: Any = None
        self.registry: Any = None
        self.t0 = time.monotonic()
        self.messages: dict[str, tuple[int, int]] = {}
        self.attempts: list[_Attempt] = []
        self.events_read = 0
        self.leases_seen: dict[str, LeaseInfo] = {}
        self.kill: _Kill | None = None
        self.announced_exit: set[int] = set()

    # Output ------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.out.write(f"{time.monotonic() - self.t0:6.2f}  {text}\n")
        self.out.flush()

    def line(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # Setup -------------------------------------------------------------------

    def start_redis(self) -> str | None:
        """The Redis URL to use, or ``None`` (after saying why) if there is none."""
        from ..embedded import EmbeddedRedis

        url = self.redis_url
        if url is None:
            try:
                self.embedded = EmbeddedRedis().start()
            except RuntimeError as e:
                sys.stderr.write(f"dramatiq-leases: cannot start a private Redis for the demo: {e}\n")
                return None
            url = self.embedded.url()

        try:
            self.client = client_from_url(url)
            self.client.ping()
        except (redis.RedisError, ValueError) as e:
            reason = " ".join(str(e).split())
            sys.stderr.write(f"dramatiq-leases: cannot use Redis at {redact_url(url)}: {reason}\n")
            return None
        return url

    def start_metrics(self) -> str:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector

        from ..embedded import free_port

        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=str(self.metrics_dir))  # type: ignore[no-untyped-call]
        port = free_port()
        self.metrics_server, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        return f"http://127.0.0.1:{port}/metrics"

    def start_workers(self, url: str) -> None:
        env = {
            **os.environ,
            ENV_REDIS_URL: url,
            ENV_PREFIX: self.prefix,
            ENV_NAMESPACE: self.namespace,
            ENV_EVENTS_KEY: self.events_key,
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
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "dramatiq", "dramatiq_leases.demo.app", "--processes", "1",
                     "--threads", str(self.threads), "--worker-shutdown-timeout", "5000"],
                    cwd=self.tmp, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    # Its own process group: stopped as one, and spared the terminal's Ctrl-C.
                    start_new_session=True,
                ))

    def wait_for_workers(self, timeout: float = 30.0) -> bool:
        """Wait until every worker process polls the queue, so that all of them get messages."""
        assert self.client is not None
        deadline = time.monotonic() + timeout
        while self.client.zcard(f"{self.namespace}:__heartbeats__") < self.workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.line(f"demo FAILED: the workers did not start within {timeout:g}s")
                self.show_logs()
                return False
            time.sleep(POLL_INTERVAL)
        self.say(f"{self.workers} workers are polling the queue")
        return True

    def send(self) -> None:
        from dramatiq import Message
        from dramatiq.brokers.redis import RedisBroker

        assert self.client is not None
        broker = RedisBroker(  # type: ignore[no-untyped-call]
            client=self.client, namespace=self.namespace, middleware=[])
        for job in range(self.per_invoice):
            for invoice in range(1, self.invoices + 1):
                message = broker.enqueue(Message(
                    queue_name=QUEUE_NAME, actor_name=ACTOR_NAME, args=(invoice, job, self.job_seconds),
                    kwargs={}, options={},
                ))
                self.messages[message.message_id] = (invoice, job)

    # Watching ----------------------------------------------------------------

    def instance_of(self, pid: int) -> int | None:
        """Which worker instance (1-based) the worker process ``pid`` belongs to."""
        parent = _parent_pid(pid)
        for i, proc in enumerate(self.procs):
            if parent == proc.pid:
                return i + 1
        return None

    def label(self, pid: int) -> str:
        instance = self.instance_of(pid)
        return f"worker {instance} (pid {pid})" if instance else f"pid {pid}"

    def server_ms(self) -> int:
        assert self.client is not None
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def read_events(self) -> None:
        assert self.client is not None
        raw = self.client.lrange(self.events_key, self.events_read, -1)
        self.events_read += len(raw)
        for item in raw:
            e = json.loads(item)
            key = f"invoice:{e['invoice']}"
            job = f"job {e['job'] + 1}/{self.per_invoice}"
            if e["event"] == "start":
                self.attempts.append(
                    _Attempt(key, e["job"], e["fence"], e["message_id"], e["pid"], e["t_ms"]))
                again = "  <- a killed job, redelivered" if e["message_id"] in self.killed_messages() else ""
                self.say(f"{key}  fence {e['fence']}  {job} started on {self.label(e['pid'])}{again}")
                continue
            for attempt in self.attempts:
                if attempt.message_id == e["message_id"] and attempt.fence == e["fence"]:
                    attempt.end_ms, attempt.outcome = e["t_ms"], e["event"]
            if e["event"] == "done":
                self.say(f"{key}  fence {e['fence']}  {job} done")
            else:
                self.say(f"{key}  fence {e['fence']}  {job} FAILED: {e.get('error')}; Dramatiq retries it")

    def killed_messages(self) -> set[str]:
        """Messages whose job was running in the killed process: started there, never ended."""
        if self.kill is None:
            return set()
        pid = self.kill.pid
        return {a.message_id for a in self.attempts if a.pid == pid and a.end_ms is None}

    def orphan(self, key: str, fence: int) -> _Orphan | None:
        for orphan in self.kill.orphans if self.kill else []:
            if orphan.key == key and orphan.fence == fence:
                return orphan
        return None

    def watch_leases(self, leases: Leases) -> None:
        now = {info.key: info for info in leases.scan()}
        for key, before in self.leases_seen.items():
            after = now.get(key)
            orphan = self.orphan(key, before.fence)
            if after is not None and after.fence == before.fence:
                if orphan is not None:
                    orphan.last_seen = after
                    if after.state is not State.ALIVE and after.state not in orphan.seen:
                        orphan.seen.append(after.state)
                        self.say(f"{key}  fence {after.fence}  {self.state_news(after)}")
                continue
            # The grant seen before has ended: released by its owner, or expired by its TTL.
            released = leases.fence_state(key).get("released", 0) >= before.fence
            if orphan is not None and self.kill is not None:
                orphan.gone_at, orphan.released = time.monotonic(), released
                if not released:
                    expired_ms = before.now_ms + before.ttl_left - self.kill.kill_ms
                    self.say(f"{key}  fence {before.fence}  EXPIRED by its TTL {expired_ms / 1000:.1f}s "
                             "after its holder was killed: the orphaned lease is gone, "
                             "the invoice is free again")
            elif not released:
                self.say(f"{key}  fence {before.fence}  expired by its TTL (no release seen)")
        self.leases_seen = now

    @staticmethod
    def state_news(info: LeaseInfo) -> str:
        """One line on an orphan's new state, as ``dramatiq-leases show`` would explain it."""
        deadline = info.holder_deadline_ms
        until = (deadline - info.now_ms) / 1000 if deadline is not None else 0.0
        expires = info.ttl_left / 1000
        if info.state is State.HEARTBEAT_OVERDUE:
            return (f"heartbeat_overdue: no renewal for {info.heartbeat_age:.1f}s, but its holder may still be "
                    f"running until its deadline in {until:.1f}s, and stopping until its TTL runs out in "
                    f"{expires:.1f}s: nobody may release it before")
        if info.state is State.HOLDER_DEAD:
            return (f"holder_dead: its holder's deadline passed {-until:.1f}s ago, no holder can still believe it "
                    f"holds it; its TTL runs out in {expires:.1f}s")
        return f"{info.state.value}: its TTL runs out in {expires:.1f}s"

    def maybe_kill(self, leases: Leases) -> None:
        if self.kill is not None:
            return
        now_ms = self.server_ms()
        host = socket.gethostname()
        per_pid: dict[str, int] = {}
        for info in self.leases_seen.values():
            per_pid[info.meta.get("pid", "")] = per_pid.get(info.meta.get("pid", ""), 0) + 1
        first_start = min((a.start_ms for a in self.attempts), default=now_ms)
        picky = now_ms - first_start < (KILL_AFTER + PREFER_SINGLE_FOR) * 1000
        for info in self.leases_seen.values():
            if picky and per_pid[info.meta.get("pid", "")] > 1:
                continue
            pid = int(info.meta.get("pid", "0") or 0)
            running = [a for a in self.attempts
                       if a.key == info.key and a.fence == info.fence and a.end_ms is None]
            if (info.state is not State.ALIVE or not running or info.meta.get("host") != host or pid <= 0
                    or now_ms - running[0].start_ms < KILL_AFTER * 1000):
                continue
            if Path("/proc").is_dir() and self.instance_of(pid) is None:
                continue  # not one of our workers: never kill a stranger
            label = self.label(pid)
            os.kill(pid, signal.SIGKILL)
            self.kill = _Kill(pid, self.server_ms(), time.monotonic(), [])
            with contextlib.suppress(Exception):
                from prometheus_client import multiprocess

                # Its "live" gauges no longer count.
                multiprocess.mark_process_dead(pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
            # Every lease the process held is now an orphan, not only the one that picked it.
            self.leases_seen = {i.key: i for i in leases.scan()}
            self.kill.orphans = [_Orphan(i.key, i.fence, i) for i in self.leases_seen.values()
                                 if i.meta.get("pid") == str(pid) and i.meta.get("host") == host]
            held = ", ".join(f"{o.key} (fence {o.fence})" for o in self.kill.orphans)
            left = "that lease stays" if len(self.kill.orphans) == 1 else "those leases stay"
            into = (now_ms - running[0].start_ms) / 1000
            self.say(f"KILL -9 {label}, {into:.1f}s into a job; it held {held}: {left} behind, "
                     "and nobody will release it")
            for o in self.kill.orphans:
                overdue, deadline, expiry = o.timeline(self.kill.kill_ms)
                dead = f", holder_dead at +{deadline:.1f}s (its holder's deadline)" if deadline is not None else ""
                self.say(f"{o.key}  fence {o.fence}  ahead, from the kill: heartbeat_overdue at +{overdue:.1f}s"
                         f"{dead}, expired by its TTL at +{expiry:.1f}s")
            return

    def watch_instances(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None and i not in self.announced_exit:
                self.announced_exit.add(i)
                self.say(f"worker {i + 1} (instance pid {proc.pid}) exited ({proc.returncode}): Dramatiq "
                         "stops an instance when one of its processes dies; the other workers carry on")

    def busy_retries(self) -> int:
        total = 0.0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == "dramatiq_lease_busy_retries_total":
                    total += sample.value
        return int(total)

    def done_ids(self) -> set[str]:
        return {a.message_id for a in self.attempts if a.outcome == "done"}

    def status(self) -> None:
        held = " ".join(f"{k}#{i.fence}" + ("" if i.state is State.ALIVE else f"({i.state.value})")
                        for k, i in sorted(self.leases_seen.items())) or "-"
        self.say(f"status: {len(self.done_ids() & self.messages.keys())}/{len(self.messages)} done, "
                 f"busy retries {self.busy_retries()}, held: {held}")

    def finished(self) -> bool:
        settled = self.kill is not None and all(o.gone_at is not None for o in self.kill.orphans)
        return settled and self.messages.keys() <= self.done_ids()

    # The run -----------------------------------------------------------------

    def run(self) -> int:
        url = self.start_redis()
        if url is None:
            return EXIT_UNREACHABLE
        assert self.client is not None

        metrics_url = self.start_metrics()
        total = self.invoices * self.per_invoice
        self.line(f"dramatiq-leases demo: {self.invoices} invoices x {self.per_invoice} messages, "
                  f"~{self.job_seconds:g}s each, at most one job per invoice at a time")
        where = "a private redis-server that stops with the demo" if self.embedded else "the given Redis"
        self.line(f"  redis     {redact_url(url)}  ({where})")
        self.line(f"  metrics   {metrics_url}")
        interval = LOCK_TTL_MS // 3
        self.line(f"  leases    lock_ttl {LOCK_TTL_MS / 1000:g}s, renewed every {interval / 1000:g}s; after the "
                  f"last renewal: heartbeat overdue at {stale_after(interval) / 1000:g}s, holder's deadline at "
                  f"{(LOCK_TTL_MS - margin_ms(LOCK_TTL_MS)) / 1000:g}s, expired at {LOCK_TTL_MS / 1000:g}s")
        self.line(f"  inspect   dramatiq-leases --redis-url {redact_url(url)} --prefix {self.prefix} list")
        self.t0 = time.monotonic()
        self.start_workers(url)
        self.line(f"  workers   {self.workers} Dramatiq instances x {self.threads} threads "
                  f"(pids {', '.join(str(p.pid) for p in self.procs)})")
        self.line()
        if not self.wait_for_workers():
            return EXIT_FAILED
        self.send()
        self.say(f"sent {total} messages")
        leases = Leases(self.client, prefix=self.prefix)
        deadline = time.monotonic() + self.timeout
        next_status = time.monotonic() + STATUS_INTERVAL
        while not self.finished():
            if time.monotonic() > deadline:
                self.line(f"\ndemo FAILED: not finished after {self.timeout:g}s")
                self.show_logs()
                return EXIT_FAILED
            if all(p.poll() is not None for p in self.procs):
                self.line("\ndemo FAILED: every worker exited")
                self.show_logs()
                return EXIT_FAILED
            self.read_events()
            self.watch_leases(leases)
            self.maybe_kill(leases)
            self.watch_instances()
            if time.monotonic() >= next_status:
                self.status()
                next_status += STATUS_INTERVAL
            time.sleep(POLL_INTERVAL)
        took = time.monotonic() - self.t0
        return self.summary(metrics_url, took)

    def summary(self, metrics_url: str, took: float) -> int:
        kill = self.kill
        assert kill is not None
        failures: list[str] = []
        done = [a for a in self.attempts if a.outcome == "done"]
        once = len({a.message_id for a in done})
        total = len(self.messages)
        twice = len(done) - once
        if once != total:
            failures.append(f"only {once} of {total} jobs completed")
        intervals: dict[str, list[tuple[int, int]]] = {}
        fences: dict[str, list[int]] = {}
        for a in sorted(self.attempts, key=lambda a: a.start_ms):
            if a.end_ms is not None:
                end = a.end_ms
            elif a.pid == kill.pid:
                end = kill.kill_ms  # a killed job ran until the kill
            else:
                end = self.server_ms()  # unknown: assume it still runs, the strict reading
            intervals.setdefault(a.key, []).append((a.start_ms, end))
            fences.setdefault(a.key, []).append(a.fence)
        concurrency = max((max_overlap(v) for v in intervals.values()), default=0)
        if concurrency != 1:
            failures.append(f"max concurrency per key was {concurrency}")
        if any(f != sorted(set(f)) for f in fences.values()):
            failures.append("fencing tokens did not rise strictly per key")
        if any(o.released for o in kill.orphans):
            failures.append("an orphaned lease was released by someone instead of expiring")
        order = [State.HEARTBEAT_OVERDUE, State.HOLDER_DEAD]
        if any(o.seen != [s for s in order if s in o.seen] for o in kill.orphans):
            failures.append("an orphaned lease was seen in an unexpected state or order: "
                            + "; ".join(f"{o.key} {[s.value for s in o.seen]}" for o in kill.orphans))
        killed = self.killed_messages()
        redone = {a.message_id: a for a in done if a.message_id in killed and a.start_ms > kill.kill_ms}
        if not killed:
            failures.append("the killed process was running no job")
        if killed - redone.keys():
            failures.append("a killed job's message never completed")

        self.line()
        self.line("summary")
        note = "each message exactly once" if not twice else f"{twice} redelivered and completed twice"
        self.line(f"  jobs completed          {once}/{total} ({note})")
        self.line(f"  busy retries            {self.busy_retries()} "
                  "(messages sent back because their invoice was busy)")
        self.line(f"  max concurrent per key  {concurrency}")
        self.line(f"  killed                  pid {kill.pid} (SIGKILL) while it held "
                  + ", ".join(f"{o.key} fence {o.fence}" for o in kill.orphans))
        for o in kill.orphans:
            overdue, deadline, expired = o.timeline(kill.kill_ms)
            steps = f"heartbeat overdue {overdue:.1f}s, "
            if deadline is not None:
                steps += f"holder's deadline {deadline:.1f}s, "
            fate = ("released by someone" if o.released
                    else f"expired {expired:.1f}s after the kill (never released)")
            self.line(f"  orphaned lease          {o.key} fence {o.fence}: {steps}{fate}")
        for a in sorted(redone.values(), key=lambda a: a.key):
            self.line(f"  killed job              {a.key} job {a.job + 1}: redelivered and completed "
                      f"with fence {a.fence}")
        self.line("  fences per key          " + "  ".join(f"{k} {','.join(map(str, f))}"
                                                          for k, f in sorted(fences.items())))
        self.line(f"  metrics                 {metrics_url} (served until the demo exits)")
        self.line(f"  took                    {took:.1f}s")
        if failures:
            self.line("demo FAILED: " + "; ".join(failures))
            self.show_logs()
            return EXIT_FAILED
        self.line("demo OK")
        return EXIT_OK

    def show_logs(self, lines: int = 15) -> None:
        for path in sorted(self.tmp.glob("worker-*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            self.line(f"--- last lines of {path.name} ---")
            for text in tail:
                self.line(text)

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
                    for pattern in (f"{self.prefix}:*", f"{self.namespace}:*"):
                        names = list(self.client.scan_iter(match=pattern, count=500))
                        for i in range(0, len(names), 500):
                            self.client.unlink(*names[i : i + 500])
            self.client.close()
        if self.embedded is not None:
            self.embedded.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


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
    demo = _Demo(redis_url, prefix=prefix, invoices=invoices, per_invoice=per_invoice,
                 job_seconds=job_seconds, workers=workers, threads=threads, timeout=timeout,
                 out=out or sys.stdout)
    code = EXIT_FAILED
    with _sigterm_unwinds():
        try:
            code = demo.run()
        except KeyboardInterrupt:
            demo.line("\ninterrupted; stopping everything the demo started")
            code = EXIT_INTERRUPTED
        except _Terminated:
            code = EXIT_TERMINATED
        finally:
            # A second Ctrl-C or a SIGTERM must not stop cleanup half-way and leave workers behind.
            in_main = threading.current_thread() is threading.main_thread()
            signals = (signal.SIGINT, signal.SIGTERM) if in_main else ()
            previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
            try:
                demo.cleanup()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
    return code
