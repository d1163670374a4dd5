"""``python -m dramatiq_leases.mixin [--config FILE] [--out DIR]``: render the rules and the dashboard.

Without ``--out``, writes the repository's own copies (``alerts/`` and
``dashboards/``) from a source checkout.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from . import DASHBOARD_FILE, RULES_FILE, dashboard_json, load, rules_yaml

ROOT = Path(__file__).resolve().parents[2]


def main(argv: Sequence[str] | None = None) -> int:
    """Render; returns the exit code (2 for a bad config)."""
    parser = argparse.ArgumentParser(prog="python -m dramatiq_leases.mixin", description=__doc__)
    parser.add_argument("--config", type=Path, help="YAML or JSON settings that differ from the defaults")
    parser.add_argument(
        "--out", type=Path, help="directory for both files (default: the repository's alerts/ and dashboards/)"
    )
    args = parser.parse_args(argv)
    try:
        cfg = load(args.config)
    except (OSError, ValueError) as e:
        print(f"dramatiq-leases mixin: {e}", file=sys.stderr)
        return 2
    rules_at = (args.out or ROOT / "alerts") / RULES_FILE
    dashboard_at = (args.out or ROOT / "dashboards") / DASHBOARD_FILE
    for path, text in ((rules_at, rules_yaml(cfg)), (dashboard_at, dashboard_json(cfg))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
