"""Prefixes: those the read side (``list``, ``show``, the exporter) would misread are refused at construction;
every prefix accepted is read literally. Real Redis, real scripts."""

from __future__ import annotations

import pytest
import redis

from dramatiq_leases.cli import main
from dramatiq_leases.core import Busy, Lease, Leases
from dramatiq_leases.core.errors import LeaseConfigError
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.exporter.observer import LeaseObserver

META = {"actor": "send_invoice", "queue": "default", "message_id": "msg-1", "host": "web-7", "pid": "4242"}


def hold_with_a_line(leases: Leases, key: str) -> None:
    """``key`` held, with one waiter parked in its line."""
    assert isinstance(leases.try_acquire(key, 60_000, meta=META), Lease)
    reply = leases.line.join(key, 60_000, meta=META, waiter="m1:0", first_ms=1, ready=0)
    assert isinstance(reply, Busy), reply


@pytest.mark.parametrize(
    "prefix",
    [
        "a\\b",  # SCAN's glob escape: `list` and the exporter matched "ab:lease:*" and saw nothing
        "app\\",
    ],
)
def test_a_backslash_in_the_prefix_is_refused_naming_the_value_and_why(prefix: str) -> None:
    with pytest.raises(LeaseConfigError, match="backslash escapes the next character in the SCAN") as e:
        Leases(redis.Redis(), prefix=prefix)
    assert repr(prefix) in str(e.value)


@pytest.mark.parametrize(
    ("prefix", "kind"),
    [
        ("app:line:x", "line"),  # the line's inspection read "app:waiters:x:line:{k}"
        ("app:line", "line"),  # likewise: its first ":line:" is the prefix's own
        ("app:lease", "lease"),  # prefix "app" scanning "app:lease:*" took these keys for its own
        ("app:lease:eu", "lease"),
        ("a:fence:b", "fence"),
        ("a:waiters", "waiters"),
        ("a:done:", "done"),
    ],
)
def test_a_prefix_holding_a_kind_of_key_is_refused_naming_the_value_and_why(prefix: str, kind: str) -> None:
    with pytest.raises(LeaseConfigError, match=f"must not contain ':{kind}:' nor end with ':{kind}'") as e:
        Leases(redis.Redis(), prefix=prefix)
    assert repr(prefix) in str(e.value)


@pytest.mark.parametrize("prefix", ["a\\b", "app:line:x"])
def test_the_cli_refuses_such_a_prefix_as_a_usage_error(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, prefix: str
) -> None:
    code = main(["--redis-url", redis_server.url(), "--prefix", prefix, "list"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("dramatiq-leases: prefix must") and repr(prefix) in err


@pytest.mark.parametrize(
    "prefix",
    [
        "line",  # a first segment is never mistaken for a kind: every derived name has ":" before its kind
        "lease:app",
        "app:leases",
        "app:lines-eu",
        "a^b-c",  # special to a glob only inside brackets, which are refused
        "a.b!c%d",
        "tenant 7",
        "été:東京",
        "app:",
    ],
)
def test_every_accepted_prefix_is_read_literally_by_list_show_and_the_exporter(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, redis_client: redis.Redis, prefix: str
) -> None:
    leases = Leases(redis_client, prefix=prefix)
    hold_with_a_line(leases, "invoice:1")
    hold_with_a_line(leases, "report:{7}")  # braces: stored under a digest tag
    assert isinstance(leases.try_acquire("invoice:2", 60_000, meta=META), Lease)  # no line
    # A neighbour whose names start with this prefix: never taken for ours.
    hold_with_a_line(Leases(redis_client, prefix=prefix + "x"), "invoice:1")
    hold_with_a_line(Leases(redis_client, prefix=prefix + ":x"), "invoice:1")

    assert sorted(i.key for i in leases.scan()) == ["invoice:1", "invoice:2", "report:{7}"]
    assert sorted(i.key for i in leases.scan("invoice:*")) == ["invoice:1", "invoice:2"]
    assert [i.key for i in leases.scan("report:*")] == ["report:{7}"]
    assert leases.inspect_line("invoice:1").states == {"parked": 1}
    assert leases.inspect_line("report:{7}").actors == {"send_invoice": 1}
    lines = list(leases.scan_lines())
    assert len(lines) == 2 and all(line.states == {"parked": 1} for line in lines)

    observer = LeaseObserver(leases)
    snap = observer.scan()
    assert sum(snap.present.values()) == 3
    assert snap.waiting == {"send_invoice": 2}
    assert sorted(row["key"] for row in snap.page.leases) == ["invoice:1", "invoice:2", "report:{7}"]
    assert sorted((row["key"], row["line_length"]) for row in snap.page.hot_keys) == [
        ("invoice:1", 1),
        ("report:{7}", 1),
    ]

    assert main(["--redis-url", redis_server.url(), "--prefix", prefix, "list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in rows[1:4]] == ["invoice:1", "invoice:2", "report:{7}"]
    assert main(["--redis-url", redis_server.url(), "--prefix", prefix, "show", "invoice:1"]) == 0
    assert "1 waiting (1 parked)" in capsys.readouterr().out
