"""``python -m dramatiq_leases.mixin [--config FILE] --out DIR``: render the alert rules and the dashboard.

Writes ``dramatiq-leases.rules.yml`` and ``dramatiq-leases.json`` into DIR
(needs PyYAML: ``pip install 'dramatiq-leases[mixin]'``). ``--out`` may be
left out only in a source checkout of dramatiq-leases, where the default is
the repository's own ``alerts/`` and ``dashboards/``; an installed copy
refuses (exit 2) rather than write into its own site-packages.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from . import DASHBOARD_FILE, RULES_FILE, dashboard_json, load, rules_yaml

PROG = "python -m dramatiq_leases.mixin"
INSTALL_HINT = "pip install 'dramatiq-leases[mixin]'"
#: The ``dramatiq_leases`` directory this module belongs to.
PACKAGE_DIR = Path(__file__).resolve().parents[1]
DESCRIPTION = f"""\
Render the alert and recording rules (dramatiq-leases.rules.yml) and the Grafana
dashboard (dramatiq-leases.json) into DIR, from the defaults or --config FILE.

--out may be left out only in a source checkout of dramatiq-leases, where it
regenerates the repository's alerts/ and dashboards/; an installed copy exits 2
without it rather than write into site-packages. Needs PyYAML: {INSTALL_HINT}
"""


def checkout(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The root of the source checkout the ``dramatiq_leases`` directory sits in, or None for an installed copy.

    A checkout's root, the directory above the package, holds this project's ``pyproject.toml`` and
    ``alerts/``; an installed copy's is ``site-packages``, which holds neither.
    """
    root = package_dir.parent
    pyproject = root / "pyproject.toml"
    try:
        ours = 'name = "dramatiq-leases"' in pyproject.read_text()
    except OSError:
        return None
    return root if ours and (root / "alerts").is_dir() else None


def main(argv: Sequence[str] | None = None) -> int:
    """Render; returns the exit code (2 for a bad config, a missing ``--out`` or missing PyYAML)."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="YAML or JSON settings that differ from the defaults"
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="directory for both files; required unless run from a source checkout\n"
        "(there, the default is the repository's alerts/ and dashboards/)",
    )
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"{PROG}: {message}", file=sys.stderr)
        return 2

    # Checked before anything is written: the rules are YAML, the extra brings the only writer of it.
    if importlib.util.find_spec("yaml") is None:
        return fail(f"rendering the rules needs PyYAML: {INSTALL_HINT}")
    root = checkout()
    if args.out is not None:
        rules_dir = dashboard_dir = Path(args.out)
    elif root is not None:
        rules_dir, dashboard_dir = root / "alerts", root / "dashboards"
    else:
        return fail("--out DIR is required for an installed copy (the default writes a source checkout's files)")
    try:
        cfg = load(args.config)
    except (OSError, ValueError) as e:
        return fail(str(e))
    rules_at, dashboard_at = rules_dir / RULES_FILE, dashboard_dir / DASHBOARD_FILE
    for path, text in ((rules_at, rules_yaml(cfg)), (dashboard_at, dashboard_json(cfg))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
