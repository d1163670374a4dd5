"""Issue 23 attacked: what a client on the network, a demanding user and an on-call engineer would try.

Against the protected exporter (``--web.config.file`` basic auth, the lease views' bind rule, ``--mask-keys``):
credentials of every odd shape, paths and methods that might slip past a check, a password bcrypt refuses,
a web configuration that says one thing twice. Against the CLI: Redis passwords that ``urlsplit`` misreads.
Against the export page (real chromium): Redis going away while a lock counts down. Every server is real
(a private Redis, the exporter's own HTTP server, the page's one command).
"""

from __future__ import annotations

import base64
import json
import logging
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bcrypt
import httpx
import pytest
import redis

from dramatiq_leases import web
from dramatiq_leases.cli import main
from dramatiq_leases.core import Lease, Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.exporter import Exporter
from dramatiq_leases.exporter.webconfig import WebConfigError, load_web_config

from .support.stack import MakeLeases
from .support.waiting import wait_for

PERSONAL = "gdpr-export:user:alice@example.com"
META = {"actor": "gdpr_export", "queue": "exports", "host": "worker-3", "pid": "4242", "message_id": "msg-9"}
USER, PASSWORD = "prometheus", "correct horse battery staple"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()


def basic_raw(credentials: bytes) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(credentials).decode()}


def fetch(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """A store in which a worker holds the personal key."""
    store = make_leases()
    lease = store.try_acquire(PERSONAL, 60_000, interval=20_000, meta=META)
    assert isinstance(lease, Lease)
    return store


@contextmanager
def serving(leases: Leases, config: Path | None, host: str = "127.0.0.1", **options: Any) -> Iterator[str]:
    """The base URL of an in-process exporter behind ``config``, after one scan (that saw the lease)."""
    exporter = Exporter(
        leases, host=host, port=0, web_config=load_web_config(str(config)) if config else None, **options
    )
    try:
        exporter.observer.scan()
        yield f"http://127.0.0.1:{exporter.port}"
    finally:
        exporter.close()


@pytest.fixture
def auth_config(tmp_path: Path) -> Path:
    path = tmp_path / "web.yml"
    path.write_text(json.dumps({"basic_auth_users": {USER: HASH}}))
    return path


# --- basic auth -------------------------------------------------------------------------------------------


def test_a_password_bcrypt_cannot_check_is_a_401_not_a_500(leases: Leases, auth_config: Path) -> None:
    """bcrypt 5 raises on a password over 72 bytes: any client could make every path answer 500 (and print a
    traceback on the exporter's stderr per request) without knowing a user name."""
    with serving(leases, auth_config, host="0.0.0.0") as base:
        for who in (USER, "nobody"):
            status, body = fetch(base + "/metrics", basic_raw(f"{who}:{'x' * 100}".encode()))
            assert status == 401, (who, status, body)
        assert fetch(base + "/leases", basic_raw(f"{USER}:{PASSWORD}".encode()))[0] == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": ""},
        {"Authorization": "Basic"},
        {"Authorization": "Basic !!!not-base64!!!"},
        basic_raw(f"{USER}{PASSWORD}".encode()),  # no colon
        basic_raw(b"\xff\xfe:" + PASSWORD.encode()),  # not UTF-8
        basic_raw(f"{USER}:{PASSWORD}\x00".encode()),
        basic_raw(f"{USER}:".encode()),
        basic_raw(f":{PASSWORD}".encode()),
        basic_raw(f"{USER}:extra:{PASSWORD}".encode()),  # a colon in the password part
        basic_raw(f"{USER}:{PASSWORD}:".encode()),
        {"Authorization": "Bearer " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()},
        {"Authorization": "Digest username=prometheus"},
    ],
)
def test_malformed_or_wrong_credentials_get_401_on_every_busy_path_and_method(
    leases: Leases, auth_config: Path, headers: dict[str, str]
) -> None:
    with serving(leases, auth_config, host="0.0.0.0") as base:
        for path in ("/leases", "/busy", "/busy/", "//leases", "/le%61ses", "/leases/history?key=" + PERSONAL):
            for method in ("GET", "HEAD", "OPTIONS", "POST"):
                status, body = fetch(base + path, headers, method)
                assert status == 401, (path, method, status)
                assert PERSONAL.encode() not in body and b"alice" not in body


def test_good_credentials_in_any_scheme_case_and_spacing_are_accepted(leases: Leases, auth_config: Path) -> None:
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    with serving(leases, auth_config, host="0.0.0.0") as base:
        for value in (f"Basic {token}", f"basic {token}", f"BASIC  {token} ", f" Basic {token}"):
            assert fetch(base + "/leases", {"Authorization": value})[0] == 200, value


# --- the Busy view's rule without basic auth ---------------------------------------------------------------


def test_no_path_spelling_or_method_serves_the_busy_view_on_a_public_bind(leases: Leases) -> None:
    """Without basic auth on 0.0.0.0 the lease views are refused (403); no spelling of its path routes
    around the check to a page that shows a key."""
    with serving(leases, None, host="0.0.0.0") as base:
        for path in (
            "/leases",
            "/leases/",
            "/busy",
            "/busy/",
            "/busy//",
            "//leases",
            "/le%61ses",
            "/%6ceases",
            "/leases?limit=5",
            "/leases/history?key=" + urllib.parse.quote(PERSONAL),
            "/leases/history/?key=" + urllib.parse.quote(PERSONAL),
            "/metrics",
            "/",
        ):
            for method in ("GET", "HEAD", "OPTIONS", "POST"):
                status, body = fetch(base + path, None, method)
                assert PERSONAL.encode() not in body and b"alice" not in body, (path, method, status)
                if path.startswith(("/leases", "/busy", "/le%", "/%6c")):
                    assert status == 403, (path, method, status)


# --- the web configuration file ----------------------------------------------------------------------------


def test_a_key_given_twice_in_the_web_config_is_refused_not_half_applied(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys: a second ``basic_auth_users:`` block (an edit appended to the
    file) silently dropped the first one's users, and a second ``tls_server_config:`` block the first's
    certificate. exporter-toolkit (UnmarshalStrict) refuses such a file; so must this exporter."""
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  {USER}: '{HASH}'\nbasic_auth_users:\n  other: '{HASH}'\n")
    with pytest.raises(WebConfigError, match="basic_auth_users' given twice"):
        load_web_config(str(path))
    path.write_text(f"basic_auth_users:\n  {USER}: '{HASH}'\n  {USER}: '{HASH}'\n")
    with pytest.raises(WebConfigError, match="given twice"):
        load_web_config(str(path))
    path.write_text(f"basic_auth_users:\n  {USER}: '{HASH}'\n")
    assert set(load_web_config(str(path)).users) == {USER}


def test_an_unreadable_web_config_names_the_file(tmp_path: Path) -> None:
    for target, why in ((tmp_path, "cannot read it"), (tmp_path / "missing.yml", "cannot read it")):
        with pytest.raises(WebConfigError, match=why) as caught:
            load_web_config(str(target))
        assert str(target) in str(caught.value)
    binary = tmp_path / "binary.yml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(WebConfigError, match="cannot read it"):
        load_web_config(str(binary))


# --- --mask-keys -------------------------------------------------------------------------------------------


def test_mask_keys_keeps_a_key_out_of_the_exporters_log(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    store = Leases.from_url(redis_server.url())
    try:
        assert isinstance(store.try_acquire(PERSONAL, 300, meta=META), Lease)
        with caplog.at_level(logging.DEBUG, logger="dramatiq_leases"):
            exporter = Exporter(store, host="127.0.0.1", port=0, mask_keys=True)
            try:
                exporter.observer.scan()
                wait_for(lambda: not store.holders(PERSONAL), timeout=5, what="the lease to expire")
                exporter.observer.scan()  # sees it ended by TTL: counted and logged
                doc = json.loads(fetch(f"http://127.0.0.1:{exporter.port}/leases")[1])
                assert PERSONAL not in json.dumps(doc)
            finally:
                exporter.close()
        assert exporter.observer.expired, "the scan did not see the expiry: the test proves nothing"
        assert PERSONAL not in caplog.text and "alice" not in caplog.text, caplog.text
    finally:
        store.client.close()


# --- the CLI never prints a Redis password -------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://:ab/cdSECRET@127.0.0.1:{port}/0",  # base64 passwords have "/"
        "redis://default:ab#cdSECRET@127.0.0.1:{port}/0",
        "redis://:ab?cdSECRET@127.0.0.1:{port}/0",
        "redis://:SECRET@127.0.0.1:{port}/0",
        "redis://127.0.0.1:{port}/0?password=SECRET",
    ],
)
def test_a_password_urlsplit_misreads_is_still_never_printed(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--redis-url", url.format(port=free_port()), "list"])
    out, err = capsys.readouterr()
    assert code != 0
    assert "SECRET" not in out + err and "cdSECRET" not in out + err, err
    assert "***" in err or "<unparsable URL>" in err, err


# --- web.status on odd keys ----------------------------------------------------------------------------------


def test_status_of_a_key_without_ttl_never_promises_that_it_ends(redis_server: EmbeddedRedis) -> None:
    store = Leases.from_url(redis_server.url())
    try:
        lease = store.try_acquire("export:report:5", 30_000)
        assert isinstance(lease, Lease)
        store.client.persist("dramatiq-leases:lease:{export:report:5}")
        answer = web.status(store, "export:report:5")
        assert answer["held"] and not answer["free"] and answer["ttl_left"] is None
        assert answer["retry_after"] >= 1  # never "retry now" while it is held
    finally:
        store.client.close()


# --- the export page, in a real browser ----------------------------------------------------------------------


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
