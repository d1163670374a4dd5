"""Helpers for tests that run real `dramatiq` worker processes, the exporter and scrape their endpoints."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import redis
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from dramatiq_leases.core import RedisClient
from dramatiq_leases.exporter import LEAK_REASONS, WAIT_REASONS
from dramatiq_leases.prometheus import LOST_REASONS, NOT_RUN_REASONS

from .promtool import require
from .waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.apps.obs_app"
WORK_ACTOR, WORK_QUEUE = "work", "obs"
LONG_ACTOR, LONG_QUEUE = "long_work", "obs-long"
EVENTS_KEY = "obs:events"

#: The only labels lease metrics may carry (``le``: histogram buckets), and the values of the bounded ones.
LABEL_VALUES: dict[str, set[str] | None] = {
    "actor_name": None,
    "queue_name": None,
    "le": None,
    "outcome": {"acquired", "busy", "error", "ok", "lost"},
    "reason": {*LOST_REASONS, *NOT_RUN_REASONS, *(reason.value for reason in LEAK_REASONS), *WAIT_REASONS},
    "operation": {"acquire", "renew", "release", "scan"},
    "kind": {"lease", "line", "waiters", "fence"},  # dramatiq_lease_exporter_unreadable_keys
}

T = TypeVar("T")


# --- processes ----------------------------------------------------------------------------------------


class Processes:
    """The subprocesses of one test: each leads a process group of its own and logs to a file.

    Every group still alive is stopped on exit (SIGTERM, then SIGKILL after a grace period).
    """

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.may_exit: set[str] = set()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT
    ) -> subprocess.Popen[bytes]:
        assert name not in self.procs, name
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str, tail: int = 3000) -> str:
        text = (self.logs / f"{name}.log").read_text(errors="replace")
        return text[-tail:]

    def report(self) -> str:
        """The end of every log, for a failure message."""
        return "\n".join(f"--- {name} (exit {proc.poll()}) ---\n{self.log(name)}" for name, proc in self.procs.items())

    def check_running(self) -> None:
        """Fail the test, with the logs, if a process has exited (except those in ``may_exit``)."""
        for name in set(self.procs) - self.may_exit:
            code = self.procs[name].poll()
            if code is not None:
                pytest.fail(f"{name} exited with code {code}\n{self.report()}", pytrace=False)

    def stop(self, name: str, grace: float = 10.0) -> None:
        """SIGTERM to the leader only (`dramatiq` passes it on to its children: a second one would kill
        them on the spot), then SIGKILL to whatever is left of its group."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)


def wait_until(
    predicate: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    procs: Processes | None = None,
    interval: float = 0.1,
) -> T:
    """:func:`wait_for`, failing also as soon as a process of ``procs`` died, and with their logs at the deadline."""

    def asked() -> T | None:
        if procs is not None:
            procs.check_running()
        return predicate()

    return cast(T, wait_for(asked, timeout, interval, what, details=procs.report if procs is not None else None))


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any metrics settings inherited from the test process, plus ``extra``.

    In-process workers of other tests set ``PROMETHEUS_MULTIPROC_DIR`` in this process; a child
    that inherited it would write its metrics there.
    """
    dropped = ("prometheus_multiproc_dir", "dramatiq_prom_", "dramatiq_leases_metrics_")
    env = {k: v for k, v in os.environ.items() if not k.lower().startswith(dropped)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def dramatiq_argv(*, processes: int, threads: int, queues: Iterable[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dramatiq",
        APP,
        "--processes",
        str(processes),
        "--threads",
        str(threads),
        "--queues",
        *queues,
        "--worker-shutdown-timeout",
        "5000",
    ]


def exporter_argv(redis_url: str, port: int, interval: float) -> list[str]:
    """``dramatiq-leases exporter``, the console script of this environment."""
    script = Path(sys.executable).with_name("dramatiq-leases")
    assert script.exists(), f"{script}: is the package installed (pip install -e .)?"
    return [
        str(script),
        "exporter",
        "--redis-url",
        redis_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--interval",
        str(interval),
    ]


def worker_processes(client: redis.Redis) -> int:
    """Worker processes polling the broker now (each has one broker, which heartbeats)."""
    return int(client.zcard("dramatiq:__heartbeats__"))


def send(broker: RedisBroker, actor: str, queue: str, *args: Any, **options: Any) -> str:
    """Enqueue a message for an actor of the app without importing the app."""
    message = broker.enqueue(Message(queue_name=queue, actor_name=actor, args=args, kwargs={}, options=options))
    return message.message_id


def events(client: RedisClient) -> list[dict[str, Any]]:
    """What the app's actors recorded (tests/apps/obs_app.py)."""
    return [json.loads(item) for item in client.lrange(EVENTS_KEY, 0, -1)]


# --- HTTP and expositions ---------------------------------------------------------------------------


def http_get(url: str, timeout: float = 2.0) -> str | None:
    """The body of a successful GET, or ``None`` when nothing answers (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return str(response.read().decode())
    except (urllib.error.URLError, OSError):
        return None


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def lease_samples(exposition: str) -> list[Sample]:
    return [
        sample
        for family in text_string_to_metric_families(exposition)
        if family.name.startswith("dramatiq_lease")
        for sample in family.samples
    ]


def values(exposition: str, name: str, **labels: str) -> list[float]:
    """The values of the samples named ``name`` whose labels include ``labels``."""
    return [
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]


def value(exposition: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(values(exposition, name, **labels))


def promtool_check_metrics(exposition: str) -> tuple[int, list[str]]:
    """``promtool check metrics`` on an exposition: its exit code and its problem lines."""
    proc = subprocess.run(
        [require("promtool"), "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def assert_promtool_clean(exposition: str, *, foreign_ok: bool = False) -> None:
    """Fail on any promtool problem with a lease metric, or with the exposition itself.

    ``foreign_ok``: a lint remark about a metric family that is not ours (Dramatiq's own
    ``dramatiq_message_duration_milliseconds`` is in milliseconds) is tolerated, nothing else.
    """
    code, problems = promtool_check_metrics(exposition)
    families = {family.name for family in text_string_to_metric_families(exposition)}
    ours = [line for line in problems if line.split()[0].startswith("dramatiq_lease")]
    assert ours == [], "promtool check metrics flags lease metrics"
    foreign = [line for line in problems if line not in ours]
    if foreign_ok:
        unexplained = [line for line in foreign if line.split()[0] not in families]
        assert unexplained == [], "promtool could not lint the exposition"
    else:
        assert (code, foreign) == (0, [])


def assert_no_lease_keys(exposition: str, keys: Iterable[str]) -> None:
    """Lease metrics carry only bounded labels, and no lease key in any label value."""
    samples = lease_samples(exposition)
    assert samples
    keys = list(keys)
    for sample in samples:
        assert set(sample.labels) <= set(LABEL_VALUES), f"{sample.name}: unexpected labels {sample.labels}"
        for label, text in sample.labels.items():
            allowed = LABEL_VALUES[label]
            assert allowed is None or text in allowed, f"{sample.name}: {label}={text!r}"
            assert not any(key in text for key in keys), f"{sample.name}: {label}={text!r} carries a lease key"
