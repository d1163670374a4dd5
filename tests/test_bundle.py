"""The observability bundle: alert rules, Alertmanager, Prometheus, Grafana, compose, runbook.

Static checks, but with the real tools where there are any (promtool, amtool;
see tests/promtool.py), plus the cross-checks that keep the pieces agreeing:
metric names against the metrics the library exports, runbook anchors against
alert names, compose mounts against the paths the configs expect.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from dramatiq_leases.core import State
from dramatiq_leases.exporter import LEAK_REASONS, WAIT_REASONS
from dramatiq_leases.mixin import MixinConfig

from .support.promtool import check_promql, grafana_to_promql, run

ROOT = Path(__file__).resolve().parent.parent
ALERT_RULES = ROOT / "alerts" / "dramatiq-leases.rules.yml"
ALERT_TESTS = ROOT / "alerts" / "tests" / "dramatiq-leases.test.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
DASHBOARD = ROOT / "dashboards" / "dramatiq-leases.json"
ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
GRAFANA_ALERTMANAGER = GRAFANA_DATASOURCES.with_name("alertmanager.yml")
GRAFANA_EXPORTER = GRAFANA_DATASOURCES.with_name("exporter.yml")
BUSY_DATASOURCE = "yesoreyeram-infinity-datasource"
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
    "dramatiq_lease_not_run_total": ("counter", WORKER, (*ACTOR, "reason")),
    "dramatiq_lease_redis_errors_total": ("counter", WORKER, ("operation",)),
    "dramatiq_lease_present": ("gauge", FLEET, ACTOR),
    "dramatiq_lease_heartbeat_overdue": ("gauge", FLEET, ACTOR),
    "dramatiq_lease_leaked": ("gauge", FLEET, (*ACTOR, "reason")),
    "dramatiq_lease_leaked_waiting": ("gauge", FLEET, (*ACTOR, "reason")),
    "dramatiq_lease_expired_total": ("counter", FLEET, ACTOR),
    "dramatiq_lease_oldest_acquired_timestamp_seconds": ("gauge", FLEET, ACTOR),
    "dramatiq_lease_waiting": ("gauge", FLEET, ("actor_name",)),
    "dramatiq_lease_waiting_for": ("gauge", FLEET, ("actor_name", "reason")),
    "dramatiq_lease_keys_full": ("gauge", FLEET, ACTOR),
    "dramatiq_lease_key_saturation": ("gauge", FLEET, ACTOR),
    "dramatiq_lease_exporter_last_scan_timestamp_seconds": ("gauge", FLEET, ()),
    "dramatiq_lease_exporter_scan_duration_seconds": ("gauge", FLEET, ()),
    "dramatiq_lease_ended_unknown_total": ("counter", FLEET, ACTOR),
    "dramatiq_lease_exporter_unreachable_nodes": ("gauge", FLEET, ()),
    "dramatiq_lease_exporter_unreadable_keys": ("gauge", FLEET, ("kind",)),
}
HISTOGRAM_SERIES = ("_bucket", "_count", "_sum")
# Labels Prometheus attaches: the scrape job and target, and the cluster label (target or external labels).
TARGET_LABELS = ("job", "instance", "cluster")
ALL_LABELS = {label for _, _, labels in METRICS.values() for label in labels} | {*TARGET_LABELS, "le"}


# --- loading ------------------------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboard() -> Any:
    return json.loads(DASHBOARD.read_text())


def all_rules() -> list[dict[str, Any]]:
    """Every rule of the rule file: its recording group's, then its alerting group's."""
    return [rule for group in load_yaml(ALERT_RULES)["groups"] for rule in group["rules"]]


def alert_rules() -> list[dict[str, Any]]:
    return [rule for rule in all_rules() if "alert" in rule]


def recording_rules() -> list[dict[str, Any]]:
    return [rule for rule in all_rules() if "record" in rule]


def alert_names() -> list[str]:
    return sorted({rule["alert"] for rule in alert_rules()})


def compose_services() -> dict[str, Any]:
    return cast(dict[str, Any], load_yaml(COMPOSE)["services"])


# --- PromQL, by regex: enough for the queries here, which promtool has parsed -----------------------

# Not inside a recorded series' name (level:metric:operations), which is no exported metric.
_METRIC = re.compile(r"(?<![:\w])dramatiq_\w+")
_SELECTOR = re.compile(r"(?<![:\w])(dramatiq_\w+)\s*(?:\{([^}]*)\})?")
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
    labels: Sequence[str]  # a metric's label tuple, then a grouping's label list
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

#: The configuration the checked-in rules are rendered from (tests/test_mixin.py checks that they are).
MIXIN = MixinConfig()
CLUSTER = MIXIN.cluster_label
#: Recording rule names: level:metric:operations.
RECORDED = re.compile(r"\b[a-z_]+:[a-z_]+:[a-z0-9_]+\b")
RECORDING_LEVELS = {"job_actor": {CLUSTER, "job", *ACTOR}, "actor": {CLUSTER, *ACTOR}}
_AGGREGATION = re.compile(
    r"\b(sum|min|max|avg|count|stddev|stdvar|topk|bottomk|quantile|count_values|group)\s*(by|without)?\s*\("
)
_BY = re.compile(r"\b(?:sum|min|max|avg|count|group)\s+by\s*\(([^)]*)\)")
_ON = re.compile(r"\bon\s*\(([^)]*)\)")


def labels_of(grouping: str) -> set[str]:
    return {label.strip() for label in grouping.split(",") if label.strip()}


def split_top(expr: str, keyword: str) -> list[str]:
    """``expr`` split at each ``keyword`` (a binary operator such as ``or``) outside parentheses and strings."""
    parts, depth, start = [], 0, 0
    for token in re.finditer(rf'"(?:[^"\\]|\\.)*"|[()]|\b{keyword}\b', expr):
        if token.group() == "(":
            depth += 1
        elif token.group() == ")":
            depth -= 1
        elif token.group() == keyword and depth == 0:
            parts.append(expr[start : token.start()].strip())
            start = token.end()
    return [*parts, expr[start:].strip()]


def unwrap(expr: str) -> str:
    """``expr`` without parentheses around all of it."""
    expr = expr.strip()
    while expr.startswith("(") and expr.endswith(")") and _balanced(expr[1:-1]):
        expr = expr[1:-1].strip()
    return expr


def _balanced(expr: str) -> bool:
    depth = 0
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


def leaked_reasons(expr: str) -> set[str]:
    """The reasons that the ``dramatiq_lease_leaked`` selectors of ``expr`` read (each must say)."""
    reasons: set[str] = set()
    for series, matchers in selectors(expr):
        if series != "dramatiq_lease_leaked":
            continue
        operator, value = matchers["reason"]
        assert operator in {"=", "=~"}, f"select leaked reasons by name, not {operator}{value}"
        reasons |= set(value.split("|")) if operator == "=~" else {value}
    return reasons


def rule_id(rule: dict[str, Any]) -> str:
    if "record" in rule:
        return cast(str, rule["record"])
    window = f"-{rule['labels']['long']}-{rule['labels']['short']}" if "long" in rule["labels"] else ""
    return f"{rule['alert']}-{rule['labels']['severity']}{window}"


def leak_rules() -> dict[str, dict[str, Any]]:
    """The DramatiqLeaseLeaked rules, by severity."""
    rules = [rule for rule in alert_rules() if rule["alert"] == "DramatiqLeaseLeaked"]
    by_severity = {rule["labels"]["severity"]: rule for rule in rules}
    assert len(by_severity) == len(rules), "one DramatiqLeaseLeaked rule per severity"
    return by_severity


@pytest.mark.system
def test_alert_rules_pass_promtool_check() -> None:
    run("promtool", "check", "rules", ALERT_RULES)


@pytest.mark.system
def test_alert_rules_pass_their_unit_tests() -> None:
    run("promtool", "test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)


def test_rules_are_a_recording_group_and_an_alerting_group() -> None:
    recording, alerting = load_yaml(ALERT_RULES)["groups"]
    assert recording["name"] == "dramatiq-leases.rules"
    assert alerting["name"] == "dramatiq-leases"
    assert recording["rules"] and all(rule.keys() == {"record", "expr"} for rule in recording["rules"])
    assert alerting["rules"] and all("alert" in rule for rule in alerting["rules"])


@pytest.mark.parametrize("rule", recording_rules(), ids=rule_id)
def test_recording_rule_follows_conventions(rule: dict[str, Any]) -> None:
    name = rule["record"]
    assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", name), "level:metric:operations"
    level, metric, operations = name.split(":")
    assert level in RECORDING_LEVELS, f"{name}: a level says which labels the series keeps"
    assert metric.startswith("dramatiq_lease_")
    assert operations.startswith(("rate", "ratio_rate")) and re.search(r"\d+[smhd]$", operations)
    window = re.search(r"(\d+[smhd])$", operations).group(1)  # type: ignore[union-attr]  # the assert above: it matches
    ranges = set(re.findall(r"\[([^\]]+)\]", rule["expr"]))
    # Over its window: its own ranges, or recorded series of the same window (a ratio of two recordings).
    recorded = set(re.findall(r"\b[a-z_]+:dramatiq_lease_[a-z_]+:[a-z_]*?(\d+[smhd])\b", rule["expr"]))
    assert (ranges or recorded) and ranges | recorded == {window}, name
    # The level is the labels that every aggregation keeps (histogram buckets also keep le).
    for grouping in _BY.findall(rule["expr"]):
        assert labels_of(grouping) - {"le"} == RECORDING_LEVELS[level], f"{name}: by ({grouping})"
    assert promql_problems(rule["expr"]) == []


def test_recording_rules_are_read_and_exist() -> None:
    recorded = [rule["record"] for rule in recording_rules()]
    assert len(recorded) == len(set(recorded))
    read = {name for rule in all_rules() for name in RECORDED.findall(rule["expr"])}
    read |= {name for query in dashboard_queries().values() for name in RECORDED.findall(query)}
    assert read - set(recorded) == set(), "queries read series that no rule records"
    assert set(recorded) - read == set(), "recorded series that nothing reads"


@pytest.mark.parametrize("rule", alert_rules(), ids=rule_id)
def test_alert_follows_conventions(rule: dict[str, Any]) -> None:
    name = rule["alert"]
    assert re.fullmatch(r"DramatiqLease[A-Z][A-Za-z]+", name)
    parse_duration(rule["for"])
    labels = rule["labels"]
    assert labels["severity"] in {"critical", "warning", "info"}
    # Burn-rate alerts say which pair of windows burns; nothing else adds labels.
    assert set(labels) in ({"severity"}, {"severity", "long", "short"})
    if "long" in labels:
        assert parse_duration(labels["long"]) > parse_duration(labels["short"])
        assert f"ratio_rate{labels['long']}" in rule["expr"] and f"ratio_rate{labels['short']}" in rule["expr"]
    annotations = rule["annotations"]
    assert set(annotations) == {"summary", "description", "runbook_url", "dashboard_url"}
    assert annotations["summary"].strip()
    assert re.search(r"\$labels\.\w+|\$value", annotations["description"]), "say which actor, or how bad"
    assert annotations["runbook_url"] == f"{RUNBOOK_URL}#{name.lower()}"
    link = annotations["dashboard_url"]
    assert link.startswith(MIXIN.dashboard_url)
    if "$labels.actor_name" in annotations["description"]:
        # Open the dashboard on the alert's actor, in its cluster.
        assert (
            link == f"{MIXIN.dashboard_url}?var-actor={{{{ $labels.actor_name }}}}"
            f"&var-cluster={{{{ $labels.{CLUSTER} }}}}"
        )
    else:
        assert link == MIXIN.dashboard_url
    assert promql_problems(RECORDED.sub("recorded", rule["expr"])) == []


@pytest.mark.parametrize("rule", all_rules(), ids=rule_id)
def test_aggregations_keep_the_cluster_and_the_job(rule: dict[str, Any]) -> None:
    # Staging and production in one Prometheus never merge; nor do two jobs' series. Only actor:
    # level recordings (worker and exporter series combined) and the right-hand side of a filter
    # (`and on (labels) (sum by (labels) ...)`, whose labels no result keeps) drop the job.
    expr = rule["expr"]
    actor_level = rule.get("record", "").startswith("actor:")
    for match in _AGGREGATION.finditer(expr):
        assert match.group(2) == "by", f"{rule_id(rule)}: {match.group(0)} drops the cluster label"
    for match in _BY.finditer(expr):
        labels = labels_of(match.group(1))
        assert CLUSTER in labels, f"{rule_id(rule)}: by ({match.group(1)})"
        filter_on = re.search(r"\b(?:and|unless)\s+on\s*\(([^)]*)\)\s*\(?\s*$", expr[: match.start()])
        is_filter = filter_on is not None and labels_of(filter_on.group(1)) == labels
        # A whole cluster missing a target (`group by (cluster) (...) unless on (cluster) ...`): per cluster.
        is_filter = is_filter or (labels == {CLUSTER} and match.group(0).startswith("group"))
        assert "job" in labels or actor_level or is_filter, f"{rule_id(rule)}: by ({match.group(1)}) drops the job"
    for grouping in _ON.findall(expr):
        assert CLUSTER in labels_of(grouping), f"{rule_id(rule)}: on ({grouping}) joins across clusters"


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
    # The alerts read recorded series: the tests evaluate the recording group first, deterministically.
    assert unit_tests["group_eval_order"] == [group["name"] for group in load_yaml(ALERT_RULES)["groups"]]
    rules: dict[str, list[dict[str, str]]] = {}
    for rule in alert_rules():
        rules.setdefault(rule["alert"], []).append(rule["labels"])
    fires: dict[str, set[str]] = {}
    silent: set[str] = set()
    for case in (case for test in unit_tests["tests"] for case in test.get("alert_rule_test", [])):
        name = case["alertname"]
        assert name in rules, f"unit test for unknown alert {name}"
        if not case.get("exp_alerts"):
            silent.add(name)
            continue
        for expected in case["exp_alerts"]:
            labels = expected["exp_labels"]
            # Exactly the labels of one of the alert's rules (the series' own labels besides).
            assert any(all(labels.get(k) == v for k, v in rule.items()) for rule in rules[name]), labels
            assert set(expected["exp_annotations"]) == {"summary", "description", "runbook_url", "dashboard_url"}
            fires.setdefault(name, set()).add(labels["severity"])
    for name, labels in rules.items():
        severities = {rule["severity"] for rule in labels}
        assert fires.get(name, set()) == severities, f"{name}: unit tests see it fire only as {fires.get(name)}"
    assert set(alert_names()) - silent == set(), "alerts never seen silent in a unit test"


def test_leak_alert_pages_within_30s_only_on_no_ttl_or_waiting_messages() -> None:
    rules = leak_rules()
    assert set(rules) == {"critical", "warning"}
    assert all(parse_duration(rule["for"]) <= 30 for rule in rules.values())
    # The page: a lease without a TTL (it never ends by itself), or any leak that messages of its
    # actor wait on (busy retries of its actor and queue, or messages in its actor's line).
    for branch in split_top(rules["critical"]["expr"], "or"):
        leak, *condition = split_top(unwrap(branch), "and")
        assert leaked_reasons(leak), f"not a leak: {leak}"
        if not condition:
            assert leaked_reasons(leak) == {State.NO_TTL.value}, f"pages on any {leaked_reasons(leak)} leak"
            continue
        (waiting,) = condition
        # Messages waiting in the leaked key's own line, not anywhere on its actor.
        assert re.search(r"\bdramatiq_lease_leaked_waiting\b", waiting), waiting
        assert re.search(r"\)\s*>\s*0\s*\)?$", waiting), f"messages wait: {waiting}"
    # The warning: the leaks that end at their TTL by themselves.
    ends_by_ttl = {state.value for state in State if state.leaked} - {State.NO_TTL.value}
    assert leaked_reasons(rules["warning"]["expr"]) == ends_by_ttl


def test_leak_alert_pages_only_on_leaked_states() -> None:
    # Exactly the states that `release --if-dead` may end: a page invites that, and an overdue
    # heartbeat's holder may still be running.
    leaked = {state.value for state in State if state.leaked}
    assert {state.value for state in LEAK_REASONS} == leaked
    assert State.HEARTBEAT_OVERDUE.value not in leaked
    rules = leak_rules()
    assert set().union(*(leaked_reasons(rule["expr"]) for rule in rules.values())) == leaked
    for rule in alert_rules():
        assert State.HEARTBEAT_OVERDUE.value not in leaked_reasons(rule["expr"]), rule_id(rule)


def test_overdue_heartbeats_warn_without_paging() -> None:
    rules = [rule for rule in alert_rules() if "dramatiq_lease_heartbeat_overdue" in rule["expr"]]
    assert [rule["alert"] for rule in rules] == ["DramatiqLeaseHeartbeatOverdue"]
    assert {rule["labels"]["severity"] for rule in rules} == {"warning"}
    assert all(
        "dramatiq_lease_heartbeat_overdue" not in rule["expr"]
        for rule in alert_rules()
        if rule["labels"]["severity"] == "critical"
    )


def test_alert_jobs_are_scraped() -> None:
    jobs = {job["job_name"] for job in load_yaml(PROMETHEUS)["scrape_configs"]}
    for rule in all_rules():
        for value in re.findall(r'\bjob\s*=\s*"([^"]*)"', rule["expr"]):
            assert value in jobs, f"{rule_id(rule)} selects job {value}, which prometheus.yml does not scrape"


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
    # Staging and production in one Prometheus: never one notification, never one inhibiting the other.
    assert config["route"]["group_by"] == ["alertname", "cluster", "actor_name"]
    (inhibit,) = config["inhibit_rules"]
    assert inhibit["source_matchers"] == ['severity = "critical"']
    assert inhibit["target_matchers"] == ['severity = "warning"']
    # The reason too: a key without TTL paging must not hide another key's dead-holder warning.
    assert set(inhibit["equal"]) == {"alertname", "cluster", "actor_name", "queue_name", "reason"}
    receivers = {receiver["name"]: receiver for receiver in config["receivers"]}
    for name in ("pager", "ticket"):
        (webhook,) = receivers[name]["webhook_configs"]
        url = urlsplit(webhook["url"])
        assert url.scheme in {"http", "https"}
        # The compose stack delivers them somewhere: a service that logs them.
        assert url.hostname in compose_services(), f"{name}: {url.hostname} is not a compose service"
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
    """The panels that query Prometheus."""
    return [panel for panel in all_panels() if panel["type"] != "row" and panel["datasource"]["type"] == "prometheus"]


def busy_panels() -> list[dict[str, Any]]:
    """The panels that read the exporter's /leases JSON."""
    return [panel for panel in all_panels() if panel.get("datasource", {}).get("type") == BUSY_DATASOURCE]


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
    assert variables["busy_source"]["type"] == "datasource"
    assert variables["busy_source"]["query"] == BUSY_DATASOURCE
    for name in ("cluster", "job", "instance", "actor", "exporter_job"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["query"].startswith("label_values(")
        assert variable["multi"] and variable["includeAll"], f"{name}: multi-value with All"
        if name in ("instance", "actor"):
            # All as .* rather than a list of the values seen: an actor that only
            # the exporter still reports (its workers are gone) must not be hidden.
            assert variable["allValue"] == ".*"
        else:
            # All as the values listed, which come from the configured selectors: other teams'
            # jobs of the same metric names stay out.
            assert "allValue" not in variable
        assert variable["datasource"]["uid"] == "${datasource}"


def test_dashboard_layout() -> None:
    panels = all_panels()
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = [panel["title"] for panel in panels]
    assert len(titles) == len(set(titles)), "panel titles must be unique"
    boxes: list[tuple[str, dict[str, Any]]] = []
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
    elif any(re.search(r"_saturation\b", expr) for expr in exprs):
        assert unit == "percentunit"  # a ratio of holders to limit, 0 to 1
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
                # Except Redis errors, which the exporter has too (scan): they are shown from both.
                if source == FLEET or (
                    series.startswith("dramatiq_lease_redis_errors") and matchers.get("job") == ("=~", "$exporter_job")
                ):
                    expected = {"job": "$exporter_job"}
                else:
                    expected = {"job": "$job", "instance": "$instance"}
                # Staging and production in one Prometheus stay apart.
                expected["cluster"] = "$cluster"
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
    quantiles = {re.search(r"histogram_quantile\(([\d.]+)", t["expr"]).group(1) for t in latency["targets"]}  # type: ignore[union-attr]  # a None fails the test too
    assert quantiles == {"0.5", "0.95", "0.99"}

    # What lines wait for, stacked: the split adds up to the messages waiting.
    (waiting_for,) = with_query("timeseries", r"dramatiq_lease_waiting_for\b")
    assert waiting_for["title"] == "Waiting: for rate vs for a holder"
    assert waiting_for["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert [re.search(r"sum by \((\w+)\)", t["expr"]).group(1) for t in waiting_for["targets"]] == ["reason"]  # type: ignore[union-attr]  # a None fails the test too
    colored = {o["matcher"]["options"] for o in waiting_for["fieldConfig"]["overrides"]}
    assert colored == {f"for {reason}" for reason in WAIT_REASONS}

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
        r"dramatiq_lease_keys_full",
        r"dramatiq_lease_key_saturation",
        r"not_run_total.*\bby \(reason\)|by \(reason\).*not_run_total",
    ):
        assert with_query("timeseries", pattern), f"no time series panel for {pattern}"


def test_busy_view_reads_the_exporters_json() -> None:
    from dramatiq_leases.exporter.busy_page import HotKeyRow, LeaseRow
    from dramatiq_leases.exporter.routes import LEASES_PATH

    tables = {}
    for panel in busy_panels():
        assert panel["type"] == "table" and panel["description"].strip()
        (target,) = panel["targets"]
        assert target["datasource"]["uid"] == "${busy_source}"
        assert (target["type"], target["source"], target["url"]) == ("json", "url", LEASES_PATH)
        tables[target["root_selector"]] = [column["selector"] for column in target["columns"]]
    assert tables.keys() == {"leases", "hot_keys"}
    # Every column is a field the exporter serves (an API), and each row says how to look closer.
    for root, fields in (("leases", LeaseRow.__annotations__), ("hot_keys", HotKeyRow.__annotations__)):
        assert set(tables[root]) <= set(fields), root
        assert {"key", "state", "line_length", "inspect_command"} <= set(tables[root])
    assert {"actor", "host", "pid", "age_seconds", "ttl_left_seconds"} <= set(tables["leases"])
    assert {"waiting_for", "next_start_ms"} <= set(tables["hot_keys"])
    state_colors = {
        value
        for panel in busy_panels()
        for override in panel["fieldConfig"]["overrides"]
        for prop in override["properties"]
        if prop["id"] == "mappings"
        for value in prop["value"][0]["options"]
    }
    assert {state.value for state in State} <= state_colors


def test_wait_heatmap_leaves_out_first_attempts() -> None:
    (heatmap,) = [panel for panel in data_panels() if panel["type"] == "heatmap"]
    expr = heatmap["targets"][0]["expr"]
    # Cumulative buckets less the lowest one: messages granted at once would otherwise drown the rest.
    assert re.search(
        r'- on \(\) group_left sum\(rate\(dramatiq_lease_wait_duration_seconds_bucket\{[^}]*le="0\.01"', expr
    )


def test_oldest_lease_stat_has_thresholds() -> None:
    (stat,) = [
        panel for panel in data_panels() if panel["type"] == "stat" and "oldest_acquired" in str(panel["targets"])
    ]
    steps = stat["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [step["color"] for step in steps] == ["green", "orange", "red"]


def test_alert_annotations_keep_alerts_without_an_actor() -> None:
    (annotation,) = [a for a in dashboard()["annotations"]["list"] if "expr" in a]
    assert 'actor_name=~"$actor|"' in annotation["expr"]


# --- Grafana provisioning ---------------------------------------------------------------------------


def test_grafana_datasource_is_the_compose_prometheus() -> None:
    (datasource,) = load_yaml(GRAFANA_DATASOURCES)["datasources"]
    assert datasource["type"] == "prometheus"
    url = urlsplit(datasource["url"])
    assert url.hostname in compose_services()
    assert url.port == 9090
    # $__rate_interval is only right if Grafana knows the scrape interval.
    assert datasource["jsonData"]["timeInterval"] == load_yaml(PROMETHEUS)["global"]["scrape_interval"]


@pytest.mark.parametrize(
    ("path", "kind", "port"), [(GRAFANA_ALERTMANAGER, "alertmanager", 9093), (GRAFANA_EXPORTER, BUSY_DATASOURCE, 9808)]
)
def test_grafana_has_the_alertmanager_and_the_exporter(path: Path, kind: str, port: int) -> None:
    (datasource,) = load_yaml(path)["datasources"]
    assert datasource["type"] == kind
    url = urlsplit(datasource["url"])
    assert url.hostname in compose_services() and url.port == port


def test_grafana_installs_the_busy_view_plugin() -> None:
    assert BUSY_DATASOURCE in compose_services()["grafana"]["environment"]["GF_INSTALL_PLUGINS"]


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
    app = {"worker", "exporter", "producer", "webhook"}
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
