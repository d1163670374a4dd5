"""The mixin's configuration: every selector, URL and threshold in one place.

Like kubernetes-mixin's ``config.libsonnet``: the alert rules, recording rules
and dashboard are rendered from a :class:`MixinConfig`
(``python -m dramatiq_leases.mixin --config FILE --out DIR``); ``alerts/`` and ``dashboards/``
hold the rendering of the defaults. A config file (YAML or JSON) names only
the fields it changes::

    worker_selector: 'job="billing-workers"'
    exporter_selector: 'job="lease-exporter"'
    cluster_label: env
    runbook_url: https://wiki.example.com/dramatiq-leases#{alert}
    dashboard_url: https://grafana.example.com/d/dramatiq-leases/dramatiq-leases
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# One label matcher, as in a PromQL selector: name, operator, double-quoted value.
_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
_SELECTOR = re.compile(rf"^{_MATCHER}(,{_MATCHER})*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class MixinConfig:
    """What differs between one Prometheus set-up and another (field names are the config file's keys).

    Parameters:
      worker_selector: label matchers of the worker processes' series (the
        scrape job of Dramatiq's Prometheus endpoint, or of this package's
        own, port 9192). Point it at jobs whose workers run leased actors:
        a target there that serves no lease series is alerted on.
      exporter_selector: label matchers of ``dramatiq-leases exporter``'s series.
      cluster_label: the label that tells environments apart (staging and
        production in one Prometheus). Every aggregation keeps it and the
        rules that join worker and exporter series match on it; ``""`` if
        each environment has a Prometheus of its own.
      runbook_url: each alert's ``runbook_url``; ``{alert}`` becomes the
        alert's name in lower case (the runbook's section anchors).
      dashboard_url: the Grafana dashboard's address; alerts link to it with
        their actor (and cluster) selected.
      leak_for: how long a leak must last before it alerts.
      keys_full_for: how long an actor's keys must stay at their holder
        limit, with its messages waiting, before ``DramatiqLeaseKeysFull``.
      exporter_stale_seconds: how old the exporter's last completed scan may
        get (or its start, before any) before ``DramatiqLeaseExporterStale``.
      redis_errors: Redis errors of one job and operation in 10 minutes that
        warn.
      acquire_latency_warning_seconds / acquire_latency_critical_seconds:
        p99 acquire latency thresholds (put them on bucket boundaries of
        ``dramatiq_leases.prometheus.LATENCY_BUCKETS``, where
        ``histogram_quantile`` is exact).
      acquire_latency_min_rate: acquire attempts per second an actor needs
        before its p99 means anything (fewer: no latency alert).
      safety_objective: the share of grants that must end by their holder's
        release, not lost or expired (the safety SLO).
      liveness_objective: the share of messages that must get their lease
        rather than give up waiting (the liveness SLO).
      slo_min_events: lost or expired grants (or give-ups) in a long window
        before its burn rate may alert: one event of a low-traffic actor
        burns the budget at once (and has its own warning).
    """

    worker_selector: str = 'job="dramatiq"'
    exporter_selector: str = 'job="dramatiq-leases-exporter"'
    cluster_label: str = "cluster"
    runbook_url: str = "https://github.com/dramatiq-leases/dramatiq-leases/blob/main/docs/runbook.md#{alert}"
    dashboard_url: str = "http://localhost:3000/d/dramatiq-leases/dramatiq-leases"
    leak_for: str = "30s"
    keys_full_for: str = "30m"
    exporter_stale_seconds: int = 120
    redis_errors: int = 5
    acquire_latency_warning_seconds: float = 0.25
    acquire_latency_critical_seconds: float = 1.0
    acquire_latency_min_rate: float = 0.05
    safety_objective: float = 0.999
    liveness_objective: float = 0.999
    slo_min_events: int = 5

    def __post_init__(self) -> None:
        for name in ("worker_selector", "exporter_selector"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _SELECTOR.match(value):
                raise ValueError(f"mixin config: {name} must be PromQL label matchers like 'job=\"x\"', not {value!r}")
        if not isinstance(self.cluster_label, str) or (self.cluster_label and not _LABEL.match(self.cluster_label)):
            raise ValueError(f"mixin config: cluster_label must be a label name or '', not {self.cluster_label!r}")
        if "{alert}" not in self.runbook_url:
            raise ValueError(f"mixin config: runbook_url must contain {{alert}}, not {self.runbook_url!r}")
        for name in ("leak_for", "keys_full_for"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.match(r"^\d+[smh]$", value):
                raise ValueError(f"mixin config: {name} must be a duration like '30s', not {value!r}")
        for name in ("safety_objective", "liveness_objective"):
            value = getattr(self, name)
            if not isinstance(value, float) or not 0.9 <= value < 1:
                raise ValueError(f"mixin config: {name} must be a number in [0.9, 1), not {value!r}")
        positive = (
            "exporter_stale_seconds",
            "redis_errors",
            "acquire_latency_warning_seconds",
            "acquire_latency_critical_seconds",
            "slo_min_events",
            "acquire_latency_min_rate",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"mixin config: {name} must be a positive number, not {value!r}")

    @property
    def by(self) -> str:
        """The labels every per-actor aggregation keeps: the cluster label, job, actor and queue."""
        return ", ".join([*self.cluster, "job", "actor_name", "queue_name"])

    @property
    def cluster(self) -> list[str]:
        """The cluster label as a list: empty when not configured."""
        return [self.cluster_label] if self.cluster_label else []


def load(path: str | Path | None) -> MixinConfig:
    """The defaults, overridden by the YAML or JSON mapping in ``path`` (if any).

    Raises:
      ValueError: an unknown key or a bad value, named.
    """
    if path is None:
        return MixinConfig()
    text = Path(path).read_text()
    data: Any
    if str(path).endswith(".json"):
        data = json.loads(text)
    else:
        try:
            import yaml
        except ImportError as e:  # an extra, not a runtime dependency
            raise ValueError("mixin config in YAML needs PyYAML: pip install 'dramatiq-leases[mixin]'") from e
        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"mixin config {path}: expected a mapping of settings, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(MixinConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"mixin config {path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(known)}")
    # An integer where a float is expected (objective: 1 would be rejected anyway) is taken as a number.
    values = {
        k: float(v) if known[k].type == "float" and isinstance(v, int) and not isinstance(v, bool) else v
        for k, v in data.items()
    }
    return MixinConfig(**values)  # type: ignore[arg-type]  # checked in __post_init__
