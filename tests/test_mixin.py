"""The monitoring mixin (dramatiq_leases.mixin): the checked-in rendering, other configs, config errors.

tests/test_bundle.py checks the checked-in rules and dashboard in depth; here,
that they are the rendering of the default config, and that a config of
someone else's (their own jobs, cluster label and runbook) renders rules and a
dashboard that select only their jobs and keep their cluster label.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dramatiq_leases.mixin import MixinConfig, dashboard_json, load, rules_yaml
from dramatiq_leases.mixin.__main__ import checkout

from .support.promtool import check_promql, grafana_to_promql, run

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "alerts" / "dramatiq-leases.rules.yml"
DASHBOARD = ROOT / "dashboards" / "dramatiq-leases.json"
RENDER = "python -m dramatiq_leases.mixin"

WORKER_JOB, EXPORTER_JOB = "billing", "lease-exporter"
CUSTOM = MixinConfig(
    cluster_label="env",
    worker_selector=f'job="{WORKER_JOB}"',
    exporter_selector=f'job="{EXPORTER_JOB}"',
    runbook_url="https://wiki.example.com/dramatiq-leases#{alert}",
)
#: Which selector each series of the rules must carry: the worker's or the exporter's.
EXPORTER_SERIES = {
    "dramatiq_lease_leaked",
    "dramatiq_lease_heartbeat_overdue",
    "dramatiq_lease_waiting",
    "dramatiq_lease_keys_full",
    "dramatiq_lease_key_saturation",
    "dramatiq_lease_leaked_waiting",
    "dramatiq_lease_expired_total",
    "dramatiq_lease_exporter_last_scan_timestamp_seconds",
    "dramatiq_lease_exporter_unreachable_nodes",
    "dramatiq_lease_exporter_unreadable_keys",
}

# PromQL by regex, enough for these queries (promtool parses them in the system tests).
_RECORDED = re.compile(r"\b[a-z_]+:[a-z_]+:[a-z0-9_]+\b")
_SERIES = re.compile(r"\b(dramatiq_\w+|up\b)\s*(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_BLOCK = re.compile(r"\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def matchers(block: str) -> dict[str, tuple[str, str]]:
    return {label: (op, value) for label, op, value in _MATCHER.findall(block)}


def series_selectors(expr: str) -> Iterator[tuple[str, dict[str, tuple[str, str]]]]:
    """(series name, matchers) of each raw series ``expr`` reads (recorded series are not raw)."""
    for match in _SERIES.finditer(_RECORDED.sub("recorded", expr)):
        yield match.group(1), matchers(match.group(2) or "")


def rule_list(text: str) -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]]


def rule_name(rule: dict[str, Any]) -> str:
    return rule.get("record") or f"{rule['alert']}-{rule['labels']['severity']}"


def prometheus_queries(board: dict[str, Any]) -> dict[str, str]:
    """{where: PromQL} of every Prometheus query of a dashboard: panels, annotations, variables."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    queries = {}
    for panel in panels(board["panels"]):
        for target in panel.get("targets", []):
            source = target.get("datasource") or panel.get("datasource") or {}
            if source.get("type") == "prometheus":
                queries[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for number, annotation in enumerate(board["annotations"]["list"]):
        if "expr" in annotation:
            queries[f"annotation {number}"] = annotation["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            queries[f"variable {variable['name']}"] = variable["query"]
    return queries


# --- the checked-in rendering ---------------------------------------------------------------------


def test_checked_in_rules_are_the_default_rendering() -> None:
    assert RULES.read_text() == rules_yaml(MixinConfig()), f"re-render with `{RENDER}`"


def test_checked_in_dashboard_is_the_default_rendering() -> None:
    assert DASHBOARD.read_text() == dashboard_json(MixinConfig()), f"re-render with `{RENDER}`"


# --- another config: its own jobs, cluster label and runbook --------------------------------------


@pytest.mark.system
def test_custom_rules_pass_promtool_check(tmp_path: Path) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(rules_yaml(CUSTOM))
    run("promtool", "check", "rules", path)


@pytest.mark.system
def test_custom_dashboard_queries_parse(tmp_path: Path) -> None:
    queries = prometheus_queries(json.loads(dashboard_json(CUSTOM)))
    exprs = {}
    for number, (where, query) in enumerate(queries.items()):
        selector = re.fullmatch(r"label_values\((.+),\s*\w+\)", query) if where.startswith("variable") else None
        exprs[f"query_{number}"] = grafana_to_promql(selector.group(1) if selector else query)
    check_promql(exprs, tmp_path)


def test_custom_rules_select_only_the_configured_jobs() -> None:
    text = rules_yaml(CUSTOM)
    jobs = set()
    for rule in rule_list(text):
        for series, found in series_selectors(rule["expr"]):
            if "job" in found:
                assert found["job"][0] == "=", f"{rule_name(rule)}: {series} by job{found['job'][0]}"
                jobs.add(found["job"][1])
    assert jobs == {WORKER_JOB, EXPORTER_JOB}
    assert not re.search(r'job="dramatiq(-leases-exporter)?"', text), "a default job left in a custom rendering"


def test_custom_rules_read_every_series_through_a_configured_selector() -> None:
    # Series of jobs the config does not name (another team's workers in the same Prometheus)
    # must not alert.
    unscoped = []
    for rule in rule_list(rules_yaml(CUSTOM)):
        for series, found in series_selectors(rule["expr"]):
            if series in EXPORTER_SERIES:
                allowed = [EXPORTER_JOB]
            elif series in {"dramatiq_lease_redis_errors_total", "up"}:
                allowed = [WORKER_JOB, EXPORTER_JOB]  # both count Redis errors, both are scraped
            else:
                allowed = [WORKER_JOB]
            if found.get("job") not in [("=", job) for job in allowed]:
                unscoped.append(f"{rule_name(rule)}: {series}")
    assert unscoped == []


def test_custom_rules_keep_the_cluster_label_everywhere() -> None:
    rules = rule_list(rules_yaml(CUSTOM))
    for rule in rules:
        expr = rule["expr"]
        assert not re.search(r"\bcluster\b", expr), f"{rule_name(rule)} uses the default cluster label"
        for grouping in _GROUPING.findall(expr):
            labels = {label.strip() for label in grouping.split(",")}
            assert "env" in labels, f"{rule_name(rule)}: ({grouping}) drops env"
        assert not re.search(r"\b(sum|min|max|avg|count)\s*\(", expr), f"{rule_name(rule)}: an aggregation drops env"
    for rule in (rule for rule in rules if "alert" in rule):
        annotations = rule["annotations"]
        assert annotations["runbook_url"] == f"https://wiki.example.com/dramatiq-leases#{rule['alert'].lower()}"
        assert "$labels.cluster" not in json.dumps(annotations)
        if "var-cluster" in annotations["dashboard_url"]:
            assert annotations["dashboard_url"].endswith("&var-cluster={{ $labels.env }}")


def test_custom_dashboard_filters_every_query_by_the_cluster() -> None:
    board = json.loads(dashboard_json(CUSTOM))
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["cluster"]["type"] == "query"
    assert (
        variables["cluster"]["query"] == f'label_values(dramatiq_lease_redis_errors_total{{job="{WORKER_JOB}"}}, env)'
    )
    queries = prometheus_queries(board)
    del queries["variable cluster"]  # lists the clusters: the one query that cannot filter by one
    assert queries
    for where, query in queries.items():
        blocks = [matchers(block) for block in _BLOCK.findall(query)]
        assert blocks, f"{where}: {query}"
        for found in blocks:
            assert "cluster" not in found, f"{where}: filters the default cluster label"
            if "job" in found:
                assert found.get("env") == ("=~", "$cluster"), f"{where}: job filter without the cluster: {query}"
                assert found["job"] in {
                    ("=~", "$job"),
                    ("=~", "$exporter_job"),
                    ("=", WORKER_JOB),
                    ("=", EXPORTER_JOB),
                }, f"{where}: {found['job']}"
        # Alerts of no actor (the exporter's absent()) have no cluster label either: `|` keeps them.
        assert any(found.get("env") in {("=~", "$cluster"), ("=~", "$cluster|")} for found in blocks), where
    assert variables["job"]["query"].startswith(f'label_values(dramatiq_lease_redis_errors_total{{job="{WORKER_JOB}"')
    assert f'{{job="{EXPORTER_JOB}", env=~"$cluster"}}' in variables["exporter_job"]["query"]


def test_without_a_cluster_label_nothing_filters_or_keeps_one() -> None:
    config = MixinConfig(cluster_label="")
    for rule in rule_list(rules_yaml(config)):
        assert not re.search(r"\bcluster\b", rule["expr"]), rule_name(rule)
    board = json.loads(dashboard_json(config))
    assert "cluster" not in {variable["name"] for variable in board["templating"]["list"]}
    assert "$cluster" not in json.dumps(board)


# --- config errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".yml", "worker_selecter: 'job=\"billing\"'\n"),
        (".json", '{"worker_selecter": "job=\\"billing\\""}'),
    ],
)
def test_load_names_an_unknown_setting(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"mixin{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"unknown setting\(s\) worker_selecter") as raised:
        load(path)
    assert str(path) in str(raised.value)
    assert "worker_selector" in str(raised.value), "say what the known settings are"


def test_load_reads_the_settings_it_names(tmp_path: Path) -> None:
    path = tmp_path / "mixin.yml"
    path.write_text("cluster_label: env\nworker_selector: 'job=\"billing\"'\nsafety_objective: 0.99\n")
    assert load(path) == MixinConfig(cluster_label="env", worker_selector='job="billing"', safety_objective=0.99)
    assert load(None) == MixinConfig()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("worker_selector", "billing"),
        ("worker_selector", "job=billing"),
        ("exporter_selector", 'job="x"}'),
        ("safety_objective", 1.0),
        ("liveness_objective", 1.0),
        ("cluster_label", "bad-label"),
    ],
)
def test_a_bad_setting_is_named_with_its_value(setting: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"\b{setting}\b.*{re.escape(repr(value))}"):
        MixinConfig(**{setting: value})


def test_an_objective_of_one_in_a_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "mixin.yml"
    path.write_text("liveness_objective: 1\n")
    with pytest.raises(ValueError, match=r"liveness_objective.*1\.0"):
        load(path)


def render(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_leases.mixin", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_exits_2_naming_a_bad_setting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("cluster_label: bad-label\n")
    out = tmp_path / "out"
    proc = render("--config", bad, "--out", out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cluster_label" in proc.stderr and "'bad-label'" in proc.stderr
    assert proc.stdout == ""
    assert not out.exists(), "nothing rendered from a bad config"


def test_cli_renders_a_config_into_a_directory(tmp_path: Path) -> None:
    config = tmp_path / "mixin.json"
    config.write_text(
        json.dumps(
            {
                "cluster_label": "env",
                "worker_selector": f'job="{WORKER_JOB}"',
                "exporter_selector": f'job="{EXPORTER_JOB}"',
                "runbook_url": "https://wiki.example.com/dramatiq-leases#{alert}",
            }
        )
    )
    out = tmp_path / "out"
    proc = render("--config", config, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(path.name for path in out.iterdir()) == ["dramatiq-leases.json", "dramatiq-leases.rules.yml"]
    assert (out / "dramatiq-leases.rules.yml").read_text() == rules_yaml(CUSTOM)
    assert (out / "dramatiq-leases.json").read_text() == dashboard_json(CUSTOM)


# --- where the CLI writes, and what it needs ------------------------------------------------------


def installed_copy(tmp_path: Path) -> Path:
    """A copy of the package laid out as pip installs it: ``<prefix>/lib/pythonX.Y/site-packages``."""
    site = tmp_path / "prefix" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    shutil.copytree(ROOT / "dramatiq_leases", site / "dramatiq_leases", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_checkout_is_the_repository_and_never_an_installed_copy(tmp_path: Path) -> None:
    assert checkout(ROOT / "dramatiq_leases") == ROOT
    assert checkout(installed_copy(tmp_path) / "dramatiq_leases") is None
    # Another project's checkout that vendors this package is not ours to regenerate.
    other = tmp_path / "other"
    (other / "alerts").mkdir(parents=True)
    (other / "pyproject.toml").write_text('[project]\nname = "billing"\n')
    assert checkout(other / "dramatiq_leases") is None


def test_an_installed_copy_without_out_writes_nothing_and_asks_for_it(tmp_path: Path) -> None:
    site = installed_copy(tmp_path)
    before = files_under(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-m", "dramatiq_leases.mixin"], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "--out DIR is required" in proc.stderr, proc.stderr
    assert files_under(tmp_path) == before, "nothing written, in site-packages or anywhere"
    # The same copy renders where it is told to.
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dramatiq_leases.mixin", "--out", str(out)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(out / "dramatiq-leases.rules.yml"), str(out / "dramatiq-leases.json")]
    assert (out / "dramatiq-leases.rules.yml").read_text() == rules_yaml(MixinConfig())


def test_without_pyyaml_the_cli_names_the_extra_in_one_line(tmp_path: Path) -> None:
    # None in sys.modules makes `import yaml` fail as if PyYAML were not installed (tests/test_packaging.py
    # runs the same from a wheel installed without the extra).
    code = "import sys; sys.modules['yaml'] = None; from dramatiq_leases.mixin.__main__ import main; sys.exit(main())"
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", code, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        proc.stderr
        == "python -m dramatiq_leases.mixin: rendering the rules needs PyYAML: pip install 'dramatiq-leases[mixin]'\n"
    )
    assert proc.stdout == ""
    assert not out.exists()


def test_help_says_when_out_is_required() -> None:
    proc = render("--help")
    assert proc.returncode == 0, proc.stderr
    assert "--out DIR" in proc.stdout
    assert "installed copy exits 2" in proc.stdout and "site-packages" in proc.stdout
