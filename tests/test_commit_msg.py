"""The ``commit-msg`` hook (tools/commit_msg.py) refuses a subject over 72 characters, as pre-commit runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.commit_msg import MAX_SUBJECT

ROOT = Path(__file__).resolve().parent.parent


def run_hook(tmp_path: Path, message: str) -> subprocess.CompletedProcess[str]:
    """The hook as pre-commit calls it: a process given the path of the message file."""
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message, encoding="utf-8")
    return subprocess.run(
        [sys.executable, "tools/commit_msg.py", str(path)], cwd=ROOT, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    "message",
    [
        "A hold with N slots keeps one for the held-back message\n\nA body line may be as long as it likes: "
        + "x" * 100,
        "x" * MAX_SUBJECT + "\n",
        "# Please enter the commit message for your changes.\n\nShort subject after git's comments\n",
        "",
    ],
    ids=["subject-and-long-body", "exactly-72", "after-comments", "empty"],
)
def test_a_subject_of_at_most_72_characters_passes(tmp_path: Path, message: str) -> None:
    result = run_hook(tmp_path, message)
    assert result.returncode == 0, result.stderr


def test_a_longer_subject_fails_naming_its_length(tmp_path: Path) -> None:
    long = "Docs: the architecture names every module, by layer, and a test keeps it so"
    assert len(long) > MAX_SUBJECT
    result = run_hook(tmp_path, f"{long}\n\nbody\n")
    assert result.returncode == 1
    assert f"{len(long)} characters, at most 72" in result.stderr


def test_pre_commit_runs_the_hook_at_commit_msg() -> None:
    """The hook is installed by a plain ``pre-commit install`` and runs at the commit-msg stage only."""
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    assert "default_install_hook_types: [pre-commit, commit-msg]" in config
    hook = config.split("id: commit-msg-subject", 1)[1].split("- id:", 1)[0]
    assert "tools/commit_msg.py" in hook and "stages: [commit-msg]" in hook
