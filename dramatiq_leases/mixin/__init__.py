"""The monitoring mixin: alert rules, recording rules and the Grafana dashboard, rendered from one config.

The repository's ``alerts/dramatiq-leases.rules.yml`` and
``dashboards/dramatiq-leases.json`` are the rendering of the default
:class:`MixinConfig`. For your own selectors, cluster label, URLs and
thresholds, write the settings that differ into a file and render into a
directory of yours (YAML output needs ``pip install 'dramatiq-leases[mixin]'``)::

    python -m dramatiq_leases.mixin --config my-mixin.yml --out monitoring/

The rules are written for the alert names and severities the runbook
(``docs/runbook.md``) describes; keep Alertmanager's inhibition of a warning
by the critical alert of the same name and actor (``deploy/alertmanager``).
"""

from __future__ import annotations

import json
from typing import Any

from .config import MixinConfig, load
from .dashboard import dashboard
from .rules import alert_rules, recording_rules, rule_groups

__all__ = [
    "DASHBOARD_FILE",
    "RULES_FILE",
    "MixinConfig",
    "alert_rules",
    "dashboard",
    "dashboard_json",
    "load",
    "recording_rules",
    "rule_groups",
    "rules_yaml",
]

#: File names of a rendering (the same under ``alerts/`` and ``dashboards/`` of the repository).
RULES_FILE = "dramatiq-leases.rules.yml"
DASHBOARD_FILE = "dramatiq-leases.json"

_HEADER = """\
# Prometheus rules for dramatiq-leases: recording rules shared by the alerts and
# the dashboard, then the alerts. Rendered by `python -m dramatiq_leases.mixin`
# from dramatiq_leases/mixin (rules.py says why each alert is what it is;
# docs/runbook.md says what to do). Do not edit: change the config and render.
"""


def rules_yaml(cfg: MixinConfig) -> str:
    """The rule file for ``cfg``, as YAML (multi-line expressions as literal blocks)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> Any:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return _HEADER + yaml.dump(rule_groups(cfg), Dumper=Dumper, sort_keys=False, width=10_000, allow_unicode=True)


def dashboard_json(cfg: MixinConfig) -> str:
    """The dashboard for ``cfg``, as JSON text."""
    return json.dumps(dashboard(cfg), indent=2) + "\n"
