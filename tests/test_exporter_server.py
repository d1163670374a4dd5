"""``dramatiq-leases exporter`` as an operator runs it: its bind errors.

Each test runs the real command (``python -m dramatiq_leases.cli``, a
subprocess) against a private Redis: a port out of range is a usage error
found before anything starts; an unknown host or a port in use ends in one
line naming ``HOST:PORT`` and the system's reason, and exit 5.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from dramatiq_leases.embedded import EmbeddedRedis, free_port

CLI = [sys.executable, "-m", "dramatiq_leases.cli"]


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)


# --- bind errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["70000", "65536", "-1", "nine"])
def test_a_port_out_of_range_is_a_usage_error_found_before_anything_starts(port: str) -> None:
    # Nothing listens at this Redis: had the exporter asked it first, it would exit 4.
    done = run_cli("--redis-url", f"redis://127.0.0.1:{free_port()}/0", "exporter", "--port", port)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.startswith("usage: dramatiq-leases exporter ")
    assert done.stderr.splitlines()[-1] == ("dramatiq-leases exporter: error: argument --port: must be a port "
                                            f"number from 0 to 65535 (0: any free port), got '{port}'")


def test_an_unresolvable_host_ends_in_one_line_naming_it_and_exit_5(redis_server: EmbeddedRedis) -> None:
    port = free_port()
    done = run_cli("--redis-url", redis_server.url(), "exporter", "--host", "no-such-host.invalid",
                   "--port", str(port))
    assert done.returncode == 5, done.stderr
    assert done.stderr.startswith(f"dramatiq-leases: cannot listen on no-such-host.invalid:{port}: ")
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr and done.stdout == ""


def test_a_port_in_use_ends_in_one_line_with_the_systems_reason_and_exit_5(redis_server: EmbeddedRedis) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("--redis-url", redis_server.url(), "exporter", "--host", "127.0.0.1", "--port", str(port))
    assert done.returncode == 5, done.stderr
    assert done.stderr == f"dramatiq-leases: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_the_help_documents_exit_5() -> None:
    done = run_cli("exporter", "--help")
    assert done.returncode == 0
    assert "5    exporter: cannot listen on HOST:PORT" in done.stdout
