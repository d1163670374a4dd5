"""The observability bundle: alert rules, Alertmanager, Prometheus, Grafana, compose, runbook.

Static checks, but with the real tools where there are any (promtool, amtool;
see tests/promtool.py), plus the cross-checks that keep the pieces agreeing:
metric names against the metrics the library exports, runbook anchors against
alert names, compose mounts against the paths the configs expect.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from dramatiq_leases.core import State
from dramatiq_leases.exporter import LEAK_REASONS

from .support.promtool import check_promql, grafana_to_promql, run

ROOT = Path(__file__).resolve().parent.parent
ALERT_RULES = ROOT / "alerts" / "dramatiq-leases.rules.yml"
ALERT_TESTS = ROOT / "alerts" / "tests" / "dramatiq-leases.test.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
DASHBOARD = ROOT / "dashboards" / "dramatiq-leases.json"
ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
GRAFANA_DASHBOARDS = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "dramatiq-leases.yml"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"

RUNBOOK_URL = "https://github.com/dramatiq-leases/dramatiq-leases/blob/main/docs/runbook.md"
WORKER_JOB = "dramatiq"
EXPORTER_JOB = "dramatiq-leases-exporter"

ACTOR = ("actor_name", "queue_name")
WORKER, FLEET = "worker", "fleet"
#: The metrics the library exports: name -> (type, who exports it, labels besides job and instance).
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "dramatiq_lease_acquire_duration_seconds": ("histogram", WORKER, (*ACTOR, "outcome")),
    "dramatiq_lease_wait_duration_seconds": ("histogram", WORKER, ACTOR),
    "dramatiq_lease_busy_retries_total": ("counter", WORKER, ACTOR),
    "dramatiq_lease_gave_up_total": ("counter", WORKER, ACTOR),
    "dramatiq_lease_handoff_duration_seconds": ("histogram", WORKER, ACTOR),
    "dramatiq_lease_held": ("gauge", WORKER, ACTOR),
    "dramatiq_lease_hold_duration_seconds": ("histogram", WORKER, ACTOR),
    "dramatiq_lease_renewals_total": ("counter", WORKER, (*ACTOR, "outcome")),
    "dramatiq_lease_renew_duration_seconds": ("histogram", WORKER, ()),
    "dramatiq_lease_lost_total": ("counter", WORKER, (*ACTOR, "reason")),
    "dramatiq_lease_redis_errors_total": ("counter", WORKER, ("operation",)),
    "dramatiq_lease_present": ("gauge", FLEET, ACTOR),
    "dramatiq_lease_heartbeat_overdue": ("gauge", FLEET, ACTOR),
    "dramatiq_lease_leaked": ("gauge", FLEET, (*ACTOR, "reason")),
    "dramatiq_lease_expired_total": ("counter", FLEET, ACTOR),
    "dramatiq_lease_oldest_acquired_timestamp_seconds": ("gauge", FLEET, ACTOR),
    "dramatiq_lease_waiting": ("gauge", FLEET, ("actor_name",)),
    "dramatiq_lease_exporter_last_scan_timestamp_seconds": ("gauge", FLEET, ()),
    "dramatiq_lease_exporter_scan_duration_seconds": ("gauge", FLEET, ()),
}
HISTOGRAM_SERIES = ("_bucket", "_count", "_sum")
TARGET_LABELS = ("job", "instance")
ALL_LABELS = {label for _, _, labels in METRICS.values() for label in labels} | {*TARGET_LABELS, "le"}


# --- loading ------------------------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboard() -> Any:
    return json.loads(DASHBOARD.read_text())


def alert_rules() -> list[dict[str, Any]]:
    groups = load_yaml(ALERT_RULES)["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def alert_names() -> list[str]:
    return sorted({rule["alert"] for rule in alert_rules()})


def compose_services() -> dict[str, Any]:
    return load_yaml(COMPOSE)["services"]


# --- PromQL, by regex: enough for the queries here, which promtool has parsed -----------------------

_METRIC = re.compile(r"\bdramatiq_\w+")
_SELECTOR = re.compile(r"\b(dramatiq_\w+)\s*(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def base_metric(name: str) -> str:
    """The exported metric a series name belongs to (a histogram's _bucket, _count, _sum)."""
    for suffix in HISTOGRAM_SERIES:
        base = name.removesuffix(suffix)
        if base != name and METRICS.get(base, ("",))[0] == "histogram":
            return base
    return name


def selectors(expr: str) -> Iterator[tuple[str, dict[str, tuple[str, str]]]]:
    """(series name, {label: (operator, value)}) for each dramatiq_ selector in ``expr``."""
    for match in _SELECTOR.finditer(expr):
        matchers = {label: (op, value) for label, op, value in _MATCHER.findall(match.group(2) or "")}
        yield match.group(1), matchers


def promql_problems(expr: str) -> list[str]:
    """What ``expr`` gets wrong about the exported metrics: unknown names, series or labels."""
    problems = []
    for series, matchers in selectors(expr):
        metric = base_metric(series)
        if metric not in METRICS:
            problems.append(f"unknown metric {series}")
            continue
        kind, _, labels = METRICS[metric]
        if kind == "histogram" and series == metric:
            problems.append(f"{series} is a histogram: use its _bucket, _count or _sum series")
        allowed = {*labels, *TARGET_LABELS, *(["le"] if series.endswith("_bucket") else [])}
        problems += [f"{series} has no label {label}" for label in matchers if label not in allowed]
    for grouping in _GROUPING.findall(expr):
        labels = [label.strip() for label in grouping.split(",") if label.strip()]
        problems += [f"no metric has a label {label}" for label in labels if label not in ALL_LABELS]
    return problems


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration such as 30s, 1m or 1h30m."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|[smhdwy])", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


# --- alert rules ------------------------------------------------------------------------------------


@pytest.mark.system
def test_alert_rules_pass_promtool_check() -> None:
    run("promtool", "check", "rules", ALERT_RULES)


@pytest.mark.system
def test_alert_rules_pass_their_unit_tests() -> None:
    run("promtool", "test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)


def test_alert_rules_are_one_group_of_alerts() -> None:
    groups = load_yaml(ALERT_RULES)["groups"]
    assert len(groups) == 1
    assert all("alert" in rule for rule in groups[0]["rules"]), "recording rules would need their own tests"


def rule_id(rule: dict[str, Any]) -> str:
    return f"{rule['alert']}-{rule['labels']['severity']}"


@pytest.mark.parametrize("rule", alert_rules(), ids=rule_id)
def test_alert_follows_conventions(rule: dict[str, Any]) -> None:
    name = rule["alert"]
    assert re.fullmatch(r"DramatiqLease[A-Z][A-Za-z]+", name)
    parse_duration(rule["for"])
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    annotations = rule["annotations"]
    assert set(annotations) == {"summary", "description", "runbook_url"}
    assert annotations["summary"].strip()
    assert re.search(r"\$labels\.\w+|\$value", annotations["description"]), "say which actor, or how bad"
    assert annotations["runbook_url"] == f"{RUNBOOK_URL}#{name.lower()}"
    assert promql_problems(rule["expr"]) == []


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_runbook_has_one_section_per_alert() -> None:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE)
    anchors = [github_anchor(heading) for heading in headings]
    for name in alert_names():
        assert anchors.count(name.lower()) == 1, f"docs/runbook.md needs one heading '{name}'"
    sections = {heading for heading in headings if heading.startswith("DramatiqLease")}
    assert sections == set(alert_names()), "runbook sections for alerts that do not exist"


def test_runbook_mentions_the_cli() -> None:
    text = RUNBOOK.read_text()
    for command in ("list", "show KEY", "release KEY --if-dead"):
        assert f"dramatiq-leases {command}" in text


def test_every_alert_has_unit_tests_that_fire_and_stay_silent() -> None:
    unit_tests = load_yaml(ALERT_TESTS)
    assert [(ALERT_TESTS.parent / path).resolve() for path in unit_tests["rule_files"]] == [ALERT_RULES]
    severities: dict[str, set[str]] = {}
    for rule in alert_rules():
        severities.setdefault(rule["alert"], set()).add(rule["labels"]["severity"])
    fires: set[str] = set()
    silent: set[str] = set()
    for case in (case for test in unit_tests["tests"] for case in test.get("alert_rule_test", [])):
        name = case["alertname"]
        assert name in severities, f"unit test for unknown alert {name}"
        if not case.get("exp_alerts"):
            silent.add(name)
            continue
        fires.add(name)
        for expected in case["exp_alerts"]:
            assert expected["exp_labels"]["severity"] in severities[name]
            assert set(expected["exp_annotations"]) == {"summary", "description", "runbook_url"}
    assert set(alert_names()) - fires == set(), "alerts never seen firing in a unit test"
    assert set(alert_names()) - silent == set(), "alerts never seen silent in a unit test"


def test_leak_alert_pages_within_a_minute() -> None:
    (rule,) = (rule for rule in alert_rules() if rule["alert"] == "DramatiqLeaseLeaked")
    assert rule["labels"]["severity"] == "critical"
    assert parse_duration(rule["for"]) <= 30
    assert "dramatiq_lease_leaked" in rule["expr"]


def test_leak_alert_pages_only_on_leaked_states() -> None:
    # Exactly the states that `release --if-dead` may end: a page invites that, and an overdue
    # heartbeat's holder may still be running.
    leaked = {state.value for state in State if state.leaked}
    assert {state.value for state in LEAK_REASONS} == leaked
    assert State.HEARTBEAT_OVERDUE.value not in leaked
    (rule,) = (rule for rule in alert_rules() if rule["alert"] == "DramatiqLeaseLeaked")
    (matchers,) = (matchers for series, matchers in selectors(rule["expr"]) if series == "dramatiq_lease_leaked")
    operator, reasons = matchers["reason"]
    assert operator == "=~" and set(reasons.split("|")) == leaked


def test_overdue_heartbeats_warn_without_paging() -> None:
    rules = [rule for rule in alert_rules() if "dramatiq_lease_heartbeat_overdue" in rule["expr"]]
    assert [rule["alert"] for rule in rules] == ["DramatiqLeaseHeartbeatOverdue"]
    assert {rule["labels"]["severity"] for rule in rules} == {"warning"}
    assert all("dramatiq_lease_heartbeat_overdue" not in rule["expr"] for rule in alert_rules()
               if rule["labels"]["severity"] == "critical")


def test_alert_jobs_are_scraped() -> None:
    jobs = {job["job_name"] for job in load_yaml(PROMETHEUS)["scrape_configs"]}
    for rule in alert_rules():
        for value in re.findall(r'\bjob\s*=\s*"([^"]*)"', rule["expr"]):
            assert value in jobs, f"{rule['alert']} selects job {value}, which prometheus.yml does not scrape"


# --- Alertmanager -----------------------------------------------------------------------------------


@pytest.mark.system
def test_alertmanager_config_passes_amtool_check() -> None:
    run("amtool", "check-config", ALERTMANAGER)


@pytest.mark.parametrize(
    ("severity", "receiver"),
    [("critical", "pager"), ("warning", "ticket"), ("info", "null"), (None, "ticket")],
)
@pytest.mark.system
def test_alertmanager_routes_by_severity(severity: str | None, receiver: str) -> None:
    labels = ["alertname=DramatiqLeaseLeaked", "actor_name=charge"]
    if severity is not None:
        labels.append(f"severity={severity}")
    output = run("amtool", "config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels)
    assert output.strip() == receiver


def test_alertmanager_groups_and_inhibits_per_actor() -> None:
    config = load_yaml(ALERTMANAGER)
    assert config["route"]["group_by"] == ["alertname", "actor_name"]
    (inhibit,) = config["inhibit_rules"]
    assert inhibit["source_matchers"] == ['severity = "critical"']
    assert inhibit["target_matchers"] == ['severity = "warning"']
    assert set(inhibit["equal"]) == {"alertname", "actor_name"}
    receivers = {receiver["name"]: receiver for receiver in config["receivers"]}
    for name in ("pager", "ticket"):
        (webhook,) = receivers[name]["webhook_configs"]
        assert urlsplit(webhook["url"]).scheme in {"http", "https"}
    assert receivers["null"].keys() == {"name"}


# --- Prometheus -------------------------------------------------------------------------------------


def bind_mounts(service: str) -> dict[str, tuple[Path, bool]]:
    """{container path: (host path, read-only)} of a compose service's bind mounts."""
    mounts = {}
    for volume in compose_services()[service].get("volumes", []):
        if isinstance(volume, dict):
            if volume["type"] != "bind":
                continue
            source, target, read_only = volume["source"], volume["target"], volume.get("read_only", False)
        else:
            source, target, *mode = volume.split(":")
            if not source.startswith((".", "/", "~")):
                continue  # a named volume
            read_only = "ro" in ",".join(mode).split(",")
        mounts[target] = ((COMPOSE.parent / source).resolve(), read_only)
    return mounts


def host_path(service: str, container_path: str) -> Path:
    """Where a path inside a compose service's container comes from in the repository."""
    for target, (source, _) in bind_mounts(service).items():
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / Path(container_path).relative_to(target)
    raise AssertionError(f"{container_path} is not mounted into the {service} service")


@pytest.mark.system
def test_prometheus_config_passes_promtool_check(tmp_path: Path) -> None:
    # promtool checks that the rule files exist: point them at the repository
    # files that docker-compose.yml mounts at those paths.
    config = load_yaml(PROMETHEUS)
    config["rule_files"] = [str(host_path("prometheus", path)) for path in config["rule_files"]]
    assert config["rule_files"] == [str(ALERT_RULES)], "Prometheus must load the alert rules tested here"
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(config, sort_keys=False))
    run("promtool", "check", "config", checked)


def test_prometheus_scrapes_workers_and_exporter() -> None:
    config = load_yaml(PROMETHEUS)
    targets = {
        job["job_name"]: [target for static in job["static_configs"] for target in static["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets[WORKER_JOB] == ["worker:9191"]
    assert targets[EXPORTER_JOB] == ["exporter:9808"]
    (alerting,) = config["alerting"]["alertmanagers"]
    assert alerting["static_configs"][0]["targets"] == ["alertmanager:9093"]
    services = compose_services()
    for target in (*targets[WORKER_JOB], *targets[EXPORTER_JOB], "alertmanager:9093"):
        assert target.split(":")[0] in services, f"{target} is not a docker-compose.yml service"
    assert "9808" in services["exporter"]["command"]


# --- Grafana dashboard ------------------------------------------------------------------------------


def all_panels() -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard()["panels"]:
        panels.append(panel)
        panels += panel.get("panels", [])  # inside collapsed rows
    return panels


def data_panels() -> list[dict[str, Any]]:
    return [panel for panel in all_panels() if panel["type"] != "row"]


def dashboard_queries() -> dict[str, str]:
    """{recording rule name: PromQL} of every query of the dashboard, variables substituted."""
    queries = {}
    for panel in data_panels():
        for target in panel["targets"]:
            queries[f"panel_{panel['id']}_{target['refId']}"] = grafana_to_promql(target["expr"])
    for number, annotation in enumerate(dashboard()["annotations"]["list"]):
        if "expr" in annotation:
            queries[f"annotation_{number}"] = grafana_to_promql(annotation["expr"])
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"])
            assert match, f"variable {variable['name']}: expected label_values(selector, label)"
            queries[f"variable_{variable['name']}"] = grafana_to_promql(match.group(1))
    return queries


def test_dashboard_identity() -> None:
    board = dashboard()
    assert board["uid"] == "dramatiq-leases"
    assert board["schemaVersion"] >= 39
    assert board["id"] is None, "a dashboard id is per Grafana instance and must not be committed"
    assert board["title"]


def test_dashboard_variables() -> None:
    variables = {variable["name"]: variable for variable in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance", "actor", "exporter_job"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["query"].startswith("label_values(")
        assert variable["multi"] and variable["includeAll"], f"{name}: multi-value with All"
        # All as .* rather than a list of the values seen: an actor that only
        # the exporter still reports (its workers are gone) must not be hidden.
        assert variable["allValue"] == ".*"
        assert variable["datasource"]["uid"] == "${datasource}"


def test_dashboard_layout() -> None:
    panels = all_panels()
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = [panel["title"] for panel in panels]
    assert len(titles) == len(set(titles)), "panel titles must be unique"
    boxes = []
    for panel in panels:
        box = panel["gridPos"]
        assert box["x"] >= 0 and box["w"] > 0 and box["x"] + box["w"] <= 24, panel["title"]
        for other, other_box in boxes:
            overlap_x = box["x"] < other_box["x"] + other_box["w"] and other_box["x"] < box["x"] + box["w"]
            overlap_y = box["y"] < other_box["y"] + other_box["h"] and other_box["y"] < box["y"] + box["h"]
            assert not (overlap_x and overlap_y), f"{panel['title']!r} overlaps {other!r}"
        boxes.append((panel["title"], box))
    assert panels[0]["type"] == "row", "panels are grouped in rows"


@pytest.mark.parametrize("panel", data_panels(), ids=lambda panel: panel["title"])
def test_dashboard_panel_conventions(panel: dict[str, Any]) -> None:
    assert panel["description"].strip()
    assert panel["datasource"]["uid"] == "${datasource}"
    assert panel["targets"]
    assert all(target["datasource"]["uid"] == "${datasource}" for target in panel["targets"])
    if panel["type"] == "heatmap":
        unit = panel["options"]["yAxis"]["unit"]
    else:
        unit = panel["fieldConfig"]["defaults"]["unit"]
    # What is measured, without an `or` fallback for missing data.
    exprs = [target["expr"].split(" or ")[0] for target in panel["targets"]]
    # Quantiles, heatmap buckets and the _seconds gauges are durations; rates are events per second.
    if panel["type"] == "heatmap" or any(re.search(r"histogram_quantile|_seconds\b", expr) for expr in exprs):
        assert unit == "s"
    elif any(re.search(r"\brate\(", expr) for expr in exprs):
        assert unit == "ops"
    else:
        assert unit in {"short", "none"}


@pytest.mark.system
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    check_promql(dashboard_queries(), tmp_path)


def test_dashboard_queries_use_known_metrics_and_labels() -> None:
    problems = {name: promql_problems(query) for name, query in dashboard_queries().items()}
    assert {name: found for name, found in problems.items() if found} == {}


def test_dashboard_shows_every_metric() -> None:
    used = {base_metric(name) for query in dashboard_queries().values() for name in _METRIC.findall(query)}
    assert set(METRICS) - used == set()


def test_dashboard_queries_filter_by_the_variables() -> None:
    for panel in data_panels():
        for target in panel["targets"]:
            for series, matchers in selectors(target["expr"]):
                _, source, labels = METRICS[base_metric(series)]
                # Exporter metrics come from their own job: the worker job and
                # instance variables would hide them.
                if source == FLEET:
                    expected = {"job": "$exporter_job"}
                else:
                    expected = {"job": "$job", "instance": "$instance"}
                if "actor_name" in labels:
                    expected["actor_name"] = "$actor"
                for label, variable in expected.items():
                    assert matchers.get(label) == ("=~", variable), f"{panel['title']}: {series} by {label}"


def test_dashboard_ranges_follow_the_time_picker() -> None:
    # $__rate_interval stays valid at any zoom and scrape interval; a fixed
    # [5m] would not. Totals over the whole time range may use $__range.
    for panel in data_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window in {"$__rate_interval", "$__range"}, f"{panel['title']}: [{window}]"
            for window in re.findall(r"\bi?rate\([^()\[]*\[([^\]]+)\]", expr):
                assert window == "$__rate_interval", f"{panel['title']}: rate over [{window}]"


def test_dashboard_has_the_key_panels() -> None:
    panels = data_panels()

    def with_query(kind: str, pattern: str) -> list[dict[str, Any]]:
        def matches(panel: dict[str, Any]) -> bool:
            return any(re.search(pattern, target["expr"]) for target in panel["targets"])

        return [panel for panel in panels if panel["type"] == kind and matches(panel)]

    (latency,) = with_query("timeseries", r"acquire_duration_seconds_bucket")
    quantiles = {re.search(r"histogram_quantile\(([\d.]+)", t["expr"]).group(1) for t in latency["targets"]}
    assert quantiles == {"0.5", "0.95", "0.99"}

    (heatmap,) = with_query("heatmap", r"wait_duration_seconds_bucket")
    assert heatmap["targets"][0]["format"] == "heatmap"
    assert heatmap["options"]["calculate"] is False, "the buckets come from Prometheus"

    (leaked,) = with_query("stat", r"dramatiq_lease_leaked")
    steps = leaked["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [step["color"] for step in steps] == ["green", "red"]
    assert steps[0]["value"] is None and steps[1]["value"] > 0

    for pattern in (
        r"busy_retries_total",
        r"dramatiq_lease_held\b",
        r"lost_total.*\bby \(reason\)|by \(reason\).*lost_total",
        r"expired_total",
        r"renewals_total",
        r'outcome="error"',
        r"renew_duration_seconds_bucket",
        r"gave_up_total",
        r"redis_errors_total",
        r"dramatiq_lease_present",
        r"dramatiq_lease_heartbeat_overdue",
        r"time\(\) - min.*oldest_acquired_timestamp_seconds",
    ):
        assert with_query("timeseries", pattern), f"no time series panel for {pattern}"


# --- Grafana provisioning ---------------------------------------------------------------------------


def test_grafana_datasource_is_the_compose_prometheus() -> None:
    (datasource,) = load_yaml(GRAFANA_DATASOURCES)["datasources"]
    assert datasource["type"] == "prometheus"
    url = urlsplit(datasource["url"])
    assert url.hostname in compose_services()
    assert url.port == 9090
    # $__rate_interval is only right if Grafana knows the scrape interval.
    assert datasource["jsonData"]["timeInterval"] == load_yaml(PROMETHEUS)["global"]["scrape_interval"]


def test_grafana_loads_the_dashboards_directory() -> None:
    (provider,) = load_yaml(GRAFANA_DASHBOARDS)["providers"]
    assert provider["type"] == "file"
    assert host_path("grafana", provider["options"]["path"]) == DASHBOARD.parent
    assert host_path("grafana", "/etc/grafana/provisioning/dashboards") == GRAFANA_DASHBOARDS.parent
    assert host_path("grafana", "/etc/grafana/provisioning/datasources") == GRAFANA_DATASOURCES.parent


# --- docker compose ---------------------------------------------------------------------------------


def test_compose_file_matches_the_compose_spec() -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    errors = sorted(validator(schema).iter_errors(load_yaml(COMPOSE)), key=lambda error: error.json_path)
    assert [f"{error.json_path}: {error.message}" for error in errors] == []


def test_compose_has_the_stack() -> None:
    services = compose_services()
    app = {"worker", "exporter", "producer"}
    assert set(services) == {"redis", *app, "prometheus", "alertmanager", "grafana"}
    for name in app:
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile"


@pytest.mark.parametrize("service", sorted(compose_services()))
def test_compose_bind_mounts_exist_read_only(service: str) -> None:
    for target, (source, read_only) in bind_mounts(service).items():
        assert source.exists(), f"{service}: {target} is mounted from {source}, which does not exist"
        assert source.is_relative_to(ROOT), f"{service}: mounts {source} from outside the repository"
        assert read_only, f"{service}: mount {target} read-only"


@pytest.mark.parametrize("service", sorted(compose_services()))
def test_compose_builds_from_the_repository(service: str) -> None:
    build = compose_services()[service].get("build")
    if build is None:
        return
    if isinstance(build, str):
        build = {"context": build}
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context.is_dir() and context.is_relative_to(ROOT)
    dockerfile = context / build.get("dockerfile", "Dockerfile")
    assert dockerfile.is_file()
    # The context is the whole repository: BuildKit reads <Dockerfile>.dockerignore
    # next to the Dockerfile, which keeps .git and .venv out of it.
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignore)


@pytest.mark.parametrize("service", sorted(compose_services()))
def test_compose_commands_name_existing_modules(service: str) -> None:
    command = compose_services()[service].get("command", [])
    if isinstance(command, str):
        command = command.split()
    for module in (arg for arg in command if re.fullmatch(r"examples(\.\w+)+", arg)):
        path = ROOT.joinpath(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


@pytest.mark.parametrize("service", sorted(compose_services()))
def test_compose_ports_bind_localhost(service: str) -> None:
    for port in compose_services()[service].get("ports", []):
        if isinstance(port, dict):
            host_ip = port.get("host_ip")
        else:
            parts = str(port).split("/")[0].split(":")
            host_ip = parts[0] if len(parts) == 3 else None
        assert host_ip == "127.0.0.1", f"{service}: publish {port!r} on 127.0.0.1 only"
