"""``dramatiq-leases exporter`` as an operator runs it: bind errors, and who may read the Busy view.

Each test runs the real command (``python -m dramatiq_leases.cli``, a
subprocess) against a private Redis: a port out of range is a usage error
found before anything starts; an unknown host or a port in use ends in one
line and exit 5; ``/metrics`` is served on every bind, while the lease views,
which show lease keys, are refused on a non-loopback bind unless the operator
opts in (``--open-lease-views``) or ``--web.config.file`` authenticates the
reader (tests/test_exporter_security.py).
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from dramatiq_leases.core import Lease, Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.exporter import Exporter

from .support.stack import MakeLeases
from .support.waiting import wait_for

CLI = [sys.executable, "-m", "dramatiq_leases.cli"]
# A key as real ones look: it names a person. It must never reach a reader who was not let in.
PERSONAL = "gdpr-export:user:alice@example.com"
META = {"actor": "gdpr_export", "queue": "exports", "host": "worker-3", "pid": "4242", "message_id": "msg-9"}


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """A store in which a worker holds the personal key."""
    store = make_leases()
    lease = store.try_acquire(PERSONAL, 60_000, interval=20_000, meta=META)
    assert isinstance(lease, Lease)
    return store


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)


def get(
    port: int, path: str, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of a request to the exporter on this host (errors included)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


class Running:
    """A running ``dramatiq-leases exporter`` and where it logs."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log

    def page(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        """The Busy page once a scan has seen the lease (the reader being let in)."""

        def scanned() -> dict[str, Any] | None:
            status, _, body = get(self.port, "/leases", headers)
            assert status == 200, body
            doc: dict[str, Any] = json.loads(body)
            return doc if doc["leases_total"] == 1 else None

        doc = wait_for(scanned, timeout=20, what="a scan that saw the lease")
        assert doc is not None  # for mypy: wait_for returns only a truthy value
        return doc


@contextmanager
def exporter(redis_server: EmbeddedRedis, tmp_path: Path, *flags: str, host: str = "127.0.0.1") -> Iterator[Running]:
    """``dramatiq-leases exporter`` on a free port of ``host``, serving /metrics, stopped on exit. A port found
    free can be taken before the exporter binds it (another test's server): then another is tried."""
    for attempt in range(3):
        port = free_port()
        log = tmp_path / f"exporter-{port}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    *CLI,
                    "--redis-url",
                    redis_server.url(),
                    "exporter",
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--interval",
                    "0.2",
                    *flags,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        def serving(proc: subprocess.Popen[bytes] = proc, port: int = port) -> bool:
            if proc.poll() is not None:
                return True  # ended: told below
            try:
                return get(port, "/metrics")[0] == 200
            except OSError:
                return False

        wait_for(serving, timeout=30, interval=0.05, what="the exporter to serve /metrics")
        if proc.poll() is None:
            break
        assert attempt < 2 and "Address already in use" in log.read_text(), log.read_text()
    try:
        yield Running(port, log)
    finally:
        proc.terminate()
        proc.wait(10)


# --- bind errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["70000", "65536", "-1", "nine"])
def test_a_port_out_of_range_is_a_usage_error_found_before_anything_starts(port: str) -> None:
    # Nothing listens at this Redis: had the exporter asked it first, it would exit 4.
    done = run_cli("--redis-url", f"redis://127.0.0.1:{free_port()}/0", "exporter", "--port", port)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.startswith("usage: dramatiq-leases exporter ")
    assert done.stderr.splitlines()[-1] == (
        "dramatiq-leases exporter: error: argument --port: must be a port "
        f"number from 0 to 65535 (0: any free port), got '{port}'"
    )


def test_an_unresolvable_host_ends_in_one_line_naming_it_and_exit_5(redis_server: EmbeddedRedis) -> None:
    port = free_port()
    done = run_cli("--redis-url", redis_server.url(), "exporter", "--host", "no-such-host.invalid", "--port", str(port))
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
    for flag in ("--web.config.file FILE", "--open-lease-views", "--mask-keys"):
        assert flag in done.stdout
    for removed in ("--busy-view", "--busy-token-file", "--busy-keys"):
        assert removed not in done.stdout


# --- who may read /leases --------------------------------------------------------------------------------------


def test_on_every_interface_metrics_are_served_and_the_busy_view_is_refused_saying_how_to_enable_it(
    redis_server: EmbeddedRedis, leases: Leases, tmp_path: Path
) -> None:
    with exporter(redis_server, tmp_path, host="0.0.0.0") as running:
        metrics = wait_for(
            lambda: (b := get(running.port, "/metrics")[2]) and b"dramatiq_lease_present{" in b and b,
            what="a scan's gauges",
        )
        assert metrics  # for mypy: wait_for returns only a truthy value
        assert PERSONAL.encode() not in metrics, "keys never become labels"
        for method in ("GET", "HEAD", "POST"):
            status, headers, body = get(running.port, "/leases?limit=5", method=method)
            assert status == 403, (method, body)
            assert headers["Content-Type"] == "application/json"
            if method == "HEAD":
                assert body == b""
            else:
                doc = json.loads(body)
                assert doc["error"] == "forbidden"
                assert "--web.config.file" in doc["detail"] and "--open-lease-views" in doc["detail"]
                assert f"0.0.0.0:{running.port}" in doc["detail"]
            for leak in (PERSONAL, META["message_id"], META["host"]):
                assert leak.encode() not in body
    # The operator is told at start, on stderr.
    assert (
        "The lease views (/leases, /busy, /leases/history) are refused (403) on the non-loopback bind "
        f"0.0.0.0:{running.port}"
    ) in running.log.read_text()


def test_the_library_exporter_on_every_interface_refuses_the_busy_view_too(leases: Leases) -> None:
    exporter = Exporter(leases, host="0.0.0.0", port=0)  # every interface, as a scrape by another host needs
    try:
        status, _, body = get(exporter.port, "/leases")
        assert status == 403 and json.loads(body)["error"] == "forbidden"
    finally:
        exporter.close()


def test_open_lease_views_serves_them_to_anyone_who_reaches_the_port(
    redis_server: EmbeddedRedis, leases: Leases, tmp_path: Path
) -> None:
    with exporter(redis_server, tmp_path, "--open-lease-views", host="0.0.0.0") as running:
        (row,) = running.page()["leases"]
        assert row["key"] == PERSONAL and row["host"] == META["host"]
        assert get(running.port, "/busy")[0] == 200
    assert f"are served to anyone who reaches 0.0.0.0:{running.port} (--open-lease-views)" in running.log.read_text()


def test_hashed_keys_show_a_digest_and_no_inspect_command(
    redis_server: EmbeddedRedis, leases: Leases, tmp_path: Path
) -> None:
    assert not leases.line.join(PERSONAL, 60_000, waiter="msg-10:0")  # a waiter: the key is a hot key too
    digest = "sha256:" + hashlib.sha256(PERSONAL.encode()).hexdigest()[:16]
    with exporter(redis_server, tmp_path, "--mask-keys") as running:
        doc = wait_for(lambda: (d := running.page())["hot_keys"] and d, what="the hot key")
    (row,) = doc["leases"]
    assert row["key"] == digest and row["inspect_command"] is None and row["actor"] == META["actor"]
    (hot,) = doc["hot_keys"]
    assert hot["key"] == digest and hot["inspect_command"] is None and hot["line_length"] == 1
    assert PERSONAL not in json.dumps(doc)


def test_an_ipv6_loopback_in_brackets_is_a_loopback_bind(
    redis_server: EmbeddedRedis, leases: Leases, tmp_path: Path
) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    port = free_port()
    log = tmp_path / "exporter.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *CLI,
                "--redis-url",
                redis_server.url(),
                "exporter",
                "--host",
                "[::1]",
                "--port",
                str(port),
                "--interval",
                "0.2",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def page() -> dict[str, Any] | None:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://[::1]:{port}/leases", timeout=5) as response:
                    doc: dict[str, Any] = json.loads(response.read())
            except OSError:
                return None
            return doc if doc["leases_total"] == 1 else None

        doc = wait_for(page, timeout=30, what="the Busy view on [::1]")
        assert doc is not None  # for mypy: wait_for returns only a truthy value
        assert doc["leases"][0]["key"] == PERSONAL
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.7", False),
        ("fe80::1%eth0", False),
        ("", False),
    ],
)
def test_what_counts_as_a_loopback_bind(address: str, loopback: bool) -> None:
    from dramatiq_leases.exporter.access import is_loopback

    assert is_loopback(address) is loopback


# --- the compose bundle ------------------------------------------------------------------------------------


def test_the_compose_exporter_serves_the_busy_view_to_grafanas_datasource(
    redis_server: EmbeddedRedis, leases: Leases, tmp_path: Path
) -> None:
    """Grafana reads /leases over the compose network (a non-loopback bind), as its provisioning says."""
    import yaml

    from dramatiq_leases.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    command = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]["exporter"]["command"]
    (datasource,) = yaml.safe_load((root / "deploy/grafana/provisioning/datasources/exporter.yml").read_text())[
        "datasources"
    ]
    assert command[:2] == ["dramatiq-leases", "exporter"]
    args = build_parser().parse_args(command[1:])
    assert args.host == "0.0.0.0", "in its container, the exporter must listen where Grafana reaches it"
    assert datasource.get("jsonData", {}).get("auth_method") is None, "the datasource sends no token"
    # The compose command as is, but for this test's Redis and a free port.
    flags = list(command[2:])
    for option in ("--redis-url", "--port"):
        at = flags.index(option)
        del flags[at : at + 2]
    with exporter(redis_server, tmp_path, *flags, host="0.0.0.0") as running:
        (row,) = running.page()["leases"]  # what the Infinity datasource asks, without a token
        assert row["key"] == PERSONAL
