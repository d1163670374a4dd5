"""The CLI's human output never carries a raw control character from Redis: keys and holder metadata are
whatever anyone wrote there, and a key holding ``ESC[1A ESC[2K`` must not erase the row above it and forge
another on the operator's screen. Real Redis; the command runs as a subprocess, its output read as bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import redis

from dramatiq_leases.cli.render import printable
from dramatiq_leases.core import Busy, Lease, Leases, State
from dramatiq_leases.embedded import EmbeddedRedis

from .support.waiting import wait_for

#: Cursor up one line, erase that line: the forgery of the review.
ERASE = "\x1b[1A\x1b[2K"
#: One of each kind a terminal acts on or hides: C0 (BEL, CR, tab, newline), DEL, C1 (CSI), a bidi
#: override, a line separator, a zero-width space.
CONTROLS = "\x07\r\t\n\x7f\x9b\u202e\u2028\u200b"
#: The key of the review, forging a healthy row in place of the leaked one above it.
FORGED = f"invoice:2{ERASE}invoice:1  send_invoice  alive"
HOSTILE = f"k{CONTROLS}"
META = {
    "actor": f"send\x1b[31m_invoice{CONTROLS}",
    "queue": "default",
    "message_id": "msg\u202e1-\x00",
    "host": f"web{ERASE}7\n",
    "pid": "42\x9b",
    f"note\x1b[2J{CONTROLS}": "x\x1b]0;title\x07",  # a metadata field named by its writer
}


def run(server: EmbeddedRedis, *argv: str) -> tuple[int, bytes, bytes]:
    proc = subprocess.run(
        [sys.executable, "-m", "dramatiq_leases.cli", "--redis-url", server.url(), *argv],
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr


def assert_clean(output: bytes) -> str:
    """``output`` is UTF-8 whose only non-printable character is the newline ending each line; returned decoded."""
    text = output.decode("utf-8")  # strict: a lone surrogate written raw would not even encode
    for byte in (
        b"\x1b",
        b"\x07",
        b"\r",
        b"\t",
        b"\x7f",
        b"\x00",
        "\x9b".encode(),
        "\u202e".encode(),
        "\u2028".encode(),
        "\u200b".encode(),
    ):
        assert byte not in output, (byte, text)
    assert all(c == "\n" or c.isprintable() for c in text), text
    return text


def acquire(leases: Leases, key: str, ttl: int = 60_000, **kwargs: object) -> Lease:
    lease = leases.try_acquire(key, ttl, interval=10_000, meta=META, **kwargs)  # type: ignore[arg-type]
    assert isinstance(lease, Lease), lease
    return lease


def test_printable_escapes_what_a_terminal_acts_on_and_keeps_the_rest() -> None:
    assert printable("invoice:42 é 東京 a\\b") == "invoice:42 é 東京 a\\b"
    assert printable(ERASE) == "\\x1b[1A\\x1b[2K"
    assert printable(CONTROLS) == "\\x07\\x0d\\x09\\x0a\\x7f\\x9b\\u202e\\u2028\\u200b"
    assert printable("\U000e0001\ud800") == "\\U000e0001\\ud800"
    assert printable(printable(FORGED)) == printable(FORGED)


def test_list_shows_a_forging_key_and_hostile_metadata_escaped(
    redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    acquire(leases, "invoice:1")
    acquire(leases, FORGED)
    acquire(leases, HOSTILE)
    redis_client.set(f"{leases.prefix}:lease:junk{ERASE}{CONTROLS}", "x")  # debris with a hostile name
    code, out, err = run(redis_server, "list")
    assert (code, err) == (0, b"")
    text = assert_clean(out)
    rows = text.splitlines()
    assert [row.split()[0] for row in rows[1:5]] == [
        f"{leases.prefix}:lease:junk\\x1b[1A\\x1b[2K\\x07\\x0d\\x09\\x0a\\x7f\\x9b\\u202e\\u2028\\u200b",
        "invoice:1",
        "invoice:2\\x1b[1A\\x1b[2Kinvoice:1",
        "k\\x07\\x0d\\x09\\x0a\\x7f\\x9b\\u202e\\u2028\\u200b",
    ]
    assert "send\\x1b[31m_invoice" in rows[2] and "msg\\u202e1-\\x00" in rows[2]
    assert "web\\x1b[1A\\x1b[2K7\\x0a:42\\x9b" in rows[2]
    assert f"note: {leases.prefix}:lease:junk\\x1b[1A" in text
    # --json keeps every value as written, escaped by JSON itself (ASCII only).
    code, out, _ = run(redis_server, "list", "--json")
    assert code == 0 and out.isascii()
    by_key = {row["key"]: row for row in json.loads(out) if "holder" in row}
    assert set(by_key) == {"invoice:1", FORGED, HOSTILE}
    assert {name: by_key[FORGED][name] for name in META} == META
    assert by_key[FORGED]["holder"] == f"{META['host']}:{META['pid']}"


def test_show_escapes_the_key_the_metadata_and_the_line(redis_server: EmbeddedRedis, leases: Leases) -> None:
    lease = acquire(leases, HOSTILE)
    waiter = f"w{ERASE}{CONTROLS}:0"
    assert isinstance(leases.line.join(HOSTILE, 60_000, meta=META, waiter=waiter, first_ms=1, ready=0), Busy)
    code, out, err = run(redis_server, "show", HOSTILE)
    assert (code, err) == (0, b"")
    text = assert_clean(out)
    assert "k\\x07\\x0d\\x09\\x0a\\x7f\\x9b\\u202e\\u2028\\u200b" in text
    assert "note\\x1b[2J" in text and "x\\x1b]0;title\\x07" in text
    assert "head w\\x1b[1A\\x1b[2K" in text
    code, out, _ = run(redis_server, "show", HOSTILE, "--json")
    assert code == 0 and out.isascii()
    doc = json.loads(out)
    assert (doc["key"], {name: doc[name] for name in META}, doc["line"]["head"]) == (HOSTILE, META, waiter)
    # Free for a moment, its line's head on its way: the short form.
    assert leases.release(lease)
    code, out, err = run(redis_server, "show", HOSTILE)
    assert (code, err) == (0, b"")
    assert "right now; line: 1 waiting" in assert_clean(out)


def test_release_messages_escape_the_holder_on_stdout_and_stderr(
    redis_server: EmbeddedRedis, leases: Leases, redis_client: redis.Redis
) -> None:
    acquire(leases, HOSTILE)
    code, out, err = run(redis_server, "release", HOSTILE, "--owner", "not-the-token")
    assert (code, out) == (1, b"")
    assert "web\\x1b[1A\\x1b[2K7" in assert_clean(err)
    code, out, err = run(redis_server, "release", HOSTILE, "--if-dead")
    assert (code, out) == (1, b"")
    assert "refused: the holder of" in assert_clean(err)
    # Leaked: its holder's deadline (0.9 s after the grant) passed, its TTL extended by hand.
    acquire(leases, FORGED, ttl=1_000)
    redis_client.pexpire(leases.lease_name(FORGED), 60_000)
    wait_for(
        lambda: (i := leases.inspect(FORGED)) is not None and i.state is State.HOLDER_DEAD,
        timeout=5,
        what="the holder's deadline to pass",
    )
    code, out, err = run(redis_server, "release", FORGED, "--if-dead")
    assert (code, err) == (0, b"")
    assert "held by web\\x1b[1A\\x1b[2K7\\x0a:42\\x9b" in assert_clean(out)


def test_a_key_that_is_not_utf8_is_listed_escaped_not_a_crash(
    redis_server: EmbeddedRedis, redis_client: redis.Redis
) -> None:
    """A lease key written by hand in bytes that are not UTF-8: ``list`` lists the rest and names it, escaped,
    as a key it could not read (exit 6, partial), instead of crashing or hiding it."""
    leases = Leases(redis_client)
    assert isinstance(leases.try_acquire("invoice:1", 60_000, meta={"actor": "send_invoice"}), Lease)
    redis_client.hset(b"dramatiq-leases:lease:\xff\xfeinvoice", mapping={b"token": b"t", b"actor": b"\xc3("})
    code, out, err = run(redis_server, "list")
    assert code == 6, err
    assert "invoice:1" in assert_clean(out)
    said = assert_clean(err)
    assert "\\xff\\xfeinvoice" in said and "its name is not UTF-8" in said, said


def test_show_of_a_key_several_hold_escapes_each_holder(redis_server: EmbeddedRedis, leases: Leases) -> None:
    for _ in range(2):
        acquire(leases, HOSTILE, limit=2)
    code, out, err = run(redis_server, "show", HOSTILE)
    assert (code, err) == (0, b"")
    text = assert_clean(out)
    assert text.count("web\\x1b[1A\\x1b[2K7\\x0a") == 2, "each holder's host, escaped"
    assert "holders        2 of 2 (slots 0, 1)" in text
    code, out, err = run(redis_server, "list")
    assert (code, err) == (0, b"")
    assert assert_clean(out).count("2/2") == 2
