"""Who may read what the exporter serves, attacked: credentials of every odd shape on every path and method
(``--web.config.file``'s basic auth, a password bcrypt refuses), every spelling of the lease views' paths on a
public bind without authentication, and a key kept out of the exporter's log by ``--mask-keys``. The exporter
runs in this process (:class:`Exporter`, its own HTTP server) on a private Redis where a worker holds a
personal key. Its TLS, its defaults and a bad configuration: tests/test_exporter_security.py.
"""

from __future__ import annotations

import base64
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from dramatiq_leases.core import Lease, Leases
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.exporter import Exporter
from dramatiq_leases.exporter.webconfig import load_web_config

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
