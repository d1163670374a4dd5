"""Deployment: the stop budget (time limit < worker shutdown timeout < the process manager's stop timeout).

The files we ship (deploy/supervisor/dramatiq-worker.conf, deploy/kubernetes/worker.yaml) keep the
arithmetic of docs/deployment.md; :mod:`dramatiq_leases.middleware.stop_budget` warns of a leased actor
whose run may outlast the worker's shutdown timeout; and a real ``dramatiq`` worker under a real
``supervisord``, run from the shipped program section, stopped with ``supervisorctl stop`` while a leased
job runs, lets the job finish and release its lease, and is not SIGKILLed.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import dramatiq
import pytest
import redis
import yaml
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware.time_limit import TimeLimit

from dramatiq_leases import LeaseMiddleware, Leases
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.middleware.stop_budget import (
    SHUTDOWN_TIMEOUT_ENV,
    UNWIND_MS,
    check_stop_budget,
    warn_stop_budget,
    worker_shutdown_timeout,
)

from .support.waiting import wait_for

ROOT = Path(__file__).parents[1]
SUPERVISOR_CONF = ROOT / "deploy" / "supervisor" / "dramatiq-worker.conf"
KUBERNETES_YAML = ROOT / "deploy" / "kubernetes" / "worker.yaml"
#: TimeLimit's check interval (ms, Dramatiq's default) plus the unwinding a run is given: the margin between
#: an actor's time limit and the shutdown timeout.
RUN_MARGIN = 1_000 + UNWIND_MS
#: What the process manager's stop timeout must leave after the shutdown timeout (ms): the worker process
#: notices SIGTERM within a second, joins its consumers, releases and exits; its parent polls every second.
EXIT_MARGIN = 10_000

T = TypeVar("T")


def shutdown_timeout_of(argv: list[str]) -> int:
    """The ``--worker-shutdown-timeout`` of a ``dramatiq`` command line, as Dramatiq's own parser reads it."""
    from dramatiq.cli import make_argument_parser

    return int(make_argument_parser().parse_args(argv[1:]).worker_shutdown_timeout)  # type: ignore[no-untyped-call]


def shipped_program() -> tuple[str, dict[str, str]]:
    """The program section of the shipped Supervisor file: its name and its settings."""
    parser = configparser.RawConfigParser()
    parser.read(SUPERVISOR_CONF)
    (section,) = [s for s in parser.sections() if s.startswith("program:")]
    return section, dict(parser[section])


# The shipped files ----------------------------------------------------------------------------------------


def test_the_supervisor_program_waits_longer_than_the_worker_shutdown_timeout() -> None:
    _, program = shipped_program()
    argv = shlex.split(program["command"])
    assert Path(argv[0]).name == "dramatiq", "supervisord must signal dramatiq itself, not a shell"
    timeout = shutdown_timeout_of(argv)
    assert timeout < 600_000, "Dramatiq's default (10 minutes) is left unsaid; the file must say it"
    assert int(program["stopwaitsecs"]) * 1000 >= timeout + EXIT_MARGIN
    assert program["stopsignal"] == "TERM"
    # Sent to the group, each worker process would get SIGTERM twice, and a second one kills it at once.
    assert program["stopasgroup"] == "false"
    assert program["killasgroup"] == "true"  # a SIGKILL after stopwaitsecs leaves no orphan worker process


def test_the_kubernetes_grace_period_exceeds_the_worker_shutdown_timeout() -> None:
    (deployment,) = [d for d in yaml.safe_load_all(KUBERNETES_YAML.read_text()) if d and d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    argv = [*container["command"], *container.get("args", [])]
    # Exec form, dramatiq as PID 1: the kubelet's SIGTERM reaches Dramatiq's main process, which forwards it.
    assert Path(argv[0]).name == "dramatiq", "a shell as PID 1 would not forward SIGTERM"
    timeout = shutdown_timeout_of(argv)
    assert pod["terminationGracePeriodSeconds"] * 1000 >= timeout + EXIT_MARGIN
    assert "preStop" not in container.get("lifecycle", {}), "a preStop hook spends the grace period first"


# The stop-budget check --------------------------------------------------------------------------------------


@pytest.fixture
def broker(redis_server: EmbeddedRedis) -> Iterator[RedisBroker]:
    """A real Redis broker (Dramatiq's default middleware, TimeLimit's 10-minute default) with leases."""
    broker = RedisBroker(url=redis_server.url(0))  # type: ignore[no-untyped-call]
    broker.add_middleware(LeaseMiddleware(redis_url=redis_server.url(1), metrics_endpoint=False))
    yield broker
    broker.close()


def declare(broker: dramatiq.Broker, name: str, **options: Any) -> None:
    dramatiq.actor(actor_name=name, broker=broker, **options)(lambda key: None)


def stop_warnings(caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    """The stop-budget warnings logged, by the actor each names."""
    out = {}
    for r in caplog.records:
        if r.name == "dramatiq_leases.middleware.stop_budget" and r.levelno == logging.WARNING:
            actor = r.getMessage().split("'")[1]
            assert actor not in out, f"two warnings for {actor}"
            out[actor] = r.getMessage()
    return out


def test_check_warns_once_per_leased_actor_whose_run_may_outlast_the_shutdown_timeout(
    broker: RedisBroker, caplog: pytest.LogCaptureFixture
) -> None:
    shutdown = 120_000
    declare(broker, "fits", lock_key="a:{key}", time_limit=shutdown - RUN_MARGIN)
    declare(broker, "just_over", lock_key="b:{key}", time_limit=shutdown - RUN_MARGIN + 1)
    declare(broker, "default_limit", lock_key="c:{key}")  # TimeLimit's 600 000 ms
    declare(broker, "long_hold", lock_key="d:{key}", time_limit=3_600_000, lock_max_hold=300_000)
    declare(broker, "short_hold", lock_key="e:{key}", time_limit=3_600_000, lock_max_hold=60_000)
    declare(broker, "no_lease", time_limit=3_600_000)  # not leased: nothing of ours to release
    caplog.set_level(logging.WARNING)

    warnings = check_stop_budget(broker, shutdown)

    logged = stop_warnings(caplog)
    assert sorted(logged) == ["default_limit", "just_over", "long_hold"]
    assert sorted(warnings) == sorted(logged.values())
    assert "time_limit=118001 ms" in logged["just_over"]
    assert "time_limit=600000 ms" in logged["default_limit"]
    # The lease ends at lock_max_hold even if the actor's time limit is later: that is the bound named.
    assert "lock_max_hold=300000 ms" in logged["long_hold"]
    for message in logged.values():
        assert "worker shutdown timeout of 120000 ms" in message
        assert "docs/deployment.md" in message


def test_check_counts_the_middleware_default_max_hold_and_an_unbounded_run(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    # Without TimeLimit, only lock_max_hold bounds a run.
    broker = RedisBroker(url=redis_server.url(0))  # type: ignore[no-untyped-call]
    broker.middleware[:] = [m for m in broker.middleware if not isinstance(m, TimeLimit)]
    broker.add_middleware(LeaseMiddleware(redis_url=redis_server.url(1), metrics_endpoint=False))
    try:
        declare(broker, "unbounded", lock_key="u:{key}")
        declare(broker, "held", lock_key="h:{key}", lock_max_hold=30_000)
        caplog.set_level(logging.WARNING)
        check_stop_budget(broker, 60_000)
        assert sorted(stop_warnings(caplog)) == ["unbounded"]
        assert "no time_limit and no lock_max_hold" in stop_warnings(caplog)["unbounded"]

        caplog.clear()
        check_stop_budget(broker, 60_000, default_max_hold=90_000)
        assert "lock_max_hold=90000 ms" in stop_warnings(caplog)["unbounded"]
        assert "held" not in stop_warnings(caplog)  # its own option beats the middleware's default
    finally:
        broker.close()


def test_the_shutdown_timeout_comes_from_the_environment_outside_the_dramatiq_command(
    broker: RedisBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert worker_shutdown_timeout({}) is None  # pytest is no dramatiq worker process
    assert worker_shutdown_timeout({SHUTDOWN_TIMEOUT_ENV: "45000"}) == 45_000
    caplog.set_level(logging.WARNING)
    assert worker_shutdown_timeout({SHUTDOWN_TIMEOUT_ENV: "45s"}) is None
    assert f"Ignoring {SHUTDOWN_TIMEOUT_ENV}='45s'" in caplog.text

    declare(broker, "default_limit", lock_key="c:{key}")
    caplog.clear()
    monkeypatch.delenv(SHUTDOWN_TIMEOUT_ENV, raising=False)
    assert warn_stop_budget(broker) == []  # unknown timeout: nothing checked, nothing said
    monkeypatch.setenv(SHUTDOWN_TIMEOUT_ENV, "30000")
    (warning,) = warn_stop_budget(broker)
    assert "'default_limit'" in warning and "30000 ms" in warning


# A real supervisord -----------------------------------------------------------------------------------------


def supervisor_binaries() -> tuple[str, str]:
    """``supervisord`` and ``supervisorctl``, installing Debian's ``supervisor`` if missing and root."""
    if shutil.which("supervisord") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "supervisor"],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            capture_output=True,
            timeout=300,
            check=False,
        )
    supervisord, supervisorctl = shutil.which("supervisord"), shutil.which("supervisorctl")
    if supervisord is None or supervisorctl is None:
        pytest.skip("supervisord is not installed (apt-get install supervisor, as root)")
    return supervisord, supervisorctl


class Supervised:
    """A private supervisord running the shipped program section, with a test app's command line."""

    def __init__(self, tmp_path: Path, server: EmbeddedRedis) -> None:
        self.supervisord, self.supervisorctl = supervisor_binaries()
        self.tmp_path = tmp_path
        self.section, program = shipped_program()
        self.name = self.section.split(":", 1)[1]
        argv = shlex.split(program["command"])
        self.shutdown_timeout = shutdown_timeout_of(argv)
        self.processes = int(argv[argv.index("--processes") + 1])
        # The shipped command but for the app (and the venv): its stop settings and shutdown timeout as shipped.
        dramatiq_bin = Path(sys.executable).with_name("dramatiq")
        command = [str(dramatiq_bin), "tests.apps.deploy_app", *argv[2:]]
        self.app_env = {"DEPLOY_TEST_BROKER_URL": server.url(0), "DEPLOY_TEST_LEASES_URL": server.url(1)}
        env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", ""), **self.app_env}
        program.update(
            command=shlex.join(command),
            directory=str(ROOT),
            environment=",".join([program["environment"], *(f'{k}="{v}"' for k, v in env.items())]),
            stdout_logfile=str(tmp_path / "worker.log"),
        )
        program.pop("user", None)  # the shipped user does not exist here
        for key in ("stdout_logfile_maxbytes", "stdout_logfile_backups"):
            program.pop(key, None)
        self.conf = tmp_path / "supervisord.conf"
        config = configparser.RawConfigParser()
        config["unix_http_server"] = {"file": str(tmp_path / "supervisor.sock")}
        config["supervisord"] = {
            "logfile": str(tmp_path / "supervisord.log"),
            "pidfile": str(tmp_path / "supervisord.pid"),
            "childlogdir": str(tmp_path),
            "loglevel": "info",
        }
        config["rpcinterface:supervisor"] = {
            "supervisor.rpcinterface_factory": "supervisor.rpcinterface:make_main_rpcinterface"
        }
        config["supervisorctl"] = {"serverurl": f"unix://{tmp_path / 'supervisor.sock'}"}
        config[self.section] = program
        with self.conf.open("w") as f:
            config.write(f)
        self.record = redis.Redis.from_url(server.url(0))
        self.leases = Leases.from_url(server.url(1))
        self.proc: subprocess.Popen[bytes] | None = None
        self.worker_pid: int | None = None

    def start(self) -> None:
        """Start supervisord in the foreground and wait until every worker process consumes."""
        self.proc = subprocess.Popen(
            [self.supervisord, "--nodaemon", "--configuration", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        waiting(self, lambda: "RUNNING" in self.ctl("status", self.name).stdout, 60, "the program to run")
        self.worker_pid = int(self.ctl("pid", self.name).stdout.strip())
        waiting(
            self,
            lambda: int(self.record.zcard("dramatiq:__heartbeats__")) >= self.processes,
            60,
            f"{self.processes} worker processes to consume",
        )

    def ctl(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.supervisorctl, "--configuration", str(self.conf), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def stopping(self) -> subprocess.Popen[str]:
        """``supervisorctl stop <program>``, which returns once supervisord has seen the program stop."""
        return subprocess.Popen(
            [self.supervisorctl, "--configuration", str(self.conf), "stop", self.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def send(self, key: str) -> None:
        code = "import sys; from tests.apps import deploy_app as a; a.gated_job.send(sys.argv[1])"
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.app_env}
        subprocess.run([sys.executable, "-c", code, key], cwd=ROOT, env=env, check=True, timeout=60)

    def runs(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in (json.loads(x) for x in self.record.lrange("runs", 0, -1)) if r["kind"] == kind]

    def worker_log(self) -> str:
        path = self.tmp_path / "worker.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def supervisord_log(self) -> str:
        path = self.tmp_path / "supervisord.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return f"supervisord:\n{self.supervisord_log()[-3000:]}\nworker:\n{self.worker_log()[-3000:]}"

    def close(self) -> None:
        """Stop supervisord; whatever is left of the worker's process group, SIGKILLed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.worker_pid is not None:
            with contextlib.suppress(ProcessLookupError):  # supervisord gives each program a group of its own
                os.killpg(self.worker_pid, signal.SIGKILL)
        self.record.close()


@pytest.fixture
def supervised(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Supervised]:
    s = Supervised(tmp_path, redis_server)
    yield s
    s.close()


def waiting(s: Supervised, predicate: Callable[[], T], timeout: float, what: str) -> T:
    """:func:`wait_for`, failing with the logs and Redis keys as they are at the deadline."""
    return wait_for(
        predicate,
        timeout=timeout,
        interval=0.05,
        what=what,
        details=lambda: f"{s.logs()}\nbroker keys: {s.record.keys()}",
    )


def start_gated_job(s: Supervised, key: str) -> dict[str, Any]:
    """Send the gated job and wait until it runs under its lease."""
    s.send(key)
    (started,) = waiting(s, lambda: s.runs("started"), 30, "the job to start")
    assert s.leases.inspect(f"deploy:{key}") is not None
    return started


@pytest.mark.system
@pytest.mark.timeout(180)
def test_supervisorctl_stop_lets_the_leased_job_finish_and_release_its_lease(supervised: Supervised) -> None:
    s = supervised
    s.start()
    started = start_gated_job(s, "x")
    # Found in the worker process from the dramatiq command line: what the boot check compares with.
    assert started["shutdown_timeout"] == s.shutdown_timeout

    stop = s.stopping()
    waiting(s, lambda: "Shutting down..." in s.worker_log(), 30, "the shutdown to begin")
    # supervisord is waiting for the worker, which is waiting for the job: open the gate only now.
    assert stop.poll() is None and not s.runs("done")
    s.record.set("gate:x", 1)
    output, _ = stop.communicate(timeout=60)
    assert stop.returncode == 0 and f"{s.name}: stopped" in output, output

    (done,) = s.runs("done")
    assert done["gated"] and done["fence"] == started["fence"], "the job ran to its end"
    assert list(s.leases.scan()) == [], "the lease was left behind"
    fences = s.leases.fence_state("deploy:x")
    assert fences["released"] == fences["fence"] == started["fence"], f"not released by its holder: {fences}"
    assert not fences.get("expired"), f"the lease ended by expiry: {fences}"
    log = s.supervisord_log()
    assert f"stopped: {s.name} (exit status 0)" in log, s.logs()
    assert "SIGKILL" not in log, s.logs()
    assert "Killing worker process" not in s.worker_log(), s.logs()


@pytest.mark.system
@pytest.mark.timeout(120)
def test_the_worker_warns_at_boot_of_an_actor_outlasting_its_shutdown_timeout(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """LeaseMiddleware's ``after_worker_boot`` runs the check against the dramatiq command's shutdown timeout."""
    log_path = tmp_path / "worker.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DEPLOY_TEST_BROKER_URL": redis_server.url(0),
        "DEPLOY_TEST_LEASES_URL": redis_server.url(1),
        "DEPLOY_TEST_OVERLONG": "1",
    }
    argv = [sys.executable, "-m", "dramatiq", "tests.apps.deploy_app", "--processes", "1", "--threads", "1"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*argv, "--worker-shutdown-timeout", "90000"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_for(lambda: "Worker process is ready" in log_path.read_text(), timeout=60, what="the worker to boot")
        text = log_path.read_text()
        assert "Actor 'overlong_job' runs up to its time_limit=3600000 ms" in text, text
        assert "shutdown timeout of 90000 ms" in text, text
        assert "'gated_job'" not in text, "a 60 s time limit fits in 90 s"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
