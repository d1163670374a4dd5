"""Lease metrics where users scrape them, clean for promtool, free of lease keys.

Metrics come from real ``dramatiq`` worker processes (``--processes 2 --threads 2``, app
``tests.apps.obs_app``) on a private Redis, scraped over HTTP: on Dramatiq's own Prometheus endpoint
whichever of the two middleware was added first, or on the lease middleware's own endpoint when
Dramatiq's is absent. The exporter's exposition comes from a real ``dramatiq-leases exporter``.
OpenTelemetry's side is in tests/test_otel_metrics.py (metrics) and tests/test_tracing.py (spans).

The process, HTTP and exposition helpers here are shared with tests/test_observability_e2e.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from dramatiq.brokers.redis import RedisBroker
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from dramatiq_leases import Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.exposition import forget_dead_processes
from dramatiq_leases.prometheus import LOST_REASONS

from .support.processes import (
    LONG_ACTOR,
    LONG_QUEUE,
    ROOT,
    WORK_ACTOR,
    WORK_QUEUE,
    Processes,
    assert_no_lease_keys,
    assert_promtool_clean,
    clean_env,
    dramatiq_argv,
    events,
    exporter_argv,
    http_get,
    listening,
    send,
    value,
    values,
    wait_until,
    worker_processes,
)

# --- worker endpoints -------------------------------------------------------------------------------

#: Where Dramatiq's Prometheus middleware goes relative to LeaseMiddleware (tests/apps/obs_app.py).
PLACEMENTS = {"prometheus-added-first": "before", "prometheus-added-last": "after", "no-prometheus": "none"}
#: Lease keys of the worker runs: user data, as real keys are.
WORKER_KEYS = ("invoice:1001", "user:alice@example.com:export")


@dataclass
class WorkerRun:
    placement: str
    exposition: str
    sent: int
    pids: set[int]
    dramatiq_port: int
    own_port: int


@pytest.fixture(scope="module", params=list(PLACEMENTS.values()), ids=list(PLACEMENTS))
def worker_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerRun]:
    """One `dramatiq` instance (2 processes x 2 threads) has run contended messages; its endpoint's exposition."""
    placement: str = request.param
    tmp = tmp_path_factory.mktemp(f"worker-{placement}")
    dramatiq_port, own_port = free_port(), free_port()
    server = EmbeddedRedis().start()
    broker = RedisBroker(url=server.url(0), middleware=[])  # type: ignore[no-untyped-call]
    client = redis.Redis.from_url(server.url(0))
    leases_client = redis.Redis.from_url(server.url(1))
    try:
        with Processes(tmp / "logs") as procs:
            env = clean_env(
                OBS_BROKER_URL=server.url(0),
                OBS_LEASES_URL=server.url(1),
                OBS_PROMETHEUS=placement,
                dramatiq_prom_host="127.0.0.1",
                dramatiq_prom_port=str(dramatiq_port),
                dramatiq_prom_db=str(tmp / "dramatiq-prometheus"),
                DRAMATIQ_LEASES_METRICS_HOST="127.0.0.1",
                DRAMATIQ_LEASES_METRICS_PORT=str(own_port),
                DRAMATIQ_LEASES_METRICS_DIR=str(tmp / "lease-metrics"),
            )
            procs.start("worker", dramatiq_argv(processes=2, threads=2, queues=[WORK_QUEUE]), env=env)
            url = f"http://127.0.0.1:{own_port if placement == 'none' else dramatiq_port}/metrics"
            wait_until(
                lambda: worker_processes(client) == 2 and http_get(url) is not None,
                timeout=30,
                what="2 worker processes and the metrics endpoint",
                procs=procs,
            )

            # Waves of three messages per key at once: contention, busy retries, renewals (a 0.6 s hold
            # with a 1.5 s TTL is renewed). Until both processes have run some, so that the endpoint
            # must add up the two.
            sent = 0
            for _ in range(8):
                for key in WORKER_KEYS:
                    for _ in range(3):
                        send(broker, WORK_ACTOR, WORK_QUEUE, key, 0.6)
                        sent += 1
                wait_until(
                    lambda n=sent: sum(e["event"] == "done" for e in events(leases_client)) == n,  # type: ignore[misc]  # mypy cannot type a lambda's default, which binds the loop variable
                    timeout=30,
                    what=f"{sent} messages to run",
                    procs=procs,
                )
                if len({e["pid"] for e in events(leases_client)}) == 2:
                    break
            runs = events(leases_client)
            assert [e for e in runs if e["event"] == "error"] == []

            def settled() -> str | None:
                # Hold times and the held gauge are written by the heartbeat threads once each lease is
                # released, after the actor returned: wait until all are in, the gauge included.
                text = http_get(url)
                if (
                    text
                    and value(text, "dramatiq_lease_hold_duration_seconds_count", actor_name=WORK_ACTOR) == sent
                    and values(text, "dramatiq_lease_held", actor_name=WORK_ACTOR) == [0]
                ):
                    return text
                return None

            exposition = wait_until(settled, timeout=15, what=f"{sent} holds on {url}", procs=procs)
            yield WorkerRun(placement, exposition, sent, {e["pid"] for e in runs}, dramatiq_port, own_port)
    finally:
        broker.close()
        client.close()
        leases_client.close()
        server.close()


@pytest.mark.system
def test_lease_metrics_are_served_for_all_worker_processes(worker_run: WorkerRun) -> None:
    text, sent = worker_run.exposition, worker_run.sent
    actor = {"actor_name": WORK_ACTOR, "queue_name": WORK_QUEUE}
    assert len(worker_run.pids) == 2, "both worker processes ran messages"
    # Every message acquired its lease exactly once, whichever process ran it: the figures are summed.
    assert value(text, "dramatiq_lease_acquire_duration_seconds_count", outcome="acquired", **actor) == sent
    assert value(text, "dramatiq_lease_wait_duration_seconds_count", **actor) == sent
    assert value(text, "dramatiq_lease_hold_duration_seconds_count", **actor) == sent
    busy = value(text, "dramatiq_lease_acquire_duration_seconds_count", outcome="busy", **actor)
    assert busy > 0, "three messages per key at once must contend"
    # Waiters wait in place or park: each park is a busy retry, and follows a busy answer.
    assert value(text, "dramatiq_lease_busy_retries_total", **actor) <= busy
    assert 0 < value(text, "dramatiq_lease_handoff_duration_seconds_count", **actor) < sent
    assert value(text, "dramatiq_lease_renewals_total", outcome="ok", **actor) > 0
    assert value(text, "dramatiq_lease_renew_duration_seconds_count") > 0
    assert values(text, "dramatiq_lease_held", **actor) == [0], "every lease was released"
    # What did not happen is there at zero (so that increase() sees a first event), for every
    # actor, even one that has not run yet.
    for labels in (actor, {"actor_name": LONG_ACTOR, "queue_name": LONG_QUEUE}):
        assert values(text, "dramatiq_lease_lost_total", **labels) == [0] * len(LOST_REASONS)
        assert values(text, "dramatiq_lease_gave_up_total", **labels) == [0]
    assert values(text, "dramatiq_lease_busy_retries_total", actor_name=LONG_ACTOR) == [0]
    assert values(text, "dramatiq_lease_redis_errors_total") == [0, 0, 0]  # acquire, renew, release


@pytest.mark.system
def test_one_endpoint_serves_dramatiq_and_lease_metrics(worker_run: WorkerRun) -> None:
    dramatiq_messages = value(worker_run.exposition, "dramatiq_messages_total", actor_name=WORK_ACTOR)
    if worker_run.placement == "none":
        # No Dramatiq endpoint: the lease middleware serves its own, with lease metrics only.
        assert dramatiq_messages == 0 and not listening(worker_run.dramatiq_port)
        families = {family.name for family in text_string_to_metric_families(worker_run.exposition)}
        assert all(name.startswith("dramatiq_lease_") for name in families), families
    else:
        # Dramatiq's endpoint has both; the lease middleware did not start a second one.
        assert dramatiq_messages >= worker_run.sent
        assert not listening(worker_run.own_port)


@pytest.mark.system
def test_an_inherited_multiprocess_dir_does_not_hide_the_metrics(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    port = free_port()
    db = tmp_path / "dramatiq-prometheus"
    env = clean_env(
        OBS_BROKER_URL=redis_server.url(0),
        OBS_LEASES_URL=redis_server.url(1),
        OBS_PROMETHEUS="before",
        dramatiq_prom_host="127.0.0.1",
        dramatiq_prom_port=str(port),
        dramatiq_prom_db=str(db),
        # Set for another program in the same image, say gunicorn.
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "elsewhere"),
    )
    (tmp_path / "elsewhere").mkdir()
    broker = RedisBroker(url=redis_server.url(0), middleware=[])  # type: ignore[no-untyped-call]
    leases_client = redis.Redis.from_url(redis_server.url(1))
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        with Processes(tmp_path / "logs") as procs:
            procs.start("worker", dramatiq_argv(processes=1, threads=1, queues=[WORK_QUEUE]), env=env)
            wait_until(lambda: http_get(url) is not None, timeout=30, what="the metrics endpoint", procs=procs)
            send(broker, WORK_ACTOR, WORK_QUEUE, "invoice:1", 0.0)
            wait_until(
                lambda: any(e["event"] == "done" for e in events(leases_client)),
                timeout=20,
                what="the message to run",
                procs=procs,
            )
            # The acquisition is counted before the actor runs: it must be on the endpoint by now.
            text = http_get(url) or ""
            assert value(text, "dramatiq_lease_acquire_duration_seconds_count", actor_name=WORK_ACTOR) == 1
            assert "dramatiq_messages_inprogress{" in text, "Dramatiq's own metrics are there too"
    finally:
        broker.close()
        leases_client.close()


@pytest.mark.system
def test_worker_exposition_passes_promtool(worker_run: WorkerRun) -> None:
    assert_promtool_clean(worker_run.exposition, foreign_ok=worker_run.placement != "none")


@pytest.mark.system
def test_worker_metrics_never_carry_lease_keys(worker_run: WorkerRun) -> None:
    assert_no_lease_keys(worker_run.exposition, WORKER_KEYS)


def compose_command(service: str, compose: dict[str, Any]) -> list[str]:
    """A docker-compose.yml service's command, run with this interpreter."""
    command = compose["services"][service]["command"]
    assert isinstance(command, list)
    program, *args = command
    if program == "python":
        return [sys.executable, *args]
    assert program == "dramatiq", command
    return [sys.executable, "-m", "dramatiq", *args]


@pytest.mark.system
def test_compose_example_serves_lease_metrics(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    # examples/compose_app.py and compose_producer.py, run as docker-compose.yml runs them, with the
    # URLs it gives pointed at a private Redis (same databases).
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    urls = {name: urllib.parse.urlsplit(url) for name, url in compose["x-app"]["environment"].items()}
    env = clean_env(**{name: f"redis://127.0.0.1:{redis_server.port}{url.path}" for name, url in urls.items()})
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with Processes(tmp_path / "logs") as procs:
        procs.start(
            "worker",
            [*compose_command("worker", compose), "--processes", "1", "--threads", "4"],
            env={
                **env,
                "dramatiq_prom_host": "127.0.0.1",
                "dramatiq_prom_port": str(port),
                "dramatiq_prom_db": str(tmp_path / "dramatiq-prometheus"),
            },
        )
        wait_until(lambda: http_get(url), timeout=30, what="the worker's metrics endpoint", procs=procs)
        # Two invoices rather than five: contention within seconds.
        procs.start("producer", compose_command("producer", compose), env={**env, "INVOICE_IDS": "2"})

        def contended() -> str | None:
            # Lease metrics and Dramatiq's own, on one endpoint: busy retries, and messages done.
            text = http_get(url)
            if text and all(
                value(text, name, actor_name="send_invoice", queue_name="invoices") > 0
                for name in (
                    "dramatiq_lease_busy_retries_total",
                    "dramatiq_lease_hold_duration_seconds_count",
                    "dramatiq_messages_total",
                )
            ):
                return text
            return None

        text = wait_until(contended, timeout=45, what="busy retries and completed send_invoice messages", procs=procs)
    assert_no_lease_keys(text, ["invoice:1", "invoice:2"])


# --- exporter endpoint ------------------------------------------------------------------------------

ALIVE_KEY, LEAKED_KEY, EXPIRING_KEY = "user:bob@example.com:export", "invoice:2001", "invoice:2002"
OVERDUE_KEY = "invoice:2003"


@pytest.fixture(scope="module")
def exporter_exposition(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`dramatiq-leases exporter` has seen a live lease, an overdue one, a leaked one and one that expired."""
    tmp = tmp_path_factory.mktemp("exporter")
    server = EmbeddedRedis().start()
    leases = Leases.from_url(server.url(1))
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        with Processes(tmp / "logs") as procs:
            procs.start("exporter", exporter_argv(server.url(1), port, 0.2), env=clean_env())
            wait_until(lambda: http_get(url), timeout=20, what="the exporter's endpoint", procs=procs)
            web = {"actor": "export_report", "queue": "default"}
            work = {"actor": WORK_ACTOR, "queue": WORK_QUEUE}
            assert leases.try_acquire(ALIVE_KEY, 60_000, meta=web)
            # Renewed every 100 ms by nobody: overdue after 2 x 100 + 500 ms, but its holder may still run
            # until its deadline, 54 s after the grant: overdue, not leaked.
            assert leases.try_acquire(OVERDUE_KEY, 60_000, interval=100, meta=work)
            # Its holder's deadline is 0.9 s after the grant, and the key outlives it (TTL extended by hand).
            assert leases.try_acquire(LEAKED_KEY, 1_000, interval=300, meta=work)
            leases.client.pexpire(leases.lease_name(LEAKED_KEY), 60_000)
            assert leases.try_acquire(EXPIRING_KEY, 1_000, interval=300, meta=work)
            # Two messages of the web actor wait in the line of the live lease.
            for n in (1, 2):
                assert not leases.line.join(ALIVE_KEY, 60_000, meta=web, waiter=f"m{n}:0", first_ms=n)

            def seen_all() -> str | None:
                text = http_get(url)
                if (
                    text
                    and value(text, "dramatiq_lease_leaked", reason="holder_dead", actor_name=WORK_ACTOR) == 1
                    and value(text, "dramatiq_lease_heartbeat_overdue", actor_name=WORK_ACTOR) == 1
                    and value(text, "dramatiq_lease_expired_total", actor_name=WORK_ACTOR) == 1
                    and value(text, "dramatiq_lease_waiting", actor_name="export_report") == 2
                ):
                    return text
                return None

            text = wait_until(
                seen_all, timeout=15, what="the overdue heartbeat, the leak and the expiry on the exporter", procs=procs
            )
            assert value(text, "dramatiq_lease_leaked", actor_name=WORK_ACTOR) == 1, "an overdue heartbeat is no leak"
            assert value(text, "dramatiq_lease_present", actor_name="export_report") == 1
            assert value(text, "dramatiq_lease_heartbeat_overdue", actor_name="export_report") == 0
            yield text
    finally:
        leases.client.close()
        server.close()


def test_exporter_exposition_passes_promtool(exporter_exposition: str) -> None:
    assert_promtool_clean(exporter_exposition)


def test_exporter_metrics_never_carry_lease_keys(exporter_exposition: str) -> None:
    assert_no_lease_keys(exporter_exposition, [ALIVE_KEY, OVERDUE_KEY, LEAKED_KEY, EXPIRING_KEY])


def test_a_killed_workers_held_leases_are_not_summed_in_forever(tmp_path: Path) -> None:
    """A SIGKILLed process never marks itself dead; the next worker to boot sweeps its live gauges."""
    directory = tmp_path / "multiproc"
    directory.mkdir()
    code = (
        "import os, signal\n"
        "from dramatiq_leases.prometheus import PrometheusMetrics\n"
        "PrometheusMetrics().held({'actor': 'charge', 'queue': 'q'}, 1)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -signal.SIGKILL

    def held() -> float:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
        return sum(
            sample.value
            for family in registry.collect()
            if family.name == "dramatiq_lease_held"
            for sample in family.samples
        )

    assert held() == 1.0  # what an endpoint would report for good
    forget_dead_processes(str(directory))
    assert held() == 0.0


def test_a_worker_without_leased_actors_still_serves_lease_series(redis_server: EmbeddedRedis) -> None:
    """DramatiqLeaseWorkerMetricsMissing reads a target without lease series as one whose endpoint is
    not ours: a worker of the same app running only plain actors must not look like that."""
    from dramatiq.brokers.stub import StubBroker

    from dramatiq_leases import LeaseMiddleware, PrometheusMetrics

    registry = CollectorRegistry()
    middleware = LeaseMiddleware(
        redis_server.url(0), metrics=PrometheusMetrics(registry=registry), metrics_endpoint=False
    )
    broker = StubBroker(middleware=[middleware])
    broker.emit_after("process_boot")
    operations = {
        labels["operation"]
        for name, labels in ((s.name, s.labels) for family in registry.collect() for s in family.samples)
        if name == "dramatiq_lease_redis_errors_total"
    }
    assert operations == {"acquire", "renew", "release"}
    broker.close()
