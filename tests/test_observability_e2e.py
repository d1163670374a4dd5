"""The observability bundle end to end, with real Prometheus, Alertmanager, Redis and worker processes.

Debian's ``prometheus`` scrapes two `dramatiq` worker instances (Dramatiq's Prometheus middleware)
and ``dramatiq-leases exporter`` every second, evaluating the project's own alert rules;
``prometheus-alertmanager`` routes the alerts to a webhook receiver in this process. Their
configurations are derived from the shipped ones (deploy/, alerts/): only addresses are pointed
at this run, every target carries the cluster label (``cluster="e2e"``), and ``for:`` durations and
Alertmanager's timers divided by :data:`SHORTEN`.

The workload: contended messages (busy retries, waits, renewals), a message that gives up waiting,
a lease deleted under its holder (lost), a long-TTL lease whose holder is SIGKILLed, and a lease whose
TTL is extended by hand past its holder's deadline. Asserted: the killed holder's lease is
``heartbeat_overdue`` (it may still be running, for all anyone outside can tell), not leaked, and
``release --if-dead`` refuses it; the overdue gauge rises, and falls back once the TTL has run out,
and the expired counter moves; the extended lease is leaked, pages, and ``release --if-dead`` frees
it, with the cluster label kept; the exporter's Busy view lists it first while it lasts; the killed
worker's target warns that its lease metrics are missing; the recording rules the alerts share have
data; the warnings reach the ticket webhook; every Prometheus query of every dashboard returns data at
some point of the run.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
import yaml
from dramatiq.brokers.redis import RedisBroker

from dramatiq_leases import LeaseInfo, Leases
from dramatiq_leases.cli import main as cli_main
from dramatiq_leases.core import Lease, State
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.exporter import DEFAULT_PORT as EXPORTER_PORT

from .support.processes import (
    LONG_ACTOR,
    LONG_QUEUE,
    WORK_ACTOR,
    WORK_QUEUE,
    Processes,
    clean_env,
    dramatiq_argv,
    events,
    exporter_argv,
    http_get,
    send,
    worker_processes,
)
from .support.promtool import require

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "alerts" / "dramatiq-leases.rules.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))

#: Dramatiq's Prometheus middleware's default port: the shipped worker targets use it.
DRAMATIQ_PROM_PORT = 9191
#: The cluster label's value on every target of this run.
CLUSTER = "e2e"
#: Every ``for:`` of the rules and every Alertmanager timer is divided by this, to at least 1 s.
SHORTEN = 30
#: Values of Grafana's built-in variables: 1 s scrapes, and a range covering the whole run.
GRAFANA_BUILTINS = {
    "__rate_interval": "15s",
    "__interval": "1s",
    "__interval_ms": "1000",
    "__range": "5m",
    "__range_s": "300",
    "__range_ms": "300000",
}

CONTENDED_KEYS = ("invoice:1", "invoice:2")
GAVE_UP_KEY, LOST_KEY, CRASH_KEY, PAUSED_KEY = "invoice:gave-up", "invoice:lost", "invoice:crash", "invoice:paused"
LEAKED_KEY = "invoice:leaked"
#: Redis paused for writes. A heartbeat renews its due leases in one round at a time, and a round
#: waits out the clients' 2 s socket timeout: the pause covers two rounds plus a renew interval of
#: the lease held across it (500 ms), so that one of its renewals fails.
PAUSE_MS = 5_500
TTL_MS = 1_500  # contended work: renewed every 500 ms
LONG_TTL_MS, LONG_RENEW_MS = 15_000, 1_000  # the lease whose holder is killed

T = TypeVar("T")


# --- configurations derived from the shipped files --------------------------------------------------


def seconds(duration: str) -> float:
    """Seconds in a Prometheus duration such as 30s, 5m or 1h30m."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|[smhdwy])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(int(n) * units[u] for n, u in parts)


def shorten(duration: str) -> str:
    return f"{max(1, int(seconds(duration) / SHORTEN))}s"


def shortened_rules() -> dict[str, Any]:
    """The shipped alert rules with only their ``for:`` durations shortened."""
    rules: dict[str, Any] = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = shorten(rule["for"])
    return rules


def alertmanager_config(webhook: str) -> dict[str, Any]:
    """The shipped Alertmanager config, receivers pointed at ``webhook`` (same paths), timers shortened."""
    config: dict[str, Any] = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())

    def walk(route: dict[str, Any]) -> None:
        for timer in ("group_wait", "group_interval", "repeat_interval"):
            if timer in route:
                route[timer] = shorten(route[timer])
        for child in route.get("routes", []):
            walk(child)

    walk(config["route"])
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = webhook + urllib.parse.urlsplit(hook["url"]).path
    return config


def prometheus_config(
    workers: list[str], exporter: str, alertmanager: str, rules: Path
) -> tuple[dict[str, Any], str, str]:
    """The shipped Prometheus config on this run's addresses, scraping and evaluating every second.

    Returns it with the names of the worker job and of the exporter job, as shipped.
    """
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(rules)]
    config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    jobs: dict[int, str] = {}
    for job in config["scrape_configs"]:
        ports = {int(target.rsplit(":", 1)[1]) for static in job["static_configs"] for target in static["targets"]}
        assert len(ports) == 1 and ports <= {DRAMATIQ_PROM_PORT, EXPORTER_PORT}, f"{job['job_name']}: {ports}"
        (port,) = ports
        jobs[port] = job["job_name"]
        job["static_configs"] = [
            {"targets": workers if port == DRAMATIQ_PROM_PORT else [exporter], "labels": {"cluster": CLUSTER}}
        ]
    return config, jobs[DRAMATIQ_PROM_PORT], jobs[EXPORTER_PORT]


# --- Grafana dashboards -----------------------------------------------------------------------------

_GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def to_promql(expr: str, variables: dict[str, str]) -> str:
    """A Grafana query as Grafana sends it: built-ins at this run's values, dashboard variables as given."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        known = {**GRAFANA_BUILTINS, **variables}
        assert name in known, f"no value for the Grafana variable ${name} in {expr!r}"
        return known[name]

    return _GRAFANA_VARIABLE.sub(value, expr)


def dashboard_queries(variables: dict[str, str]) -> dict[str, tuple[str, str | None]]:
    """Every query of every dashboard: {name: (PromQL, label a variable query lists, else None)}."""
    queries: dict[str, tuple[str, str | None]] = {}
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        panels = [p for panel in board["panels"] for p in (panel, *panel.get("panels", []))]
        for panel in panels:
            for target in panel.get("targets", []):
                if "expr" not in target:
                    continue  # the Busy view reads the exporter's JSON, not Prometheus
                queries[f"{path.stem}: panel {panel['title']!r} {target['refId']}"] = (
                    to_promql(target["expr"], variables),
                    None,
                )
        for annotation in board.get("annotations", {}).get("list", []):
            if "expr" in annotation:
                queries[f"{path.stem}: annotation {annotation['name']!r}"] = (
                    to_promql(annotation["expr"], variables),
                    None,
                )
        for variable in board.get("templating", {}).get("list", []):
            if variable["type"] == "query":
                match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"])
                assert match, f"{path.name}: variable {variable['name']}: expected label_values(selector, label)"
                queries[f"{path.stem}: variable ${variable['name']}"] = (
                    to_promql(match.group(1), variables),
                    match.group(2),
                )
    assert queries, "no dashboard queries"
    return queries


# --- Prometheus API, webhook receiver ---------------------------------------------------------------


class QueryError(Exception):
    """Prometheus refused a query (HTTP 400: it does not parse; 422: it cannot be evaluated)."""


def prom_query(base: str, expr: str) -> list[dict[str, Any]]:
    """The result of an instant query, as a list of samples."""
    data = urllib.parse.urlencode({"query": expr}).encode()
    try:
        with urllib.request.urlopen(f"{base}/api/v1/query", data=data, timeout=5) as response:
            body = json.load(response)
    except urllib.error.HTTPError as e:
        if e.code in (400, 422):
            raise QueryError(f"{e.code} for {expr!r}: {e.read().decode(errors='replace')}") from None
        raise
    result = body["data"]
    if result["resultType"] == "scalar":
        return [{"metric": {}, "value": result["result"]}]
    return list(result["result"])


def numbers(samples: list[dict[str, Any]]) -> list[float]:
    return [float(sample["value"][1]) for sample in samples]


def drawn(samples: list[dict[str, Any]]) -> tuple[bool, bool]:
    """Whether Grafana would draw something (a sample that is a number: histogram_quantile of nothing is
    NaN), and whether it would be more than a flat zero."""
    values = [x for x in numbers(samples) if not math.isnan(x)]
    return bool(values), any(x != 0 for x in values)


class Webhook:
    """An HTTP server recording the JSON bodies POSTed to it: Alertmanager's webhook receiver."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.posts: list[tuple[str, dict[str, Any]]] = []
        posts, lock = self.posts, self.lock

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    posts.append((self.path, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="webhook", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def alerts(self, path: str) -> list[dict[str, Any]]:
        """Alerts notified on ``path``, firing or resolved."""
        with self.lock:
            return [alert for posted, body in self.posts if posted == path for alert in body["alerts"]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class DashboardWatch:
    """Polls every dashboard query once a second, noting which have returned data, and which non-zero data."""

    def __init__(self, base: str, queries: dict[str, tuple[str, str | None]], expected: dict[str, set[str]]) -> None:
        self.base = base
        self.queries = queries
        self.expected = expected  # label values some variable queries must list
        self.seen: dict[str, float] = {}
        self.moved: dict[str, float] = {}
        self.last: dict[str, str] = {}
        self.error: str | None = None
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dashboard-watch", daemon=True)

    def __enter__(self) -> DashboardWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(10)

    def start(self) -> None:
        self.started = time.monotonic()
        self.thread.start()

    def pending(self) -> list[str]:
        return [name for name in self.queries if name not in self.moved]

    def _check(self, name: str, expr: str, label: str | None) -> None:
        samples = prom_query(self.base, expr)
        self.last[name] = json.dumps(samples)[:300]
        if label is None:
            data, moved = drawn(samples)
        else:
            # A variable's options: the values of `label` over the series found.
            values = {sample["metric"].get(label) for sample in samples} - {None}
            data = moved = bool(values) and self.expected.get(name.rsplit("$", 1)[1], set()) <= values
        now = time.monotonic() - self.started
        if data:
            self.seen.setdefault(name, now)
        if moved:
            self.moved[name] = now

    def _run(self) -> None:
        while not self.stop.is_set():
            for name in self.pending():
                expr, label = self.queries[name]
                try:
                    self._check(name, expr, label)
                except QueryError as e:
                    self.error = f"{name}: {e}"
                    return
                except OSError as e:  # Prometheus busy or restarting: try again next round
                    self.last[name] = f"{type(e).__name__}: {e}"
            self.stop.wait(1.0)


# --- the test -----------------------------------------------------------------------------------------


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.close()


@pytest.fixture
def lease_server() -> Iterator[EmbeddedRedis]:
    """The leases' Redis, apart from the broker's so that it alone can be paused."""
    server = EmbeddedRedis().start()
    yield server
    server.close()


def http_ready(url: str) -> bool:
    return http_get(url) is not None


def test_bundle_end_to_end(
    redis_server: EmbeddedRedis, lease_server: EmbeddedRedis, webhook: Webhook, tmp_path: Path
) -> None:
    prometheus_bin, alertmanager_bin = require("prometheus"), require("prometheus-alertmanager")
    started = time.monotonic()
    ports = main_port, victim_port, exporter_port, am_port, prom_port = tuple(free_port() for _ in range(5))
    assert len(set(ports)) == len(ports)
    prom = f"http://127.0.0.1:{prom_port}"

    # Configurations, from the shipped files.
    rules = tmp_path / "dramatiq-leases.rules.yml"
    rules.write_text(yaml.safe_dump(shortened_rules(), sort_keys=False))
    am_config = tmp_path / "alertmanager.yml"
    am_config.write_text(yaml.safe_dump(alertmanager_config(webhook.url), sort_keys=False))
    config, worker_job, exporter_job = prometheus_config(
        [f"127.0.0.1:{main_port}", f"127.0.0.1:{victim_port}"],
        f"127.0.0.1:{exporter_port}",
        f"127.0.0.1:{am_port}",
        rules,
    )
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(yaml.safe_dump(config, sort_keys=False))
    queries = dashboard_queries(
        {"job": worker_job, "exporter_job": exporter_job, "instance": ".*", "actor": ".*", "cluster": CLUSTER}
    )
    # What the variables must list: the workers that stay up (the victim's series go with it).
    options = {
        "job": {worker_job},
        "exporter_job": {exporter_job},
        "actor": {WORK_ACTOR},
        "instance": {f"127.0.0.1:{main_port}"},
        "cluster": {CLUSTER},
    }
    receivers = {
        receiver["name"]: receiver for receiver in yaml.safe_load(ALERTMANAGER_CONFIG.read_text())["receivers"]
    }
    pager_path, ticket_path = (
        urllib.parse.urlsplit(receivers[name]["webhook_configs"][0]["url"]).path for name in ("pager", "ticket")
    )

    broker = RedisBroker(url=redis_server.url(0), middleware=[])  # type: ignore[no-untyped-call]
    broker_client = redis.Redis.from_url(redis_server.url(0))
    leases = Leases.from_url(lease_server.url(0))
    stop_feeding = threading.Event()
    feeder = threading.Thread(target=lambda: feed(broker, stop_feeding), name="feeder", daemon=True)
    with Processes(tmp_path / "logs") as procs, DashboardWatch(prom, queries, options) as watch:

        def until(predicate: Callable[[], T | None], timeout: float, what: str) -> T:
            deadline = time.monotonic() + timeout
            while True:
                procs.check_running()
                if watch.error:
                    pytest.fail(f"a dashboard query fails: {watch.error}", pytrace=False)
                result = predicate()
                if result:
                    return result
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"timed out after {timeout:.0f}s ({time.monotonic() - started:.0f}s into the run) "
                        f"waiting for {what}\n{procs.report()}",
                        pytrace=False,
                    )
                time.sleep(0.2)

        def scalar(expr: str) -> float | None:
            samples = prom_query(prom, expr)
            return numbers(samples)[0] if samples else None

        def event(kind: str, key: str) -> bool:
            return any(e["event"] == kind and e["key"] == key for e in events(leases.client))

        try:
            # Start: Alertmanager, Prometheus, the exporter, two worker instances.
            procs.start(
                "alertmanager",
                [
                    alertmanager_bin,
                    f"--config.file={am_config}",
                    f"--storage.path={tmp_path / 'alertmanager'}",
                    f"--web.listen-address=127.0.0.1:{am_port}",
                    "--cluster.listen-address=",
                ],
            )
            procs.start(
                "prometheus",
                [
                    prometheus_bin,
                    f"--config.file={prom_config}",
                    f"--storage.tsdb.path={tmp_path / 'prometheus'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
            )
            procs.start("exporter", exporter_argv(lease_server.url(0), exporter_port, 0.5), env=clean_env())
            app = {
                "OBS_BROKER_URL": redis_server.url(0),
                "OBS_LEASES_URL": lease_server.url(0),
                "OBS_PROMETHEUS": "after",
                "OBS_TTL_MS": str(TTL_MS),
                "OBS_LONG_TTL_MS": str(LONG_TTL_MS),
                "OBS_LONG_RENEW_MS": str(LONG_RENEW_MS),
                "dramatiq_prom_host": "127.0.0.1",
            }
            procs.start(
                "worker",
                dramatiq_argv(processes=2, threads=3, queues=[WORK_QUEUE]),
                env=clean_env(**app, dramatiq_prom_port=str(main_port), dramatiq_prom_db=str(tmp_path / "prom-worker")),
            )
            # The one to be killed runs alone: Dramatiq stops a whole instance when one of its
            # processes dies, and the other workers must carry on (and stay scraped).
            procs.start(
                "victim",
                dramatiq_argv(processes=1, threads=1, queues=[LONG_QUEUE]),
                env=clean_env(
                    **app, dramatiq_prom_port=str(victim_port), dramatiq_prom_db=str(tmp_path / "prom-victim")
                ),
            )
            until(
                lambda: http_ready(f"{prom}/-/ready") and http_ready(f"http://127.0.0.1:{am_port}/-/ready"),
                30,
                "Prometheus and Alertmanager to be ready",
            )
            until(lambda: worker_processes(broker_client) == 3, 30, "3 worker processes to poll their queues")
            until(lambda: scalar("sum(up)") == 3, 30, "Prometheus to scrape both workers and the exporter")
            watch.start()
            feeder.start()  # contention on two keys, all along

            # A long-TTL lease whose holder is SIGKILLed once it holds and has renewed.
            send(broker, LONG_ACTOR, LONG_QUEUE, CRASH_KEY, 120.0)

            def renewed() -> LeaseInfo | None:
                info = leases.inspect(CRASH_KEY)
                return info if info is not None and info.renewed_ms > info.acquired_ms else None

            holder = until(renewed, 15, "the long job to hold and renew its lease")
            assert holder.meta["actor"] == LONG_ACTOR
            procs.may_exit.add("victim")
            os.kill(int(holder.meta["pid"]), signal.SIGKILL)
            killed_at = time.monotonic()

            # A message that gives up: its key is held for longer than it may wait (300 ms).
            send(broker, WORK_ACTOR, WORK_QUEUE, GAVE_UP_KEY, 3.0)
            until(lambda: leases.inspect(GAVE_UP_KEY), 15, "the gave-up key to be held")
            send(broker, WORK_ACTOR, WORK_QUEUE, GAVE_UP_KEY, 0.0, lock_max_wait=300)
            # A lease lost under its holder: deleted from Redis while the job runs.
            send(broker, WORK_ACTOR, WORK_QUEUE, LOST_KEY, 30.0)
            until(lambda: leases.inspect(LOST_KEY), 15, "the lost key to be held")
            leases.client.delete(leases.lease_name(LOST_KEY))
            until(lambda: event("error", LOST_KEY), 10, "the job whose lease was deleted to be interrupted")

            # The killed holder: its heartbeat is overdue, but it keeps its lease until its own deadline
            # (13.5 s after its last renewal), since from outside it cannot be told from a paused holder.
            overdue = f'max(dramatiq_lease_heartbeat_overdue{{actor_name="{LONG_ACTOR}"}})'
            crash_leaked = f'sum(max by (reason) (dramatiq_lease_leaked{{actor_name="{LONG_ACTOR}"}}))'
            expired = f'max(dramatiq_lease_expired_total{{actor_name="{LONG_ACTOR}"}})'
            until(lambda: (scalar(overdue) or 0) > 0, 15, "dramatiq_lease_heartbeat_overdue > 0 in Prometheus")
            info = leases.inspect(CRASH_KEY)
            assert info is not None and info.state is State.HEARTBEAT_OVERDUE, info
            assert scalar(crash_leaked) == 0, "an overdue heartbeat is not a leak"
            assert scalar(expired) == 0, "the lease has not expired yet"
            assert cli_main(["--redis-url", lease_server.url(0), "release", CRASH_KEY, "--if-dead"]) == 1, (
                "release --if-dead must refuse a holder that may still be running"
            )
            assert leases.inspect(CRASH_KEY) is not None

            # A leak: a lease whose TTL is extended by hand past its holder's deadline (0.9 s after the grant).
            # Seen by the exporter, scraped, alerted on, paged; then released as the runbook says.
            work_meta = {"actor": WORK_ACTOR, "queue": WORK_QUEUE}
            assert isinstance(leases.try_acquire(LEAKED_KEY, 1_000, interval=300, meta=work_meta), Lease)
            leases.client.pexpire(leases.lease_name(LEAKED_KEY), 120_000)
            leaked = f'max(dramatiq_lease_leaked{{actor_name="{WORK_ACTOR}", reason="holder_dead"}})'
            until(lambda: (scalar(leaked) or 0) > 0, 15, "dramatiq_lease_leaked > 0 in Prometheus")
            # A message needs the leaked key and waits in its line: users are affected, so it pages.
            send(broker, WORK_ACTOR, WORK_QUEUE, LEAKED_KEY, 0.0)
            until(
                lambda: (scalar(f'max(dramatiq_lease_leaked_waiting{{actor_name="{WORK_ACTOR}"}})') or 0) > 0,
                15,
                "the waiting message counted on the leak",
            )

            def paged() -> list[dict[str, Any]]:
                return [
                    alert
                    for alert in webhook.alerts(pager_path)
                    if alert["status"] == "firing"
                    and alert["labels"]["alertname"] == "DramatiqLeaseLeaked"
                    and alert["labels"].get("actor_name") == WORK_ACTOR
                ]

            (alert, *_) = until(paged, 20, "the DramatiqLeaseLeaked alert at the pager webhook")
            # It pages because a message waits in the leaked key's line, in its cluster.
            labels = {
                "severity": "critical",
                "actor_name": WORK_ACTOR,
                "queue_name": WORK_QUEUE,
                "reason": "holder_dead",
                "cluster": CLUSTER,
                "job": exporter_job,
            }
            assert {name: alert["labels"].get(name) for name in labels} == labels
            assert alert["annotations"]["runbook_url"].endswith("#dramatiqleaseleaked")
            assert f"var-actor={WORK_ACTOR}&var-cluster={CLUSTER}" in alert["annotations"]["dashboard_url"]
            # The Busy view shows it first, with the command that inspects it.
            busy = json.loads(http_get(f"http://127.0.0.1:{exporter_port}/leases") or "{}")
            top = busy["leases"][0]
            assert (top["key"], top["state"], top["leaked"]) == (LEAKED_KEY, "holder_dead", True), busy["leases"][:3]
            assert "show" in top["inspect_command"] and LEAKED_KEY in top["inspect_command"]
            assert cli_main(["--redis-url", lease_server.url(0), "release", LEAKED_KEY, "--if-dead"]) == 0
            until(lambda: scalar(leaked) == 0, 15, "the leak gauge back to 0 once released")
            # The message that waited on it gets the key and runs.
            until(lambda: event("done", LEAKED_KEY), 15, "the message waiting on the leaked key to run")

            # Redis trouble while a lease is held: renewals and acquisitions fail (2 s client timeouts).
            # This lease outlives the pause, so its failed renewals count as errors (the others' as losses).
            send(broker, WORK_ACTOR, WORK_QUEUE, PAUSED_KEY, 8.0, lock_ttl=10_000, lock_renew_interval=500)
            until(lambda: leases.inspect(PAUSED_KEY), 15, "the key held across the Redis pause to be held")
            leases.client.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

            # The killed holder's TTL runs out (Redis does not expire keys while paused): counted as expired,
            # no longer overdue, and never released by anyone.
            until(
                lambda: scalar(overdue) == 0 and scalar(crash_leaked) == 0 and (scalar(expired) or 0) >= 1,
                (LONG_TTL_MS + PAUSE_MS) / 1000 + 15 - (time.monotonic() - killed_at),
                "the overdue gauge back to 0 and the expired counter up after the TTL",
            )
            # (EXISTS, a read: the pause may still hold scripts back.)
            assert not leases.client.exists(leases.lease_name(CRASH_KEY))

            # The workload shows in Prometheus as events, not just as series declared at zero...
            for expr in (
                f'sum(dramatiq_lease_busy_retries_total{{actor_name="{WORK_ACTOR}"}})',
                f'sum(dramatiq_lease_gave_up_total{{actor_name="{WORK_ACTOR}"}})',
                f'sum(dramatiq_lease_lost_total{{actor_name="{WORK_ACTOR}", reason="gone"}})',
                'sum(dramatiq_lease_renewals_total{outcome="error"})',
                "sum(dramatiq_lease_redis_errors_total)",
            ):
                until(lambda expr=expr: (scalar(expr) or 0) > 0, 10, f"{expr} > 0")  # type: ignore[misc]  # mypy cannot type a lambda's default, which binds the loop variable
            # The recording rules the alerts and the SLOs share have data, per cluster and actor.
            for expr in (
                f'job_actor:dramatiq_lease_acquire_attempts:rate5m{{actor_name="{WORK_ACTOR}", cluster="{CLUSTER}"}}',
                f'actor:dramatiq_lease_unsafe_ends_per_grant:ratio_rate5m{{actor_name="{WORK_ACTOR}"}}',
                f'actor:dramatiq_lease_gave_up_per_message:ratio_rate5m{{actor_name="{WORK_ACTOR}"}}',
            ):
                until(lambda expr=expr: (scalar(expr) or 0) > 0, 10, f"{expr} > 0")  # type: ignore[misc]  # mypy cannot type a lambda's default, which binds the loop variable
            # ... and warnings are routed to the ticket receiver: among them, the SIGKILLed worker's target,
            # down since, whose lease metrics can no longer alert.
            until(
                lambda: any(
                    alert["labels"]["alertname"] == "DramatiqLeaseWorkerMetricsMissing"
                    and alert["labels"].get("instance") == f"127.0.0.1:{victim_port}"
                    for alert in webhook.alerts(ticket_path)
                ),
                20,
                "DramatiqLeaseWorkerMetricsMissing for the killed worker at the ticket webhook",
            )
            for name in ("DramatiqLeaseGaveUp", "DramatiqLeaseLost", "DramatiqLeaseHeartbeatOverdue"):
                until(
                    lambda name=name: any(  # type: ignore[misc]  # mypy cannot type a lambda's default, which binds the loop variable
                        alert["labels"]["alertname"] == name for alert in webhook.alerts(ticket_path)
                    ),
                    20,
                    f"{name} at the ticket webhook",
                )

            # Every dashboard query has drawn more than a flat zero by now, or does within a few scrapes.
            deadline = time.monotonic() + 20
            while watch.pending() and time.monotonic() < deadline and not watch.error:
                time.sleep(0.5)
            assert watch.error is None, f"a dashboard query fails: {watch.error}"
            never = [name for name in queries if name not in watch.seen]
            # Queries that stay at zero in a healthy standalone run (they must still return data): the blind
            # spots of a Cluster master not answering or a hand-written key, and grants whose end the exporter
            # cannot tell (a fence_retention shorter than its scan); tests/test_exporter.py drives each above zero.
            zero_when_healthy = {
                "dramatiq-leases: panel 'Expired leases' B",
                "dramatiq-leases: panel 'Exporter blind spots' A",
                "dramatiq-leases: panel 'Exporter blind spots' B",
            }
            flat = [name for name in watch.pending() if name not in never and name not in zero_when_healthy]
            assert (never, flat) == ([], []), (
                "dashboard queries that never returned data, or only zeros:\n"
                + "\n".join(
                    f"{name}: {queries[name][0]}\n    last: {watch.last.get(name, 'no answer')}"
                    for name in never + flat
                )
            )
        finally:
            stop_feeding.set()
            if feeder.is_alive():
                feeder.join(10)
            broker.close()
            broker_client.close()
            leases.client.close()


def feed(broker: RedisBroker, stop: threading.Event) -> None:
    """Every 2 s, two 0.7 s jobs per contended key: busy retries, waits, renewals (every 500 ms)."""
    while not stop.is_set():
        for key in CONTENDED_KEYS:
            for _ in range(2):
                send(broker, WORK_ACTOR, WORK_QUEUE, key, 0.7)
        stop.wait(2.0)
