"""The Busy page (``GET /busy``) as an operator sees it: in a real browser, over a running system's leases.

An exporter runs in this process against a private redis-server, scanning every
0.2 s; a heartbeat renews one lease, a line waits on it, and a lease whose holder
is gone (no TTL, past its deadline) is leaked. Headless chromium opens the page:
the leak comes first, the holders, lines and ``show`` commands are there, new
leases appear without a reload, a hostile key is shown as text, and a refresh
that fails says so and recovers by itself.

The screenshot the README shows (docs/images/busy-page.png) is written by the
test under ``make screenshots`` only, and only when what it shows changed (the
page's source or its text, numbers aside: ages and clocks differ at every run),
which a digest kept in the PNG itself tells; any other run warns of a picture
that no longer shows the page, and writes nothing tracked.
"""

from __future__ import annotations

import base64
import hashlib
import html.parser
import json
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from dramatiq_leases.core import Busy, Lease, Leases
from dramatiq_leases.core.heartbeat import Heartbeat
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.exporter import Exporter, page
from dramatiq_leases.exporter.page import BUSY_PAGE, BUSY_PAGE_PATH

from .support.browser import chromium, content_digest, publish, screenshot, until
from .support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
README_IMAGE = ROOT / "docs" / "images" / "busy-page.png"

# Holders as the middleware records them (fixed, so the README's picture shows no host of this machine).
EXPORTS = {"actor": "export_report", "queue": "exports", "host": "worker-1", "pid": "4242"}
INVOICES = {"actor": "send_invoice", "queue": "default", "host": "worker-2", "pid": "77"}
OLD, RUNNING, LEAKED = "invoice:7", "export:report:42", "invoice:1"
HOSTILE = "<img src=x onerror=window.pwned=1>"
LATE = "export:report:43"


@pytest.fixture
def leases(redis_server: EmbeddedRedis) -> Iterator[Leases]:
    store = Leases.from_url(redis_server.url(1), history=20)
    yield store
    store.client.close()


@contextmanager
def exporting(leases: Leases, port: int = 0, **options: Any) -> Iterator[Exporter]:
    """An exporter on 127.0.0.1 (``port`` 0: a free one) scanning every 0.2 s, stopped on exit."""
    exporter = Exporter(leases, host="127.0.0.1", port=port, interval=0.2, **options)
    stop = threading.Event()
    thread = threading.Thread(target=exporter.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield exporter
    finally:
        stop.set()
        thread.join(10)
        exporter.close()


def request(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of a request to the exporter (errors included)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def acquire(leases: Leases, key: str, ttl: int, meta: dict[str, str], message_id: str, **kwargs: Any) -> Lease:
    lease = leases.try_acquire(key, ttl, meta={**meta, "message_id": message_id}, **kwargs)
    assert isinstance(lease, Lease), lease
    return lease


def wait_in_line(leases: Leases, key: str, waiters: int, meta: dict[str, str]) -> None:
    for n in range(waiters):
        reply = leases.line.join(key, 60_000, meta=meta, waiter=f"{key}-m{n}:0")
        assert isinstance(reply, Busy), reply


def rows(driver: Any, table: str) -> list[dict[str, Any]]:
    """Each row of a table of the page: its key, class and the text of each cell."""
    found: list[dict[str, Any]] = driver.execute_script(
        """return Array.from(document.querySelectorAll('#' + arguments[0] + ' tbody tr')).map(tr => ({
             key: tr.dataset.key, cls: tr.className,
             cells: Array.from(tr.cells).map(td => td.innerText.trim()),
             command: (tr.querySelector('code.show-command') || {}).textContent || null,
             copy: !!tr.querySelector('button.copy'),
             history: (tr.querySelector('a.history') || {}).href || null}))""",
        table,
    )
    return found


# --- the README's picture --------------------------------------------------------------------------------


def save_readme_image(shot: Path, digest: str) -> None:
    """Copy the screenshot to docs/images/busy-page.png (``make screenshots``) unless it shows the same content."""
    publish(shot, README_IMAGE, digest)


# --- the page in a browser ---------------------------------------------------------------------------------


@pytest.mark.system  # a real browser, as the Prometheus binaries' tests are
def test_the_busy_page_shows_a_running_systems_leases_worst_first_and_keeps_itself_current(
    leases: Leases,
) -> None:
    with ExitStack() as stack:
        # The oldest grant, a handed-over lease nobody renews (alive until its TTL).
        acquire(leases, OLD, 120_000, INVOICES, "7f3e9a10-0c41-4c8e-9d52-2b1f6f0e1a07")
        # Older by the server's clock, not only by the order of the calls: grants in one millisecond tie.
        old_ms = leases.inspect(OLD).acquired_ms  # type: ignore[union-attr]
        wait_for(lambda: leases.inspect(OLD).now_ms > old_ms, what="the server's clock past the oldest grant")  # type: ignore[union-attr]
        # A running job: renewed by a heartbeat every second, with two messages of its key waiting in its line.
        heartbeat = Heartbeat(leases)
        heartbeat.start()
        stack.callback(heartbeat.stop)
        stack.enter_context(
            leases.lease(
                RUNNING, 4_000, heartbeat=heartbeat, interval=1_000, meta={**EXPORTS, "message_id": "c0ffee00-42"}
            )
        )
        wait_in_line(leases, RUNNING, 2, EXPORTS)
        # Granted last, its holder gone without a trace: no TTL, so leaked once its deadline (1 s) passes.
        acquire(leases, LEAKED, 1_000, INVOICES, "5f0c2d88-1b7a-4f11-a3c4-96de0b7c3e55")
        leases.client.persist(leases.lease_name(LEAKED))
        wait_in_line(leases, LEAKED, 1, INVOICES)

        exporter = stack.enter_context(exporting(leases))
        port = exporter.port
        driver = stack.enter_context(chromium(width=1280, height=800))
        driver.get(f"http://127.0.0.1:{port}{BUSY_PAGE_PATH}?refresh=1")

        def leak_first(d: Any) -> list[dict[str, Any]]:
            found = rows(d, "leases")
            # (A heartbeat held up on this loaded machine would make the running lease overdue for a while.)
            return found if len(found) == 3 and [r["cls"] for r in found] == ["leaked", "alive", "alive"] else []

        leased = until(driver, leak_first, timeout=15, what="three leases, the leak first, the others alive")
        assert [row["key"] for row in leased] == [LEAKED, OLD, RUNNING], leased
        leak, old, running = leased
        assert leak["cells"][0] == "leaked: no_ttl" and leak["cells"][6] == "no TTL"
        assert (old["cells"][0], running["cells"][0]) == ("alive", "alive")
        # The holder: actor, queue, host:pid and message; how many hold the key of how many may; its line.
        assert running["cells"][2].splitlines() == ["export_report on exports", "worker-1:4242", "message c0ffee00-42"]
        assert (running["cells"][7], running["cells"][8]) == ("1 / 1", "2")
        assert (leak["cells"][7], leak["cells"][8], old["cells"][8]) == ("1 / 1", "1", "0")
        assert leak["command"] == f"dramatiq-leases show '{LEAKED}'" and leak["copy"]
        assert all(row["command"] and row["copy"] for row in leased)
        # Each key's history, where the JSON says it is.
        assert leak["history"] == f"http://127.0.0.1:{port}/leases/history?key={urllib.parse.quote(LEAKED, safe='')}"
        status, _, body = request(port, urllib.parse.urlsplit(leak["history"]).path + "?key=" + LEAKED)
        assert status == 200 and [e["event"] for e in json.loads(body)["events"]] == ["granted"]
        hot = rows(driver, "hot-keys")
        assert [(row["key"], row["cells"][1]) for row in hot] == [(RUNNING, "2"), (LEAKED, "1")]
        assert hot[1]["cells"][5] == "leaked: no_ttl" and hot[0]["command"] == f"dramatiq-leases show '{RUNNING}'"
        assert [row["cells"][6] for row in hot] == ["waiting for a holder"] * 2  # no rate holds either line back
        status_line = driver.find_element("id", "status").text
        assert re.fullmatch(r"Updated \d\d:\d\d:\d\d · scanned .+ ago · refreshes every 1 s", status_line), status_line
        assert not driver.find_element("id", "error").is_displayed()

        # The whole page in the picture: the window as tall as its content.
        driver.set_window_size(
            1280, driver.execute_script("return document.body.scrollHeight + window.outerHeight - window.innerHeight")
        )
        shot = screenshot(driver, "busy-page")
        save_readme_image(shot, content_digest(driver, BUSY_PAGE))

        # The copy button puts the command on the clipboard: on a page that does not re-render its rows (and the
        # button) while the test looks for "Copied", as every second here would on a loaded machine.
        driver.get(f"http://127.0.0.1:{port}{BUSY_PAGE_PATH}?refresh=300")
        until(driver, lambda d: len(rows(d, "leases")) == 3, what="the three leases again")
        driver.execute_cdp_cmd(
            "Browser.grantPermissions",
            {"origin": f"http://127.0.0.1:{port}", "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
        )
        driver.find_elements("css selector", "#leases button.copy")[0].click()
        until(
            driver, lambda d: d.find_elements("css selector", "#leases button.copy")[0].text == "Copied", what="Copied"
        )
        pasted = driver.execute_async_script(
            "navigator.clipboard.readText().then(arguments[0], e => arguments[0]('' + e))"
        )
        assert pasted == f"dramatiq-leases show '{LEAKED}'"
        driver.get(f"http://127.0.0.1:{port}{BUSY_PAGE_PATH}?refresh=1")
        until(driver, lambda d: len(rows(d, "leases")) == 3, what="the three leases, refreshed every second")

        # New leases appear by themselves (no reload: the marker set in this document stays), the hostile one
        # as text: no element is made of it, no script of it runs.
        driver.execute_script("window.sameDocument = true")
        acquire(leases, HOSTILE, 60_000, EXPORTS, "m-hostile")
        acquire(leases, LATE, 60_000, EXPORTS, "m-late")
        leased = until(driver, lambda d: found if len(found := rows(d, "leases")) == 5 else [], what="the new leases")
        assert driver.execute_script("return window.sameDocument === true"), "the page was reloaded"
        hostile = next(row for row in leased if row["key"] == HOSTILE)
        assert hostile["cells"][1].splitlines()[0] == HOSTILE
        assert hostile["command"] == f"dramatiq-leases show '{HOSTILE}'"
        assert driver.execute_script("return document.images.length") == 0
        assert driver.execute_script("return window.pwned") is None
        assert [row["key"] for row in leased][:1] == [LEAKED], "the leak stays first"

        # While the reader selects text in the rows, they stay as they are (a refresh would drop the selection).
        driver.execute_script("getSelection().selectAllChildren(document.querySelector('#leases tbody td.key code'))")
        acquire(leases, "export:report:44", 60_000, EXPORTS, "m-44")
        wait_for(lambda: json.loads(request(port, "/leases")[2])["leases_total"] == 6, what="a scan that saw it")

        def refreshed_since(before: str) -> Callable[[Any], bool]:
            return lambda d: bool(d.find_element("id", "status").text != before)

        for _ in range(2):  # two refreshes since: the page has read the sixth lease, and keeps it waiting
            until(driver, refreshed_since(driver.find_element("id", "status").text), what="a refresh")
        assert "the rows wait while you select text" in driver.find_element("id", "status").text
        assert len(rows(driver, "leases")) == 5
        driver.execute_script("getSelection().removeAllRanges()")
        until(driver, lambda d: len(rows(d, "leases")) == 6, what="the rows once the selection is gone")

        # A refresh that fails says so, keeps the rows, and the page recovers by itself when the exporter is back.
        exporter.close()
        until(driver, lambda d: d.find_element("id", "error").is_displayed(), what="the error banner")
        banner = driver.find_element("id", "error").text
        assert banner.startswith("Refresh failed at ") and "Showing what was read at " in banner, banner
        assert len(rows(driver, "leases")) == 6
        screenshot(driver, "busy-page-refresh-failed")
        stack.enter_context(exporting(leases, port=port))
        until(driver, lambda d: not d.find_element("id", "error").is_displayed(), timeout=15, what="the recovery")


# --- who gets the page -------------------------------------------------------------------------------------


def test_the_page_is_served_under_the_busy_views_rules_with_a_policy_that_runs_only_its_own_script(
    leases: Leases,
) -> None:
    with exporting(leases) as exporter:
        status, headers, body = request(exporter.port, BUSY_PAGE_PATH)
        assert status == 200 and body == BUSY_PAGE
        assert headers["Content-Type"] == "text/html; charset=utf-8"
        policy = headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "script-src 'sha256-" in policy and "connect-src 'self'" in policy
        assert "unsafe-inline" not in policy
        assert headers["X-Content-Type-Options"] == "nosniff" and headers["Cache-Control"] == "no-store"
        again = request(exporter.port, BUSY_PAGE_PATH + "/")
        undated = {k: v for k, v in headers.items() if k != "Date"}  # a second may tick between the two
        assert (again[0], {k: v for k, v in again[1].items() if k != "Date"}, again[2]) == (status, undated, body)
        head = request(exporter.port, BUSY_PAGE_PATH, "HEAD")
        assert (head[0], head[2], head[1]["Content-Length"]) == (200, b"", str(len(BUSY_PAGE)))
        assert request(exporter.port, BUSY_PAGE_PATH, "POST")[0] == 405
        # Beside it, the JSON and the metrics answer as before.
        assert json.loads(request(exporter.port, "/leases")[2])["leases"] == []
        assert b"dramatiq_lease_exporter_last_scan_timestamp_seconds" in request(exporter.port, "/metrics")[2]
    # Where /leases is refused, so is the page (it would show nothing else); off with it.
    refused = Exporter(leases, host="0.0.0.0", port=0)
    try:
        status, headers, body = request(refused.port, BUSY_PAGE_PATH)
        assert (status, headers["Content-Type"], json.loads(body)["error"]) == (403, "application/json", "forbidden")
    finally:
        refused.close()
    with exporting(leases, top=0) as off:
        assert request(off.port, BUSY_PAGE_PATH)[0] == 404


def test_the_page_script_builds_no_markup_from_data() -> None:
    """Every cell is text: the script never hands a string to the HTML parser."""
    script = BUSY_PAGE.decode()
    for parser in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert parser not in script, parser


# --- the page's sources: package data files, each parsed ---------------------------------------------------

#: Elements HTML writes without an end tag.
VOID = {"meta", "link", "br", "img", "input", "hr", "col", "source", "wbr", "area", "base", "embed", "track"}


class _Nesting(html.parser.HTMLParser):
    """Checks that every element is closed, in order (html.parser itself forgives anything)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.errors: list[str] = []
        self.ids: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids += [value for name, value in attrs if name == "id" and value]
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> at {self.getpos()} closes {self.open[-1:] or 'nothing'}")
        else:
            self.open.pop()


def nesting(text: str) -> _Nesting:
    parser = _Nesting()
    parser.feed(text)
    parser.close()
    return parser


def test_the_page_is_three_package_files_served_as_one_document_under_its_policy() -> None:
    """busy.html, busy.css and busy.js ship in the package (read with importlib.resources); the HTML is
    well-formed and links the other two (so it opens as is from the source tree); the served page is it with
    both inlined, and the Content-Security-Policy's hashes are those of exactly what is inlined."""
    source = page.source("busy.html")
    parsed = nesting(source)
    assert parsed.errors == [] and parsed.open == [], (parsed.errors, parsed.open)
    assert source.startswith("<!doctype html>") and len(parsed.ids) == len(set(parsed.ids)), parsed.ids
    assert '<link rel="stylesheet" href="busy.css">' in source and '<script src="busy.js"></script>' in source
    served = nesting(BUSY_PAGE.decode())
    assert served.errors == [] and served.open == [] and served.ids == parsed.ids
    style, script = "\n" + page.source("busy.css"), "\n" + page.source("busy.js")
    assert f"<style>{style}</style>" in BUSY_PAGE.decode() and f"<script>{script}</script>" in BUSY_PAGE.decode()
    for directive, text in (("script-src", script), ("style-src", style)):
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}';" in page.CONTENT_SECURITY_POLICY, directive
    # Every id the script asks for is in the page.
    asked = set(re.findall(r'getElementById\("([\w-]+)"\)', script))
    asked |= {f"{table}-empty" for table in re.findall(r'fill\("([\w-]+)"', script)}
    assert asked and asked <= set(parsed.ids), asked - set(parsed.ids)
    # The stylesheet's braces balance (no CSS parser in the standard library; a browser would drop the rest).
    css = re.sub(r"/\*.*?\*/", "", page.source("busy.css"), flags=re.S)
    depth = 0
    for char in css:
        depth += {"{": 1, "}": -1}.get(char, 0)
        assert depth in (0, 1), "a brace out of place in busy.css"
    assert depth == 0


def test_the_page_script_is_valid_javascript(tmp_path: Path) -> None:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed: `node --check` parses busy.js where it is")
    script = tmp_path / "busy.js"
    script.write_text(page.source("busy.js"), encoding="utf-8")
    done = subprocess.run([node, "--check", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
