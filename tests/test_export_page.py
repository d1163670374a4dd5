"""The export page in a real browser (headless chromium): what a user sees when they click Export.

Everything is real: a private Redis, the page's one command (``python -m examples.export_page``, which
runs a ``dramatiq`` worker on the example's actor and starts a fresh one whenever it exits), and a
browser clicking the button. The lease's TTL is 3 s, so a SIGKILLed worker's lock expires quickly.

The seed's chaos test ends here: the worker is SIGKILLed mid-export; a second click must be answered
"an export is running" with a countdown, the button must come back by itself once the lease has expired
(not before, and with no manual step), and the next click must start an export a fresh worker completes.
Also a normal run (queued, then done) and Redis away (503, then a retry works once it is back).
Screenshots of each state go to build/screenshots; the locked one is the README's picture (``make screenshots``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

from dramatiq_leases import web
from dramatiq_leases.core import Lease, Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.browser import chromium, content_digest, publish, screenshot, until
from .support.processes import Processes, clean_env, listening, wait_until

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
README_PICTURE = ROOT / "docs" / "images" / "export-locked.png"
#: The page's own files: the README's picture is made again when they (or what the page says) change.
PAGE_SOURCES = [ROOT / "examples" / "export_page" / name for name in ("page.html", "app.py")]
TTL_MS = 3000
RUNS_KEY = "examples:export_report:runs"  # where examples.web_tasks records each export's start and end
PREFIX = "dramatiq-leases"


@dataclass
class System:
    server: EmbeddedRedis
    procs: Processes
    url: str
    client: redis.Redis

    def worker_pids(self) -> list[int]:
        """The process groups of the workers the launcher started, in order (it prints each)."""
        return [int(pid) for pid in re.findall(r"kill -9 -- -(\d+)", self.procs.log("page", tail=100_000))]

    def runs(self, message_id: str) -> dict[str, dict[str, Any]]:
        """What the export of ``message_id`` recorded (started, finished), by event."""
        records = [json.loads(raw) for raw in self.client.lrange(RUNS_KEY, 0, -1)]
        return {r["event"]: r for r in records if r["message_id"] == message_id}

    def lease_exists(self, user: int) -> bool:
        return bool(self.client.exists(f"{PREFIX}:lease:{{export:report:{user}}}"))


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    server = EmbeddedRedis().start()
    port = free_port()
    argv = [sys.executable, "-m", "examples.export_page", "--port", str(port), "--redis-url", server.url()]
    with Processes(tmp_path_factory.mktemp("export-page-logs")) as procs:
        procs.start("page", [*argv, "--lock-ttl-ms", str(TTL_MS)], env=clean_env())
        client = redis.Redis.from_url(server.url(), socket_timeout=5)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                page = httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
            return page and bool(client.zcard("dramatiq:__heartbeats__"))  # the worker asked for work

        wait_until(up, timeout=30, what="the page and its worker", procs=procs)
        system = System(server, procs, url, client)
        try:
            yield system
        finally:
            client.close()
            procs.stop("page")  # it stops its worker; a worker left by a launcher that hung is ended here
            for pid in system.worker_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
    server.close()


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with chromium(width=860, height=540) as browser:
        yield browser


def open_page(driver: Any, system: System, user: int, seconds: float) -> None:
    driver.get(system.url)
    for field, value in (("user", user), ("seconds", seconds)):
        element = driver.find_element("id", field)
        element.clear()
        element.send_keys(str(value))


def state(driver: Any) -> str:
    return str(driver.find_element("id", "status").get_attribute("data-state"))


def status_text(driver: Any) -> str:
    return str(driver.find_element("id", "status").text)


def in_state(driver: Any, *states: str, timeout: float = 10.0) -> str:
    until(driver, lambda d: state(d) in states, timeout=timeout, what=f"the page to show {states}")
    return status_text(driver)


def click_export(driver: Any) -> None:
    driver.find_element("id", "export").click()


def export_enabled(driver: Any) -> bool:
    return bool(driver.find_element("id", "export").is_enabled())


def fence_and_message(text: str) -> tuple[int, str]:
    match = re.search(r"fence (\d+).*message ([0-9a-f-]{36})", text)
    assert match, f"the page names no fence and message id: {text!r}"
    return int(match.group(1)), match.group(2)


def test_a_normal_export_shows_queued_with_its_fence_and_message_then_done(system: System, driver: Any) -> None:
    open_page(driver, system, user=1, seconds=1)
    click_export(driver)
    queued = in_state(driver, "queued")
    screenshot(driver, "export-1-queued")
    fence, message_id = fence_and_message(queued)
    assert export_enabled(driver), "a second click is for the server to refuse, not the page"
    done = in_state(driver, "done", timeout=15)
    screenshot(driver, "export-2-done")
    assert f"fence {fence}" in done and message_id in done
    finished = system.runs(message_id)["finished"]
    assert finished["fence"] == fence, "the page showed the fence the worker's job held"


def test_a_worker_killed_mid_export_locks_the_button_for_the_rest_of_the_ttl_then_frees_it(
    system: System, driver: Any
) -> None:
    user = 2
    open_page(driver, system, user=user, seconds=30)
    click_export(driver)
    fence, message_id = fence_and_message(in_state(driver, "running", timeout=15))
    screenshot(driver, "chaos-1-running")
    wait_until(lambda: "started" in system.runs(message_id), timeout=5, what="the export to start")
    [*_, killed] = system.worker_pids()
    os.killpg(killed, signal.SIGKILL)  # mid-export: no release, no goodbye
    killed_at = time.monotonic()

    click_export(driver)
    text = in_state(driver, "locked")
    assert "an export is running" in text.lower()
    countdown = int(driver.find_element("id", "countdown").text)
    assert 1 <= countdown <= TTL_MS // 1000, "counts down from Retry-After: the lease's TTL left, at most its TTL"
    assert not export_enabled(driver), "the button waits for the lock"
    path = screenshot(driver, "export-locked")
    publish(path, README_PICTURE, content_digest(driver, *(p.read_bytes() for p in PAGE_SOURCES)))
    until(
        driver,
        lambda d: int(d.find_element("id", "countdown").text) < countdown,
        timeout=3,
        what="the countdown to count down",
    )

    # No other action: poll the page and Redis until the button is back. The button is read before the lease:
    # enabled at an instant means the lease was gone at that instant (nobody else takes this key).
    gone_at: float | None = None
    while True:
        enabled = export_enabled(driver)
        exists = system.lease_exists(user)
        now = time.monotonic()
        if enabled:
            assert not exists, "the button came back while the dead worker's lease was still held"
            break
        if not exists and gone_at is None:
            gone_at = now
        assert now - killed_at < TTL_MS / 1000 + 5, f"the button never came back: {status_text(driver)!r}"
        time.sleep(0.05)
    assert gone_at is None or now - gone_at < 2.5, "the button came back late after the lease expired"
    assert time.monotonic() - killed_at <= TTL_MS / 1000 + 3, "the lock outlived its TTL"
    ready = in_state(driver, "ready")
    screenshot(driver, "chaos-3-ready")
    assert f"fence {fence}" in ready and "expired" in ready, (
        "the page tells a dead worker's lock from a finished export"
    )
    system.procs.check_running()  # the launcher lives on

    # A fresh worker (the launcher starts one when the last exits) runs the next export to completion.
    wait_until(lambda: len(system.worker_pids()) >= 2, timeout=10, what="a fresh worker")
    assert system.worker_pids()[-1] != killed
    driver.find_element("id", "seconds").clear()
    driver.find_element("id", "seconds").send_keys("0.5")
    click_export(driver)
    again, again_message = fence_and_message(in_state(driver, "queued", "running"))
    assert again > fence
    done = in_state(driver, "done", timeout=20)
    screenshot(driver, "chaos-4-done")
    assert f"fence {again}" in done
    assert system.runs(again_message)["finished"]["fence"] == again
    assert "finished" not in system.runs(message_id), "the killed export never finished"


def test_redis_away_shows_unavailable_and_a_retry_works_once_it_is_back(system: System, driver: Any) -> None:
    open_page(driver, system, user=3, seconds=2)
    system.server.stop()
    try:
        click_export(driver)
        text = in_state(driver, "unavailable")
        screenshot(driver, "redis-1-unavailable")
        assert "Redis is unreachable" in text
        retry = driver.find_element("id", "retry")
        assert retry.is_displayed()
    finally:
        system.server.start()
    retry.click()
    fence, message_id = fence_and_message(in_state(driver, "queued", "running"))
    screenshot(driver, "redis-2-queued")
    # The worker's consumer reconnects by itself (Dramatiq restarts it after a connection error, within a few
    # seconds); if that outlasts the request's 3 s lease, the worker takes a lease of its own (the next fence),
    # and the page follows its message there.
    done = in_state(driver, "done", timeout=20)
    ran = system.runs(message_id)["finished"]["fence"]
    assert ran >= fence and f"fence {ran}" in done


def test_the_one_command_starts_redis_a_worker_and_the_page_and_stops_them(tmp_path: Path) -> None:
    """``python -m examples.export_page``, as the README says: its own Redis, its worker, the page; SIGTERM (as
    Ctrl-C) stops all three."""
    port = free_port()
    with Processes(tmp_path) as procs:
        launcher = procs.start(
            "one", [sys.executable, "-m", "examples.export_page", "--port", str(port)], env=clean_env()
        )
        found = wait_until(
            lambda: re.search(r"Redis redis://127.0.0.1:(\d+)/0.*\n.*kill -9 -- -(\d+)", procs.log("one")),
            timeout=30,
            what="the launcher to start Redis and a worker",
            procs=procs,
        )
        redis_port, worker = int(found.group(1)), int(found.group(2))
        url = f"http://127.0.0.1:{port}"
        page = wait_until(lambda: _get(url), timeout=30, what="the page", procs=procs)
        assert 'id="export"' in page
        client = redis.Redis(port=redis_port, socket_timeout=5)
        wait_until(lambda: client.zcard("dramatiq:__heartbeats__"), timeout=30, what="its worker", procs=procs)
        accepted = httpx.post(f"{url}/exports/1", params={"seconds": 0.2}, timeout=10)
        assert accepted.status_code == 202, accepted.text
        wait_until(
            lambda: httpx.get(f"{url}/exports/1/status", timeout=5).json()["last"] == "released",
            timeout=20,
            what="its worker to run the export",
            procs=procs,
        )
        client.close()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(20) == 128 + signal.SIGTERM
    assert not listening(redis_port), "its Redis outlived it"
    with pytest.raises(ProcessLookupError):
        os.killpg(worker, 0)  # its worker's process group is gone


def _get(url: str) -> str | None:
    try:
        response = httpx.get(url, timeout=2)
    except httpx.TransportError:
        return None
    return response.text if response.status_code == 200 else None


def test_an_export_that_ends_before_the_countdown_gives_the_button_back_at_once(system: System, driver: Any) -> None:
    """The page polls the lock instead of trusting its clock: a release ends the wait, with seconds still to go."""
    open_page(driver, system, user=4, seconds=2)
    click_export(driver)
    in_state(driver, "running", timeout=15)
    click_export(driver)
    in_state(driver, "locked")
    shown: list[int] = []
    while state(driver) == "locked":  # the heartbeat renews the 3 s lease every second: the count never ends
        with contextlib.suppress(NoSuchElementException, StaleElementReferenceException, ValueError):
            shown.append(int(driver.find_element("id", "countdown").text))
        assert len(shown) < 400, "the page stayed locked"
        time.sleep(0.05)
    ready = in_state(driver, "ready")
    assert "is over" in ready and export_enabled(driver)
    assert shown and shown[-1] >= 1, f"the button came back early, its countdown still at {shown[-1]} s"


@pytest.mark.system
def test_the_export_button_comes_back_when_the_countdown_ends_even_with_redis_away(tmp_path: Path) -> None:
    """A lock without TTL is told as one (first part). Then a lock counts down; Redis goes away meanwhile, so the status endpoint answers 503. When the countdown
    reaches 0 the lock has run out its TTL whatever Redis says: the button must be usable again (a click then
    says Redis is unreachable and offers a retry), not stay disabled under "retry in 0 s" until Redis is back."""
    from .support.browser import chromium, screenshot, until
    from .support.processes import Processes, clean_env, wait_until

    server = EmbeddedRedis().start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = redis.Redis.from_url(server.url(), socket_timeout=5)
    store = Leases(client)
    argv = [sys.executable, "-m", "examples.export_page", "--port", str(port), "--redis-url", server.url()]
    try:
        with Processes(tmp_path) as procs, chromium(width=860, height=540) as driver:
            procs.start("page", [*argv, "--lock-ttl-ms", "3000"], env=clean_env())

            def up() -> bool:
                try:
                    return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(up, timeout=30, what="the page", procs=procs)

            def state(d: Any) -> str:
                return str(d.find_element("id", "status").get_attribute("data-state"))

            def click_for(user: int) -> None:
                driver.get(url)
                field = driver.find_element("id", "user")
                field.clear()
                field.send_keys(str(user))
                driver.find_element("id", "export").click()
                until(driver, lambda d: state(d) == "locked", what="the locked state")

            # A lock without TTL (debris) never ends by itself: the page must say so, not count down to
            # "retry in 0 s" under a dead button and promise that "the lock ends by itself"; and it must
            # still give the button back once an operator frees the key.
            assert isinstance(store.try_acquire("export:report:8", 30_000), Lease)
            client.persist("dramatiq-leases:lease:{export:report:8}")
            click_for(8)
            until(driver, lambda d: "no TTL" in d.find_element("id", "status").text, timeout=5, what="'no TTL'")
            text = driver.find_element("id", "status").text
            screenshot(driver, "hostile-no-ttl")
            assert "ends by itself" not in text and "retry in" not in text, text
            assert not driver.find_element("id", "export").is_enabled()
            client.delete("dramatiq-leases:lease:{export:report:8}")  # the operator's release
            until(driver, lambda d: state(d) == "ready", what="the button back once the key is freed")
            assert driver.find_element("id", "export").is_enabled()

            # Someone else's export holds the user's key (a request's lease, 3 s): the click is answered 423.
            assert isinstance(web.try_acquire(store, "export:report:9", 3000), Lease)
            click_for(9)
            server.stop()
            try:
                until(
                    driver,
                    lambda d: d.find_element("id", "countdown").text == "0",
                    timeout=6,
                    what="the countdown to reach 0",
                )
                screenshot(driver, "hostile-redis-away-countdown-over")
                until(
                    driver,
                    lambda d: d.find_element("id", "export").is_enabled(),
                    timeout=4,
                    what="the Export button to come back after the countdown (Redis away)",
                )
                driver.find_element("id", "export").click()
                until(driver, lambda d: state(d) == "unavailable", what="the unavailable state")
                assert driver.find_element("id", "retry").is_displayed()
            finally:
                server.start()
    finally:
        client.close()
        server.close()
