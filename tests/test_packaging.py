"""The package as a user gets it: sdist and wheel built by ``python -m build``, installed into a fresh venv.

The venv lives outside the repository and every command runs from a directory
outside it, so nothing here can pass by importing the checkout: the demo, the
mixin CLI (without its extra, then with it), ``py.typed`` and the version all
come from the installed wheel. Its runtime dependencies come from the package
index (pip's cache keeps that quick).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import dramatiq_leases

pytestmark = [pytest.mark.system, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[1]
LUA = sorted(path.name for path in (ROOT / "dramatiq_leases" / "core" / "lua").glob("*.lua"))
#: Files of the package that are not Python, which the wheel and the sdist must both carry.
PACKAGE_DATA = [
    "dramatiq_leases/py.typed",
    "dramatiq_leases/mixin/dashboard.json",
    *(f"dramatiq_leases/core/lua/{name}" for name in LUA),
    *(f"dramatiq_leases/exporter/static/{name}" for name in ("busy.html", "busy.css", "busy.js")),
]
MIXIN_HINT = "pip install 'dramatiq-leases[mixin]'"


@dataclass(frozen=True)
class Installed:
    """The built distributions and the venv the wheel is installed in (no extras)."""

    sdist: Path
    wheel: Path
    venv: Path
    work: Path  # an empty directory outside the repository, the cwd of every command

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a command of the venv from ``work``, with nothing of this suite's environment leaking in."""
        env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV", "REDIS_URL"}}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return subprocess.run(
            [str(arg) for arg in args], cwd=self.work, env=env, capture_output=True, text=True, timeout=timeout
        )

    def pip_install(self, *requirements: str) -> None:
        # The suite's pip installs into the venv (--python): the venv needs no pip of its own.
        pip = [sys.executable, "-m", "pip", "--python", self.bin("python"), "--disable-pip-version-check"]
        done = self.run(*pip, "install", "--quiet", *requirements, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


def checked(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("packaging")
    assert ROOT not in base.parents, "the venv must be outside the repository"
    dist = base / "dist"
    # sdist first, then the wheel built from the unpacked sdist: a file the sdist forgets fails here.
    # Isolated: the build backend comes from [build-system] (setuptools>=77), not from the suite's venv.
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    venv, work = base / "venv", base / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    found = Installed(sdist=sdist, wheel=wheel, venv=venv, work=work)
    found.pip_install(str(wheel))
    return found


def test_sdist_and_wheel_pass_twine_and_carry_what_a_user_needs(installed: Installed) -> None:
    out = checked(installed.run(sys.executable, "-m", "twine", "check", "--strict", installed.sdist, installed.wheel))
    assert out.count("PASSED") == 2, out

    with tarfile.open(installed.sdist) as sdist:
        top = f"dramatiq_leases-{dramatiq_leases.__version__}/"
        in_sdist = {name.removeprefix(top) for name in sdist.getnames()}
    wanted = ["LICENSE", "README.md", "pyproject.toml", *PACKAGE_DATA]
    if (ROOT / "CHANGELOG.md").exists():
        wanted.append("CHANGELOG.md")
    assert [name for name in wanted if name not in in_sdist] == []
    assert not any(name.startswith(("tests/", "bench/")) for name in in_sdist)

    with zipfile.ZipFile(installed.wheel) as wheel:
        in_wheel = set(wheel.namelist())
        info = f"dramatiq_leases-{dramatiq_leases.__version__}.dist-info/"
        metadata = wheel.read(f"{info}METADATA").decode()
    assert [name for name in PACKAGE_DATA if name not in in_wheel] == []
    assert f"{info}licenses/LICENSE" in in_wheel
    assert {name.split("/")[0] for name in in_wheel} == {"dramatiq_leases", info.rstrip("/")}, "only the package"
    assert "License-Expression: MIT" in metadata.splitlines()
    assert "Classifier: Typing :: Typed" in metadata.splitlines()


def test_the_installed_wheel_ships_py_typed_and_one_version(installed: Installed) -> None:
    code = (
        "import importlib.metadata, pathlib, dramatiq_leases; "
        "print(pathlib.Path(dramatiq_leases.__file__).parent / 'py.typed'); "
        "print(importlib.metadata.version('dramatiq-leases')); print(dramatiq_leases.__version__)"
    )
    typed, installed_version, module_version = checked(installed.run(installed.bin("python"), "-c", code)).split()
    assert installed.venv in Path(typed).parents, f"imported from {typed}, not the venv"
    assert Path(typed).is_file()
    assert installed_version == module_version == dramatiq_leases.__version__


def test_the_installed_wheel_serves_the_busy_page_from_its_package_data(installed: Installed) -> None:
    """The page's sources are read with importlib.resources: the installed package, not the checkout, has them."""
    code = (
        "import hashlib; from dramatiq_leases.exporter import page; "
        "print(page.__file__); print(hashlib.sha256(page.BUSY_PAGE).hexdigest())"
    )
    where, digest = checked(installed.run(installed.bin("python"), "-c", code)).split()
    from dramatiq_leases.exporter import page

    assert installed.venv in Path(where).parents, f"imported from {where}, not the venv"
    assert digest == hashlib.sha256(page.BUSY_PAGE).hexdigest()


def test_the_demo_runs_from_the_installed_wheel(installed: Installed) -> None:
    # The demo starts its own redis-server (REDIS_URL is not passed) and workers of the venv's Python.
    done = installed.run(
        installed.bin("dramatiq-leases"),
        *("demo", "--invoices", "1", "--per-invoice", "2", "--job-seconds", "0.5"),
        timeout=100,
    )
    out = checked(done)
    assert "a private redis-server that stops with the demo" in out
    assert re.search(r"invoice:1 +fence \d+ +EXPIRED by its TTL .*the orphaned lease is gone", out), out
    assert re.search(r"^  jobs completed +2/2 \(each message exactly once\)$", out, re.M), out
    assert re.search(r"^  killed job +invoice:1 job \d: redelivered and completed with fence \d+$", out, re.M), out
    assert out.rstrip().endswith("demo OK"), out


def test_the_mixin_cli_names_its_extra_then_renders_with_it(installed: Installed) -> None:
    python = installed.bin("python")
    site = Path(
        checked(installed.run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")).strip()
    )
    assert checked(installed.run(python, "-c", "import importlib.util as u; print(u.find_spec('yaml'))")).strip() == (
        "None"
    ), "PyYAML came with the runtime dependencies: this test cannot see the extra missing"
    before = {path for path in site.rglob("*") if "__pycache__" not in path.parts}

    # Without the extra: one line that says what to install, no traceback, nothing written.
    for args in ((), ("--out", str(installed.work / "monitoring"))):
        done = installed.run(python, "-m", "dramatiq_leases.mixin", *args)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.count("\n") == 1 and MIXIN_HINT in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert list(installed.work.iterdir()) == []

    installed.pip_install(f"dramatiq-leases[mixin] @ {installed.wheel.as_uri()}")
    # An installed copy without --out asks for it rather than write into site-packages.
    done = installed.run(python, "-m", "dramatiq_leases.mixin")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "--out DIR is required" in done.stderr, done.stderr
    out = installed.work / "monitoring"
    written = checked(installed.run(python, "-m", "dramatiq_leases.mixin", "--out", "monitoring")).split()
    assert written == ["monitoring/dramatiq-leases.rules.yml", "monitoring/dramatiq-leases.json"]

    rules = yaml.safe_load((out / "dramatiq-leases.rules.yml").read_text())
    alerts = [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    assert "DramatiqLeaseLeaked" in alerts, alerts
    board = json.loads((out / "dramatiq-leases.json").read_text())
    assert board["uid"] == "dramatiq-leases" and board["panels"]
    new_in_site = {path for path in site.rglob("*") if "__pycache__" not in path.parts} - before
    assert not [path for path in new_in_site if path.name.startswith("dramatiq-leases.")], "written into site-packages"
