"""The package's core as it was at an earlier commit, imported beside today's, to time both in one process.

``git archive`` writes ``dramatiq_leases/core`` of that commit into a
directory of its own under another package name (the core imports only
itself, relatively, and reads its Lua files from its own package), so the
old :class:`Leases` runs the old Python and the old scripts, against the
same Redis, in the same rounds as today's.
"""

from __future__ import annotations

import atexit
import importlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

from dramatiq_leases import otel_tracing

ROOT = Path(__file__).resolve().parent.parent


def core_at(commit: str) -> ModuleType:
    """``dramatiq_leases.core`` at ``commit``, imported as ``_dramatiq_leases_core_<commit>``.

    Its tracer is today's (OpenTelemetry's, as importing :mod:`dramatiq_leases` registers), so both
    pay for the same spans. Raises ``RuntimeError`` if git cannot produce the commit's files.
    """
    name = f"_dramatiq_leases_core_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit, "dramatiq_leases/core"],
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot read dramatiq_leases/core at {commit} (a git checkout is needed): {e}") from e
    where = Path(tempfile.mkdtemp(prefix="dramatiq-leases-baseline-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    (where / "dramatiq_leases" / "core").rename(where / name)
    sys.path.insert(0, str(where))
    module = importlib.import_module(name)
    module.tracing.set_tracer(otel_tracing.span, otel_tracing.current_context)
    return module
