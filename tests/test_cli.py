"""The ``dramatiq-leases`` command on a real Redis: what it shows, what it refuses, and its exit codes."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import redis

from dramatiq_leases.cli import main
from dramatiq_leases.core import Lease, Leases, State
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .conftest import wait_for

META = {"actor": "send_invoice", "queue": "default", "message_id": "msg-1", "host": "web-7", "pid": "4242"}


@pytest.fixture
def leases(redis_server: EmbeddedRedis) -> Leases:
    return Leases.from_url(redis_server.url())


def cli(capsys: pytest.CaptureFixture[str], server: EmbeddedRedis, *argv: str) -> tuple[int, str, str]:
    code = main(["--redis-url", server.url(), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def acquire(leases: Leases, key: str, **kwargs: object) -> Lease:
    kwargs.setdefault("interval", 10_000)  # as a worker's heartbeat would declare
    lease = leases.try_acquire(key, kwargs.pop("ttl", 30_000), **kwargs)  # type: ignore[arg-type]
    assert isinstance(lease, Lease)
    return lease


def dead_lease(leases: Leases, key: str) -> Lease:
    """A lease whose holder stopped renewing: it promised a 1 ms heartbeat and sent none."""
    lease = acquire(leases, key, interval=1, meta=META)
    wait_for(lambda: (i := leases.inspect(key)) is not None and i.state is State.HOLDER_DEAD,
             timeout=5, what="the holder to count as dead")
    return lease


# list ---------------------------------------------------------------------


def test_list_shows_every_lease_with_holder_fence_and_state(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    acquire(leases, "invoice:1", meta=META)
    dead_lease(leases, "invoice:2")
    acquire(leases, "invoice:3")
    redis_client.persist(leases.lease_name("invoice:3"))  # someone removed its TTL: it would never expire
    acquire(leases, "invoice:4", max_hold=60_000)
    redis_client.hset(leases.lease_name("invoice:4"), "max_hold_until_ms", 1)  # its maximum hold has passed
    redis_client.set(f"{leases.prefix}:lease:by-hand", "x")  # debris under the prefix, no TTL

    code, out, _ = cli(capsys, redis_server, "list")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["KEY"].split()[:4] == ["KEY", "ACTOR", "MESSAGE", "HOLDER"]
    assert lines["invoice:1"].split()[1:4] == ["send_invoice", "msg-1", "web-7:4242"]
    assert lines["invoice:1"].split()[-2:] == ["1", "alive"]
    assert lines["invoice:2"].endswith("holder_dead")
    assert lines["invoice:3"].endswith("no_ttl") and " none " in lines["invoice:3"]
    assert lines["invoice:4"].endswith("past_max_hold")
    assert lines[f"{leases.prefix}:lease:by-hand"].endswith("no_ttl")
    assert f"note: {leases.prefix}:lease:by-hand is a string key, not a lease hash" in out

    code, out, _ = cli(capsys, redis_server, "ls", "--json")
    assert code == 0
    rows = {row["key"]: row for row in json.loads(out)}
    assert {k: r["state"] for k, r in rows.items()} == {
        "invoice:1": "alive", "invoice:2": "holder_dead", "invoice:3": "no_ttl", "invoice:4": "past_max_hold",
        f"{leases.prefix}:lease:by-hand": "no_ttl",
    }
    assert rows["invoice:1"]["message_id"] == "msg-1"
    assert rows["invoice:1"]["holder"] == "web-7:4242"
    assert rows["invoice:1"]["fence"] == 1
    assert 0 < rows["invoice:1"]["ttl_left"] <= 30_000
    assert rows[f"{leases.prefix}:lease:by-hand"]["problem"] == "a string key, not a lease hash"
    assert all("token" not in row for row in rows.values()), "list must never print owner tokens"


def test_list_match_is_a_glob_on_the_lease_key_even_with_braces(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    acquire(leases, "invoice:1")
    acquire(leases, "export:{user}:7")  # stored under a digest hash tag, not under its own name

    code, out, _ = cli(capsys, redis_server, "list", "--json", "--match", "export:*")
    assert code == 0
    assert [row["key"] for row in json.loads(out)] == ["export:{user}:7"]

    code, out, _ = cli(capsys, redis_server, "list", "--match", "invoice:*")
    assert code == 0
    assert "invoice:1" in out and "export" not in out

    code, out, _ = cli(capsys, redis_server, "list", "--match", "nothing:*")
    assert code == 0
    assert out == "no leases matching 'nothing:*' under prefix 'dramatiq-leases'\n"


def test_list_with_nothing_there(capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis) -> None:
    assert cli(capsys, redis_server, "list") == (0, "no leases under prefix 'dramatiq-leases'\n", "")
    assert cli(capsys, redis_server, "list", "--json") == (0, "[]\n", "")


def test_prefix_selects_the_leases_and_flags_work_after_the_command(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    acquire(leases, "invoice:1")
    acquire(Leases.from_url(redis_server.url(), prefix="billing"), "invoice:2")

    assert main(["list", "--json", "--prefix", "billing", "--redis-url", redis_server.url()]) == 0
    assert [row["key"] for row in json.loads(capsys.readouterr().out)] == ["invoice:2"]


def test_redis_url_defaults_to_the_environment(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    acquire(leases, "invoice:1")
    monkeypatch.setenv("REDIS_URL", redis_server.url())
    assert main(["list", "--json"]) == 0
    assert [row["key"] for row in json.loads(capsys.readouterr().out)] == ["invoice:1"]


# show ---------------------------------------------------------------------


def test_show_prints_every_field_and_the_fence_counter(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    leases.release(acquire(leases, "invoice:1"))
    lease = acquire(leases, "invoice:1", meta=META)

    code, out, _ = cli(capsys, redis_server, "show", "invoice:1")
    assert code == 0
    fields = dict(re.split(r" {2,}", line, maxsplit=1) for line in out.splitlines())
    assert fields["key"] == "invoice:1"
    assert fields["fence"] == "2"
    assert fields["state"].startswith("alive")
    assert fields["message_id"] == "msg-1" and fields["host"] == "web-7" and fields["pid"] == "4242"
    assert fields["fence counter"] == "last fence 2, last released 1"
    assert fields["renew interval"] == "10.0s" and fields["dead after"] == "20.5s without a heartbeat"
    assert lease.token not in out, "the owner token is a capability: only --show-token prints it"

    code, out, _ = cli(capsys, redis_server, "show", "invoice:1", "--json", "--show-token")
    assert code == 0
    data = json.loads(out)
    assert data["token"] == lease.token
    assert data["fence_state"] == {"fence": 2, "released": 1}
    assert data["state"] == "alive" and data["dead_after"] == 20.5 and data["actor"] == "send_invoice"


def test_show_missing_lease_exits_3(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    assert cli(capsys, redis_server, "show", "invoice:9") == (
        3, "", "dramatiq-leases: no lease on 'invoice:9' under prefix 'dramatiq-leases'\n")
    leases.release(acquire(leases, "invoice:9"))
    code, _, err = cli(capsys, redis_server, "show", "invoice:9", "--json")
    assert code == 3
    assert "the last grant had fence 1" in err


# release ------------------------------------------------------------------


def test_release_owner_releases_only_for_the_holding_token(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    lease = acquire(leases, "invoice:1", meta=META)

    code, out, err = cli(capsys, redis_server, "release", "invoice:1", "--owner", "not-the-token")
    assert (code, out) == (1, "")
    assert err.startswith(
        "dramatiq-leases: refused: 'invoice:1' is held by another owner (fence 1, web-7:4242)")
    info = leases.inspect("invoice:1")
    assert info is not None and info.token == lease.token, "a refused release must not touch the lease"

    code, out, _ = cli(capsys, redis_server, "release", "invoice:1", "--owner", lease.token)
    assert code == 0
    assert out == "released 'invoice:1' (fence 1, held by web-7:4242): the token matched.\n"
    assert leases.inspect("invoice:1") is None
    assert leases.fence_state("invoice:1")["released"] == 1  # a release, not an expiry, for the fence history


def test_release_if_dead_refuses_a_live_holder_and_says_why(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases
) -> None:
    lease = acquire(leases, "invoice:1", meta=META)

    code, out, err = cli(capsys, redis_server, "release", "invoice:1", "--if-dead")
    assert (code, out) == (1, "")
    assert "refused: the holder of 'invoice:1' (fence 1, web-7:4242) is alive" in err
    assert "its last heartbeat was 0.0s ago, within the 20.5s threshold" in err
    assert len(err.splitlines()) == 1
    info = leases.inspect("invoice:1")
    assert info is not None and info.token == lease.token


def test_release_if_dead_releases_a_holder_whose_heartbeat_stopped(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    dead_lease(leases, "invoice:1")
    code, out, _ = cli(capsys, redis_server, "release", "invoice:1", "--if-dead")
    assert code == 0
    assert out.startswith(
        "released 'invoice:1' (fence 1, held by web-7:4242): the holder's last heartbeat was ")
    assert "past the 0.5s threshold" in out
    assert leases.inspect("invoice:1") is None

    acquire(leases, "invoice:2")
    redis_client.persist(leases.lease_name("invoice:2"))
    code, out, _ = cli(capsys, redis_server, "release", "invoice:2", "--if-dead")
    assert code == 0 and "it had no TTL" in out
    assert leases.inspect("invoice:2") is None


@pytest.mark.parametrize("how", [["--owner", "abc"], ["--if-dead"]])
def test_release_of_a_missing_lease_exits_3(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, how: list[str]
) -> None:
    code, out, err = cli(capsys, redis_server, "release", "invoice:9", *how)
    assert (code, out) == (3, "")
    assert err == (
        "dramatiq-leases: no lease on 'invoice:9' under prefix 'dramatiq-leases'; nothing to release\n")


@pytest.mark.parametrize("how", [[], ["--owner", "abc", "--if-dead"]])
def test_release_needs_exactly_one_of_owner_and_if_dead(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, leases: Leases, how: list[str]
) -> None:
    dead_lease(leases, "invoice:1")
    code, out, err = cli(capsys, redis_server, "release", "invoice:1", *how)
    assert (code, out) == (2, "")
    assert "--owner" in err and "--if-dead" in err
    assert leases.inspect("invoice:1") is not None, "a usage error must not release anything"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis) -> None:
    assert cli(capsys, redis_server)[0] == 2  # no command
    assert cli(capsys, redis_server, "frobnicate")[0] == 2
    code, _, err = cli(capsys, redis_server, "--prefix", "a*", "list")
    assert code == 2 and "prefix must be" in err
    code, _, err = cli(capsys, redis_server, "show", "")
    assert code == 2 and "lease key must be a non-empty string" in err
    assert main(["--redis-url", "http://example.com", "list"]) == 2
    assert "invalid --redis-url" in capsys.readouterr().err


# Redis unreachable -----------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["list"], ["show", "invoice:1"], ["release", "invoice:1", "--owner", "abc"],
    ["release", "invoice:1", "--if-dead"], ["exporter", "--port", "0"], ["demo"],
], ids=lambda argv: " ".join(argv))
def test_unreachable_redis_exits_4_with_one_line_naming_the_url(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    port = free_port()  # nothing listens there
    code = main(["--redis-url", f"redis://:hunter2@127.0.0.1:{port}/0", *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (4, "")
    assert err.startswith(f"dramatiq-leases: cannot use Redis at redis://:***@127.0.0.1:{port}/0: ")
    assert len(err.splitlines()) == 1
    assert "hunter2" not in err, "the password must not be printed"


# The installed console script -------------------------------------------------


def _script() -> str:
    return str(Path(sys.executable).with_name("dramatiq-leases"))


def test_console_script_lists_leases_and_documents_its_exit_codes(
    redis_server: EmbeddedRedis, leases: Leases
) -> None:
    acquire(leases, "invoice:1", meta=META)
    done = subprocess.run([_script(), "--redis-url", redis_server.url(), "list", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [row["key"] for row in json.loads(done.stdout)] == ["invoice:1"]

    done = subprocess.run([_script(), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    codes = ("0    success", "1    refused", "2    usage error", "3    not found", "4    Redis unreachable")
    for line in codes:
        assert line in done.stdout

    port = free_port()
    done = subprocess.run([_script(), "--redis-url", f"redis://127.0.0.1:{port}/0", "show", "invoice:1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 4
    assert done.stderr.startswith(f"dramatiq-leases: cannot use Redis at redis://127.0.0.1:{port}/0: ")
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.skipif(importlib.util.find_spec("dramatiq_leases.exporter") is None,
                    reason="dramatiq_leases.exporter is not written yet")
def test_exporter_serves_metrics_until_stopped(redis_server: EmbeddedRedis, leases: Leases) -> None:
    acquire(leases, "invoice:1", meta=META)
    port = free_port()
    proc = subprocess.Popen([_script(), "--redis-url", redis_server.url(), "exporter", "--host", "127.0.0.1",
                             "--port", str(port), "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def scrape() -> str | None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
                    return str(response.read().decode())
            except OSError:
                return None

        assert wait_for(scrape, timeout=15, what="the exporter to serve /metrics")
    finally:
        proc.terminate()
        proc.wait(10)
