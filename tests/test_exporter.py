"""The exporter's Busy page (``GET /leases``) and its last-scan gauge, against real Redis and real leases.

The exporter runs in this process (:class:`Exporter` on a free port) so each
test can watch its scans; one test runs the real ``dramatiq-leases exporter``
to check the command line reaches the page.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from dramatiq_leases.cli import build_parser, main
from dramatiq_leases.cli.commands import exporter_cli_options
from dramatiq_leases.core import Busy, Lease, Leases
from dramatiq_leases.core.keys import hash_tag
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.exporter import DEFAULT_TOP, Exporter, inspect_command

from .support.exporters import get, scrape, server_ms
from .support.stack import MakeLeases
from .support.waiting import wait_for

PREFIX = "t"
WEB = {"actor": "export_report", "queue": "reports", "host": "web-1", "pid": "4242", "message_id": "msg-1"}
WORK = {"actor": "send_invoice", "queue": "default", "host": "worker-2", "pid": "77", "message_id": "msg-2"}


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """Leases in database 1 under the prefix ``t``, as a fleet's would be beside its broker."""
    return make_leases(1, prefix=PREFIX)


@contextmanager
def running(
    leases: Leases, *, top: int = DEFAULT_TOP, cli_options: list[str] | None = None, interval: float = 0.05
) -> Iterator[Exporter]:
    """An exporter serving on a free port and scanning every ``interval`` seconds, stopped on exit."""
    exporter = Exporter(leases, host="127.0.0.1", port=0, top=top, cli_options=cli_options or [])
    stop = threading.Event()
    thread = threading.Thread(target=exporter.run, args=(stop, interval), daemon=True)
    thread.start()
    try:
        yield exporter
    finally:
        stop.set()
        thread.join(10)
        exporter.close()


def page(exporter: Exporter, query: str = "") -> dict[str, Any]:
    status, headers, body = get(exporter, "/leases" + query)
    assert status == 200, body
    assert headers["Content-Type"] == "application/json"
    doc: dict[str, Any] = json.loads(body)
    return doc


def page_when(
    exporter: Exporter, ready: Callable[[dict[str, Any]], bool], what: str, query: str = ""
) -> dict[str, Any]:
    """The first page that satisfies ``ready``."""

    def attempt() -> dict[str, Any] | None:
        doc = page(exporter, query)
        return doc if ready(doc) else None

    doc = wait_for(attempt, timeout=15, what=what)
    assert doc is not None  # for mypy: wait_for returns only a truthy value
    return doc


def names(exposition: bytes) -> set[str]:
    return {family.name for family in text_string_to_metric_families(exposition.decode())}


def acquire(leases: Leases, key: str, ttl: int = 60_000, **kwargs: Any) -> Lease:
    lease = leases.try_acquire(key, ttl, **kwargs)
    assert isinstance(lease, Lease), lease
    return lease


def wait_in_line(leases: Leases, key: str, waiters: int, first_ms: int, meta: dict[str, str]) -> None:
    """``waiters`` messages find ``key`` busy and take places in its line (first attempts from ``first_ms`` on)."""
    for n in range(waiters):
        reply = leases.line.join(key, 60_000, meta=meta, waiter=f"{key}-m{n}:0", first_ms=first_ms + n)
        assert isinstance(reply, Busy), reply


def cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


# --- the Busy page ------------------------------------------------------------------------------------------

OLD, OVERDUE, LEAKED, BRACED = "user:bob@example.com:export", "invoice:3", "invoice:1", "report:{7}"


def test_the_busy_page_lists_leases_worst_first_with_their_lines_and_the_hottest_keys(
    redis_server: EmbeddedRedis, leases: Leases
) -> None:
    # The oldest grant first, then an overdue heartbeat, then the leaked one: age must not outrank worry.
    old_fence = acquire(leases, OLD, meta=WEB).fence
    acquire(leases, OVERDUE, interval=100, meta=WORK)  # renewed by nobody: overdue after 2 x 100 + 500 ms
    acquire(leases, LEAKED, 1_000, meta=WORK)
    leases.client.persist(leases.lease_name(LEAKED))  # no TTL: leaked once its holder's deadline (~1 s) passes
    now = server_ms(leases)
    wait_in_line(leases, OLD, 2, now - 5_000, WEB)
    # A key between holders: its line waits while its head comes back; its lease key has braces (a digest).
    held = acquire(leases, BRACED, meta=WORK)
    wait_in_line(leases, BRACED, 3, now - 9_000, WORK)
    assert leases.release(held)
    assert leases.inspect(BRACED) is None and leases.inspect_line(BRACED).length == 3
    options = exporter_cli_options(redis_server.url(1), PREFIX)

    with running(leases, cli_options=options) as exporter:
        doc = page_when(
            exporter,
            lambda d: [r["state"] for r in d["leases"]][:2] == ["no_ttl", "heartbeat_overdue"],
            "the leak and the overdue heartbeat on the Busy page",
        )
        assert doc["scanned_at"] == pytest.approx(time.time(), abs=10)
        assert doc["scan_duration_seconds"] >= 0
        assert (doc["limit"], doc["leases_total"], doc["hot_keys_total"]) == (DEFAULT_TOP, 3, 2)

        leaked, overdue, old = doc["leases"]
        assert [leaked["key"], overdue["key"], old["key"]] == [LEAKED, OVERDUE, OLD]
        assert leaked["leaked"] is True and leaked["ttl_left_seconds"] is None
        assert overdue["leaked"] is False and overdue["heartbeat_age_seconds"] > 0.7
        assert old == {
            "key": OLD,
            "actor": "export_report",
            "queue": "reports",
            "message_id": "msg-1",
            "host": "web-1",
            "pid": 4242,
            "fence": old_fence,
            "state": "alive",
            "leaked": False,
            "age_seconds": old["age_seconds"],
            "heartbeat_age_seconds": old["heartbeat_age_seconds"],
            "ttl_left_seconds": old["ttl_left_seconds"],
            "line_length": 2,
            "inspect_command": f"dramatiq-leases --redis-url {redis_server.url(1)} --prefix {PREFIX} show '{OLD}'",
            "slot": 0,
            "holders": 1,
            "limit": 1,
        }
        assert old["age_seconds"] >= overdue["age_seconds"] >= leaked["age_seconds"] > 0
        assert 0 < old["ttl_left_seconds"] <= 60
        assert leaked["line_length"] == overdue["line_length"] == 0

        braced, hot_old = doc["hot_keys"]
        digest = hash_tag(BRACED)
        assert braced == {
            "key": digest,
            "line_length": 3,
            "oldest_wait_seconds": braced["oldest_wait_seconds"],
            "waiting_in_place": 0,
            "parked": braced["parked"],
            "promoted": braced["promoted"],
            "actor": "send_invoice",
            "held": False,
            "state": "free",
            "inspect_command": f"dramatiq-leases --redis-url {redis_server.url(1)} --prefix {PREFIX} show '{digest}'",
            "holders": 0,
            "limit": 1,
            "waiting_for": "holder",  # free between holders, under no rate (tests/test_exporter_rate.py: over one)
            "next_start_ms": None,
        }
        assert braced["parked"] + braced["promoted"] == 3
        assert braced["oldest_wait_seconds"] == pytest.approx(9, abs=5)
        assert (hot_old["key"], hot_old["line_length"], hot_old["held"], hot_old["state"]) == (OLD, 2, True, "alive")
        assert hot_old["oldest_wait_seconds"] == pytest.approx(5, abs=5)

        # Every command shown inspects its key: the lease and its line, or the free key's line.
        code, out = cli(shlex.split(old["inspect_command"])[1:])
        assert code == 0 and OLD in out and "export_report" in out
        code, out = cli(shlex.split(braced["inspect_command"])[1:])
        assert code == 0 and "no lease on" in out and "3" in out

        # ?limit= cuts both tables; it cannot raise them above --top.
        cut = page(exporter, "?limit=1")
        assert cut["limit"] == 1 and [r["key"] for r in cut["leases"]] == [LEAKED]
        assert [r["key"] for r in cut["hot_keys"]] == [digest]
        assert page(exporter, "?limit=0")["leases"] == []
        for bad in ("?limit=-1", "?limit=many"):
            status, headers, body = get(exporter, "/leases" + bad)
            assert status == 400 and "limit" in json.loads(body)["error"]

        # /metrics as prometheus_client's own server serves the same registry, gzip included, without lease keys.
        status, headers, body = get(exporter, "/metrics")
        reference, thread = start_http_server(0, addr="127.0.0.1", registry=exporter.registry)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{reference.server_address[1]}/metrics") as response:
                assert status == 200 and headers["Content-Type"] == response.headers["Content-Type"]
                assert names(body) == names(response.read())
        finally:
            reference.shutdown()
            reference.server_close()
            thread.join(5)
        assert b"dramatiq_lease_present" in body
        for key in (OLD, OVERDUE, LEAKED, digest, "report:"):
            assert key.encode() not in body
        status, headers, zipped = get(exporter, "/metrics", {"Accept-Encoding": "gzip"})
        assert headers["Content-Encoding"] == "gzip" and b"dramatiq_lease_present" in gzip.decompress(zipped)


def test_the_busy_page_never_holds_more_rows_than_top(leases: Leases) -> None:
    keys = [f"job:{n}" for n in range(7)]
    for key in keys:
        acquire(leases, key, meta=WORK)
        wait_in_line(leases, key, 1, server_ms(leases), WORK)
    acquire(leases, "late:1", 1_000, meta=WORK)
    leases.client.persist(leases.lease_name("late:1"))
    with running(leases, top=3) as exporter:
        doc = page_when(exporter, lambda d: d["leases"] and d["leases"][0]["state"] == "no_ttl", "the leak")
        assert (doc["limit"], doc["leases_total"], doc["hot_keys_total"]) == (3, 8, 7)
        assert len(doc["leases"]) == 3 and len(doc["hot_keys"]) == 3
        # The leak first though granted last; then the oldest grants.
        assert [r["key"] for r in doc["leases"]] == ["late:1", *keys[:2]]
        big = page(exporter, "?limit=1000")
        assert big["limit"] == 3 and len(big["leases"]) == 3 and len(big["hot_keys"]) == 3


def test_top_zero_turns_the_busy_page_off_but_not_the_metrics(leases: Leases) -> None:
    acquire(leases, OLD, meta=WEB)
    with running(leases, top=0) as exporter:
        status, _, body = get(exporter, "/leases")
        assert status == 404 and OLD.encode() not in body
        wait_for(
            lambda: (
                scrape(exporter).get(
                    ("dramatiq_lease_present", (("actor_name", "export_report"), ("queue_name", "reports")))
                )
                == 1
            ),
            what="the lease in /metrics",
        )


def test_the_page_is_served_from_the_last_scan_not_from_redis(leases: Leases) -> None:
    acquire(leases, OLD, meta=WEB)
    with running(leases, interval=3600) as exporter:  # one scan, then none for the test's length
        first = page_when(exporter, lambda d: d["leases_total"] == 1, "the first scan")
        acquire(leases, OVERDUE, meta=WORK)
        leases.client.delete(leases.lease_name(OLD))
        assert page(exporter) == first


def test_inspect_commands_quote_keys_and_keep_dashes_from_being_options() -> None:
    assert inspect_command("a b'c") == "dramatiq-leases show 'a b'\"'\"'c'"
    assert shlex.split(inspect_command("a b'c")) == ["dramatiq-leases", "show", "a b'c"]
    assert shlex.split(inspect_command("-x", ["--prefix", "my app"])) == [
        "dramatiq-leases",
        "--prefix",
        "my app",
        "show",
        "--",
        "-x",
    ]
    assert exporter_cli_options("redis://127.0.0.1:6379/0", "dramatiq-leases") == []
    assert exporter_cli_options("redis://:s3cret@cache:6379/2", "app") == [
        "--redis-url",
        "redis://:***@cache:6379/2",
        "--prefix",
        "app",
    ]
    assert build_parser().parse_args(["exporter"]).top == DEFAULT_TOP


# --- the last-scan gauge --------------------------------------------------------------------------------


def test_an_exporter_that_never_scans_still_serves_its_last_scan_time_and_counts_its_errors() -> None:
    unreachable = Leases.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.5)
    before = time.time()
    exporter = Exporter(unreachable, host="127.0.0.1", port=0)
    after = time.time()
    gauge = ("dramatiq_lease_exporter_last_scan_timestamp_seconds", ())
    errors = ("dramatiq_lease_redis_errors_total", (("operation", "scan"),))
    stop = threading.Event()
    thread = threading.Thread(target=exporter.run, args=(stop, 0.05), daemon=True)
    try:
        # Before any scan: the start time, so `time() - it > 120` fires if none ever completes.
        samples = scrape(exporter)
        assert before <= samples[gauge] <= after and samples[errors] == 0
        thread.start()
        samples = cast(  # wait_for returns only a truthy value: the samples, not False
            dict[tuple[str, tuple[tuple[str, str], ...]], float],
            wait_for(lambda: (s := scrape(exporter))[errors] >= 2 and s, timeout=30, what="failed scans to be counted"),
        )
        assert before <= samples[gauge] <= after
        doc = page(exporter)
        assert (doc["scanned_at"], doc["leases"], doc["hot_keys"]) == (None, [], [])
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(10)
        exporter.close()
        unreachable.client.close()


def test_the_last_scan_time_moves_on_with_each_completed_scan(leases: Leases) -> None:
    with running(leases) as exporter:
        gauge = ("dramatiq_lease_exporter_last_scan_timestamp_seconds", ())
        started = exporter.observer.started_at
        first = wait_for(lambda: (v := scrape(exporter)[gauge]) > started and v, what="a completed scan")
        wait_for(lambda: scrape(exporter)[gauge] > first, what="the next scan")


# --- the command line ---------------------------------------------------------------------------------


def test_the_exporter_command_serves_the_busy_page_with_its_options(
    redis_server: EmbeddedRedis, leases: Leases
) -> None:
    # Granted in key order too, so a grant within the same millisecond sorts the same way.
    acquire(leases, OVERDUE, meta=WORK)
    acquire(leases, OLD, meta=WEB)
    port = free_port()
    script = str(Path(sys.executable).with_name("dramatiq-leases"))
    proc = subprocess.Popen(
        [
            script,
            "--redis-url",
            redis_server.url(1),
            "--prefix",
            PREFIX,
            "exporter",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--interval",
            "0.1",
            "--top",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        def scanned() -> dict[str, Any] | None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/leases?limit=5", timeout=1) as response:
                    doc: dict[str, Any] = json.loads(response.read())
            except OSError:
                return None
            return doc if doc["leases_total"] == 2 else None

        doc = wait_for(scanned, timeout=20, what="the exporter's Busy page")
        assert doc is not None  # for mypy: wait_for returns only a truthy value
        assert doc["limit"] == 1 and [r["key"] for r in doc["leases"]] == [OVERDUE]
        assert doc["leases"][0]["inspect_command"] == (
            f"dramatiq-leases --redis-url {redis_server.url(1)} --prefix {PREFIX} show '{OVERDUE}'"
        )
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


# --- what the alerts read -------------------------------------------------------------------------------------


def test_messages_waiting_on_a_leaked_key_are_counted_for_that_leak_alone(leases: Leases) -> None:
    """The leak page is for users waiting on the leaked key itself, not on other keys of its actor."""
    acquire(leases, LEAKED, 1_000, meta=WORK)
    leases.client.persist(leases.lease_name(LEAKED))  # leaked (no_ttl) once its holder's deadline passes
    now = server_ms(leases)
    wait_in_line(leases, LEAKED, 2, now, WORK)
    acquire(leases, "invoice:9", meta=WORK)  # a healthy key of the same actor, with its own line
    wait_in_line(leases, "invoice:9", 3, now, WORK)
    labels = (("actor_name", WORK["actor"]), ("queue_name", WORK["queue"]), ("reason", "no_ttl"))
    with running(leases) as exporter:
        samples = wait_for(
            lambda: (s := scrape(exporter)).get(("dramatiq_lease_leaked", labels)) and s,
            what="the leak in the exporter's metrics",
        )
        assert isinstance(samples, dict)  # for mypy: wait_for returns only a truthy value, here the samples
        assert samples[("dramatiq_lease_leaked_waiting", labels)] == 2
        assert samples[("dramatiq_lease_waiting", (("actor_name", WORK["actor"]),))] == 5


def test_a_stale_scan_stops_serving_the_lease_gauges(leases: Leases) -> None:
    """A stuck exporter must not keep a resolved leak paging: its lease figures go stale instead."""
    acquire(leases, LEAKED, 1_000, meta=WORK)
    leases.client.persist(leases.lease_name(LEAKED))
    exporter = Exporter(leases, host="127.0.0.1", port=0, interval=0.05)
    try:
        exporter.observer.stale_after = 0.5
        wait_for(lambda: exporter.observer.scan().leaked, what="a scan that sees the leak")
        assert any(name == "dramatiq_lease_leaked" for name, _ in scrape(exporter))

        # No more scans (Redis gone, a hung scan): once the last one is too old, only the exporter's own
        # figures remain, and the last-scan gauge says how old it is.
        def without_leases() -> dict[Any, float] | None:
            samples = scrape(exporter)
            return None if any(name == "dramatiq_lease_leaked" for name, _ in samples) else samples

        stale = wait_for(without_leases, what="the lease gauges to go")
        assert stale is not None  # for mypy: wait_for returns only a truthy value
        assert ("dramatiq_lease_exporter_last_scan_timestamp_seconds", ()) in stale
        assert not any(name in {"dramatiq_lease_present", "dramatiq_lease_leaked_waiting"} for name, _ in stale)
    finally:
        exporter.close()


# --- expiries, with fence counters that expire ---------------------------------------------------------------

EXPIRED = ("dramatiq_lease_expired_total", (("actor_name", WORK["actor"]), ("queue_name", WORK["queue"])))
UNKNOWN = ("dramatiq_lease_ended_unknown_total", (("actor_name", WORK["actor"]), ("queue_name", WORK["queue"])))


def test_a_fence_retention_shorter_than_the_scan_interval_counts_no_release_as_an_expiry(
    redis_server: EmbeddedRedis,
) -> None:
    """Counters kept 300 ms, scans 2 s apart: a released lease's counter is gone when the next scan looks for it.
    That grant's end is unknown, not an expiry (the safety SLO reads dramatiq_lease_expired_total); a grant that
    does end by TTL on a key whose counter is still there is still counted."""
    retention_ms = 300
    short = Leases.from_url(redis_server.url(1), prefix=PREFIX, fence_retention=retention_ms)
    kept = Leases.from_url(redis_server.url(1), prefix=PREFIX)  # no retention: counters kept for ever
    exporter = Exporter(short, host="127.0.0.1", port=0, interval=2.0)
    try:
        released = acquire(short, "invoice:released", meta=WORK)
        acquire(kept, "invoice:expires", 1_000, meta=WORK)
        exporter.observer.scan()  # sees both grants
        assert short.release(released)
        # The scan interval outlasts the retention: by the next scan the released grant's counter is gone.
        wait_for(
            lambda: not short.client.exists(short.fence_name("invoice:released")),
            timeout=5,
            what="the fence counter to expire",
        )
        wait_for(lambda: kept.inspect("invoice:expires") is None, timeout=5, what="the short lease to expire")
        exporter.observer.scan()
        samples = scrape(exporter)
        assert samples[EXPIRED] == 1, "a release was counted as an expiry, or the expiry was missed"
        assert samples[UNKNOWN] == 1
    finally:
        exporter.close()
        short.client.close()
        kept.client.close()


@pytest.mark.parametrize(
    ("state", "ending"),
    [
        ({}, "unknown"),  # the counter is gone
        ({"released": 7}, "released"),  # gone during the hold, made again by the release
        ({"fence": 7, "released": 7}, "released"),
        ({"fence": 7}, "expired"),  # never released, nothing granted since
        ({"fence": 7, "released": 5}, "expired"),
        ({"fence": 9, "released": 5, "expired": 8}, "expired"),  # the next grant's record was overwritten since
        ({"fence": 8, "expired": 7}, "expired"),
        ({"fence": 9, "released": 8, "expired": 5}, "released"),  # released since, no expiry since
        ({"fence": 9, "released": 9, "expired": 8}, "unknown"),  # an expiry since, then a release: cannot tell
        ({"fence": 1_767_225_600_000_000}, "unknown"),  # made again by a later grant (a retention)
        ({"fence": 1_767_225_600_000_000, "expired": 1_767_225_500_000_000}, "unknown"),
    ],
)
def test_how_a_grant_ended_is_told_from_its_fence_counter_or_said_unknown(state: dict[str, int], ending: str) -> None:
    from dramatiq_leases.exporter.observer import grant_ending

    assert grant_ending(7, state).value == ending


# --- keys of the wrong type ----------------------------------------------------------------------------------


def test_keys_of_the_wrong_type_are_counted_and_told_once_and_hide_nothing_else(
    leases: Leases, caplog: pytest.LogCaptureFixture
) -> None:
    """A string at a line's name, a list at a lease's, a string at an ended grant's fence counter, and a waiter's
    wake list that the lines' SCAN pattern matches (its waiter id ends with ``}``): the scan goes on past each;
    the leak beside them is reported, and each bad key is counted by kind and logged once."""
    caplog.set_level(logging.WARNING, logger="dramatiq_leases.exporter.observer")
    acquire(leases, LEAKED, 1_000, meta=WORK)
    leases.client.persist(leases.lease_name(LEAKED))  # leaked (no_ttl) once its holder's deadline passes
    wait_in_line(leases, LEAKED, 2, server_ms(leases), WORK)
    leases.line.wake(LEAKED, "crafted}")  # a wake list: {prefix}:line:{invoice:1}:w:crafted}
    wake_list = f"{PREFIX}:line:{{{LEAKED}}}:w:crafted}}"
    assert leases.client.type(wake_list) == b"list"
    broken_line = f"{PREFIX}:line:{{broken}}"
    leases.client.set(broken_line, "hand-written")
    broken_lease = leases.lease_name("stray")
    leases.client.rpush(broken_lease, "x")
    ending = acquire(leases, "invoice:ends", meta=WORK)
    exporter = Exporter(leases, host="127.0.0.1", port=0)
    try:
        exporter.observer.scan()
        # That grant ends (its lease key goes), and someone wrote a string where its fence counter was.
        leases.client.delete(leases.lease_name(ending.key), leases.fence_name(ending.key))
        leases.client.set(leases.fence_name(ending.key), "not a counter")

        def leak_reported() -> dict[Any, float] | None:
            exporter.observer.scan()
            samples = scrape(exporter)
            return samples if samples.get(("dramatiq_lease_leaked", LEAK)) == 1 else None

        samples = wait_for(leak_reported, what="the leak reported beside the bad keys")
        assert samples is not None  # for mypy: wait_for returns only a truthy value
        assert samples[("dramatiq_lease_leaked_waiting", LEAK)] == 2
        assert samples[("dramatiq_lease_waiting", (("actor_name", WORK["actor"]),))] == 2
        unreadable = {
            dict(labels)["kind"]: value
            for (name, labels), value in samples.items()
            if name == "dramatiq_lease_exporter_unreadable_keys"
        }
        assert unreadable == {"lease": 1, "line": 1, "waiters": 0, "fence": 0}  # the fence: read once, when it ended
        assert samples[EXPIRED] == 0 and samples[UNKNOWN] == 1  # a counter that is not one says nothing
        assert samples[("dramatiq_lease_exporter_unreachable_nodes", ())] == 0
        doc = page(exporter)
        assert doc["unreadable_keys"] == unreadable and doc["unreachable_nodes"] == []
        # The list at a lease's name blocks that key as a lease would: shown as one, leaked (no TTL) like the leak.
        assert {row["key"] for row in doc["leases"][:2]} == {LEAKED, "t:lease:{stray}"}
        assert {row["state"] for row in doc["leases"][:2]} == {"no_ttl"}
        exporter.observer.scan()
        told = [r.getMessage() for r in caplog.records if "no dramatiq-leases code wrote it" in r.getMessage()]
        assert len(told) == 3, told  # each bad key once, however many scans
        assert {
            bad
            for bad in (broken_line, broken_lease, leases.fence_name(ending.key))
            if any(bad in message for message in told)
        } == {broken_line, broken_lease, leases.fence_name(ending.key)}
        assert not any(wake_list in message for message in told)
    finally:
        exporter.close()


LEAK = (("actor_name", WORK["actor"]), ("queue_name", WORK["queue"]), ("reason", "no_ttl"))
