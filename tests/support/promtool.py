"""Running promtool and amtool from tests, checking PromQL with promtool, and unit-testing alert rules
on series taken from real expositions.

The bundle tests use the real binaries, from the Debian packages
``prometheus`` (promtool) and ``prometheus-alertmanager`` (amtool). Outside CI
a missing binary skips the tests that need it, so the rest still runs on a
machine without them; in CI (``CI=true``) it fails them, so that these checks
cannot quietly stop running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

#: The Debian package that ships each binary, for the skip or failure message.
PACKAGES = {"promtool": "prometheus", "amtool": "prometheus-alertmanager"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def require(binary: str) -> str:
    """The path of ``binary``; skips the test without it, or fails it in CI."""
    path = shutil.which(binary)
    if path is not None:
        return path
    problem = f"{binary} is not on PATH (apt-get install {PACKAGES.get(binary, binary)})"
    if in_ci():
        pytest.fail(f"{problem}: CI must install it", pytrace=False)
    pytest.skip(f"{problem}: skipped outside CI")


def run(binary: str, *args: str | Path, cwd: Path | None = None) -> str:
    """Run ``binary`` and return its standard output; fails the test, with all output, unless it exits 0."""
    argv = [require(binary), *map(str, args)]
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}", pytrace=False)
    return proc.stdout


#: Values for Grafana's built-in variables that PromQL accepts where they occur.
_GRAFANA_BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
    "__interval_ms": "60000",
    "__range_s": "3600",
    "__range_ms": "3600000",
}

# $name, ${name}, ${name:format} and the deprecated [[name]].
_GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def grafana_to_promql(expr: str) -> str:
    """A Grafana query with its variables replaced, as Grafana would before sending it.

    Dashboard variables are matched as regexes (``actor_name=~"$actor"``), so
    they become ``.*``, which is what "All" expands to. An unknown built-in
    (``$__something``) also becomes ``.*``: if it stood for a duration, the
    query then fails to parse, and the table above needs an entry.
    """

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        return _GRAFANA_BUILTINS.get(name, ".*")

    return _GRAFANA_VARIABLE.sub(value, expr)


def check_promql(exprs: Mapping[str, str], workdir: Path) -> None:
    """Fail the test unless promtool parses every expression.

    promtool has no command to parse a bare query, so each one becomes a
    recording rule, named by its key, in a rules file for ``promtool check
    rules``; its errors name the rule.
    """
    rules = [{"record": name, "expr": expr} for name, expr in exprs.items()]
    path = workdir / "exprs.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}, sort_keys=False))
    run("promtool", "check", "rules", path)


def scrape_series(expositions: Sequence[str], target: Mapping[str, str]) -> list[dict[str, str]]:
    """``input_series`` for ``promtool test rules``: one target scraped once per ``interval``.

    ``expositions`` are the target's successive scrapes (text format). Every
    sample becomes a point of its series, with the ``target`` labels (``job``,
    ``instance``) added as Prometheus adds them; a series missing from a
    scrape has no point there (``_``), as after a restart.
    """
    points: dict[str, list[str]] = {}
    for i, text in enumerate(expositions):
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(
                    f"{name}={json.dumps(value)}" for name, value in sorted({**sample.labels, **target}.items())
                )
                points.setdefault(f"{sample.name}{{{labels}}}", ["_"] * i).append(repr(float(sample.value)))
        for values in points.values():
            values.extend(["_"] * (i + 1 - len(values)))
    return [{"series": series, "values": " ".join(values)} for series, values in points.items()]


def run_rule_tests(
    rule_files: Sequence[Path], tests: list[dict[str, Any]], workdir: Path, evaluation_interval: str = "1m"
) -> str:
    """Run ``promtool test rules`` on ``tests`` (its ``tests:`` list) against ``rule_files``; fails the test
    with promtool's report unless every case passes."""
    path = workdir / "rules.test.yml"
    path.write_text(
        yaml.safe_dump(
            {"rule_files": [str(f) for f in rule_files], "evaluation_interval": evaluation_interval, "tests": tests},
            sort_keys=False,
        )
    )
    return run("promtool", "test", "rules", path.name, cwd=workdir)
