"""The Grafana dashboard, rendered from the template beside this module and a :class:`~.config.MixinConfig`.

The template (``dashboard.json``) filters every query by the variables
``$job`` (workers), ``$exporter_job`` and ``$actor``; rendering points the
variables at the configured selectors, adds the cluster variable and its
filter to every query, and sets the runbook link.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .config import MixinConfig

TEMPLATE = Path(__file__).with_name("dashboard.json")

# Where a query selects workers or the exporter: the cluster filter goes right after.
_JOB_FILTER = re.compile(r'job=~"\$(job|exporter_job)"')


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _variable(name: str, label: str, query: str, all_value: str | None = None) -> dict[str, Any]:
    # Without an allValue, Grafana sends "All" as the values listed: only the configured selector's jobs
    # and clusters, never other teams' series of the same names.
    return {
        **({"allValue": all_value} if all_value is not None else {}),
        "current": {},
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "definition": query,
        "hide": 0,
        "includeAll": True,
        "label": label,
        "multi": True,
        "name": name,
        "options": [],
        "query": query,
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


def dashboard(cfg: MixinConfig) -> dict[str, Any]:
    """The dashboard for ``cfg``."""
    d: dict[str, Any] = copy.deepcopy(json.loads(TEMPLATE.read_text()))
    c = cfg.cluster_label
    in_cluster = f', {c}=~"$cluster"' if c else ""

    def filtered(expr: str) -> str:
        expr = _JOB_FILTER.sub(lambda m: m.group(0) + in_cluster, expr)
        # Exporter gauges are de-duplicated per actor before summing: per cluster, too.
        return expr.replace("max by (actor_name", f"max by ({c}, actor_name") if c else expr

    for panel in _panels(d["panels"]):
        for target in panel.get("targets", []):
            if "expr" in target:
                target["expr"] = filtered(target["expr"])
    for annotation in d["annotations"]["list"]:
        if "expr" in annotation and c:
            # Alerts without a cluster label (the exporter's absent()) stay visible in every cluster.
            annotation["expr"] = annotation["expr"].replace("}", f', {c}=~"$cluster|"}}')

    # Variables come from series every worker and exporter pre-creates at start, so they list a
    # process before its first lease.
    w, e = cfg.worker_selector, cfg.exporter_selector
    variables = {
        "job": _variable(
            "job", "Worker job", f"label_values(dramatiq_lease_redis_errors_total{{{w}{in_cluster}}}, job)"
        ),
        "instance": _variable(
            "instance",
            "Worker instance",
            f'label_values(dramatiq_lease_redis_errors_total{{job=~"$job"{in_cluster}}}, instance)',
            ".*",
        ),
        "actor": _variable(
            "actor",
            "Actor",
            f'label_values(dramatiq_lease_busy_retries_total{{job=~"$job"{in_cluster}}}, actor_name)',
            # An actor only the exporter still reports (its workers gone) must not be hidden by "All".
            ".*",
        ),
        "exporter_job": _variable(
            "exporter_job",
            "Exporter job",
            f"label_values(dramatiq_lease_exporter_last_scan_timestamp_seconds{{{e}{in_cluster}}}, job)",
        ),
    }
    if c:
        variables["cluster"] = _variable(
            "cluster", "Cluster", f"label_values(dramatiq_lease_redis_errors_total{{{w}}}, {c})"
        )
    rest = [v for v in d["templating"]["list"] if v["name"] not in variables]
    order = ["cluster", "job", "instance", "actor", "exporter_job"]
    d["templating"]["list"] = rest + [variables[name] for name in order if name in variables]

    runbook = cfg.runbook_url.split("#", 1)[0].replace("{alert}", "")
    for link in d["links"]:
        if link.get("title") == "Runbook":
            link["url"] = runbook
    return d
