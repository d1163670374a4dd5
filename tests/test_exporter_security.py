"""The exporter safe by default: a loopback bind, one access system (``--web.config.file``: TLS, basic auth,
client certificates), masked keys, and a CLI that never prints a Redis password.

Certificates are made here (``cryptography``, self-signed); the passwords' bcrypt hashes too, at the lowest
cost so a request costs milliseconds. The in-process :class:`Exporter` serves what the command serves
(``start_server`` wraps the whole app); the command itself runs where its flags and output are the point.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.client
import ipaddress
import json
import logging
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import psutil
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dramatiq_leases.cli import build_parser, main
from dramatiq_leases.core import Lease, Leases
from dramatiq_leases.core.keys import history_name
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.exporter import Exporter
from dramatiq_leases.exporter.page import BUSY_PAGE_PATH
from dramatiq_leases.exporter.webconfig import WebConfigError, load_web_config

from .support.stack import MakeLeases
from .support.waiting import wait_for

CLI = [sys.executable, "-m", "dramatiq_leases.cli"]
PERSONAL = "gdpr-export:user:alice@example.com"
META = {"actor": "gdpr_export", "queue": "exports", "host": "worker-3", "pid": "4242", "message_id": "msg-9"}
USER, PASSWORD = "prometheus", "correct horse battery staple"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
SECRET = "Hunter2-redis-SECRET"  # a Redis password that must never be printed


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


GOOD = basic(USER, PASSWORD)


@dataclass
class Certs:
    """A self-signed server certificate (for 127.0.0.1 and localhost) and a self-signed client one."""

    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    directory = tmp_path_factory.mktemp("certs")
    return Certs(*_self_signed(directory, "exporter"), *_self_signed(directory, "scraper"))


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """A store with a history (for /leases/history) in which a worker holds the personal key."""
    store = make_leases(history=5)
    lease = store.try_acquire(PERSONAL, 60_000, interval=20_000, meta=META)
    assert isinstance(lease, Lease)
    return store


def write_config(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def fetch(
    url: str,
    headers: dict[str, str] | None = None,
    *,
    method: str = "GET",
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one request (error statuses included)."""
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


@contextmanager
def serving(leases: Leases, config: Path | None, host: str = "0.0.0.0", **options: Any) -> Iterator[Exporter]:
    """An in-process exporter behind ``config``, after one scan (that saw the lease)."""
    exporter = Exporter(
        leases, host=host, port=0, web_config=load_web_config(str(config)) if config else None, **options
    )
    try:
        exporter.observer.scan()
        yield exporter
    finally:
        exporter.close()


def client_context(certs: Certs, *, client: bool = False, maximum: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.server_cert))
    if client:
        context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    if maximum is not None:
        context.maximum_version = maximum
    return context


# --- basic auth ------------------------------------------------------------------------------------------


def test_basic_auth_answers_401_without_credentials_and_200_with_them_on_every_path(
    leases: Leases, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path / "web.yml",
        {
            "basic_auth_users": {USER: HASH},
            "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "deny"}},
        },
    )
    history = "/leases/history?key=" + urllib.parse.quote(PERSONAL)
    with serving(leases, config) as exporter:  # on every interface: authenticated readers get /leases there
        base = f"http://127.0.0.1:{exporter.port}"
        for path in ("/metrics", "/leases", history, BUSY_PAGE_PATH, "/", "/any/other/path"):
            for headers in (
                {},
                basic(USER, PASSWORD + "x"),
                basic("nobody", PASSWORD),
                basic(USER, ""),
                {"Authorization": "Basic not-base64!"},
                {"Authorization": f"Bearer {PASSWORD}"},
            ):
                status, response_headers, body = fetch(base + path, headers)
                assert status == 401, (path, headers, body)
                assert response_headers["WWW-Authenticate"].startswith("Basic ")
                assert response_headers["X-Frame-Options"] == "deny"
                assert PERSONAL.encode() not in body and b"dramatiq_lease" not in body
            status, response_headers, body = fetch(base + path, GOOD)
            assert status == 200, (path, body)
            assert response_headers["X-Content-Type-Options"] == "nosniff"
        status, _, body = fetch(base + "/leases", method="HEAD")
        assert (status, body) == (401, b"")
        (row,) = json.loads(fetch(base + "/leases", GOOD)[2])["leases"]
        assert row["key"] == PERSONAL
        assert b"dramatiq_lease_present{" in fetch(base + "/metrics", GOOD)[2]


# --- TLS ---------------------------------------------------------------------------------------------------


def test_the_command_serves_tls_with_a_self_signed_certificate_and_basic_auth(
    redis_server: EmbeddedRedis, leases: Leases, certs: Certs, tmp_path: Path
) -> None:
    # Relative paths are read from the configuration file's directory, as exporter-toolkit does.
    (tmp_path / "tls").mkdir()
    for source in (certs.server_cert, certs.server_key):
        (tmp_path / "tls" / source.name).write_bytes(source.read_bytes())
    config = write_config(
        tmp_path / "web.yml",
        {
            "tls_server_config": {"cert_file": "tls/exporter.crt", "key_file": "tls/exporter.key"},
            "basic_auth_users": {USER: HASH},
        },
    )
    port = free_port()
    log = tmp_path / "exporter.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *CLI,
                "--redis-url",
                redis_server.url(),
                "exporter",
                "--port",
                str(port),
                "--interval",
                "0.2",
                "--web.config.file",
                str(config),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"https://127.0.0.1:{port}"
    trusted = client_context(certs)
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return fetch(url + "/metrics", GOOD, context=trusted)[0] == 200
            except OSError:
                return False

        wait_for(up, timeout=30, interval=0.05, what="the exporter to serve https")
        assert fetch(url + "/leases", context=trusted)[0] == 401
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            trusted.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
        doc = wait_for(
            lambda: (d := json.loads(fetch(url + "/leases", GOOD, context=trusted)[2]))["leases_total"] and d,
            what="a scan",
        )
        assert doc["leases"][0]["key"] == PERSONAL  # a loopback bind: the Busy view is served
        # TLS 1.2 is accepted (the floor), an unverified certificate is refused by the client,
        # plain HTTP gets no answer: none of them stops the server.
        assert fetch(url + "/metrics", GOOD, context=client_context(certs, maximum=ssl.TLSVersion.TLSv1_2))[0] == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            fetch(url + "/metrics", GOOD, context=ssl.create_default_context())
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/metrics", headers=GOOD)
            plain.getresponse()
        plain.close()
        assert fetch(url + "/metrics", GOOD, context=trusted)[0] == 200
    finally:
        proc.terminate()
        proc.wait(10)
    text = log.read_text()
    assert "Traceback" not in text and PASSWORD not in text


def test_min_version_tls13_refuses_a_tls12_client(leases: Leases, certs: Certs, tmp_path: Path) -> None:
    tls = {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key), "min_version": "TLS13"}
    with serving(leases, write_config(tmp_path / "web.yml", {"tls_server_config": tls}), host="127.0.0.1") as exp:
        url = f"https://127.0.0.1:{exp.port}/metrics"
        assert fetch(url, context=client_context(certs))[0] == 200
        with pytest.raises(urllib.error.URLError):
            fetch(url, context=client_context(certs, maximum=ssl.TLSVersion.TLSv1_2))


def test_verified_client_certificates_are_required_and_let_their_holders_read_the_busy_view(
    leases: Leases, certs: Certs, tmp_path: Path
) -> None:
    tls = {
        "cert_file": str(certs.server_cert),
        "key_file": str(certs.server_key),
        "client_auth_type": "RequireAndVerifyClientCert",
        "client_ca_file": str(certs.client_cert),  # self-signed: its own CA
    }
    with serving(leases, write_config(tmp_path / "web.yml", {"tls_server_config": tls})) as exporter:
        url = f"https://127.0.0.1:{exporter.port}"
        with pytest.raises((urllib.error.URLError, OSError)):  # no certificate: the handshake fails
            fetch(url + "/metrics", context=client_context(certs))
        context = client_context(certs, client=True)
        status, _, body = fetch(url + "/leases", context=context)  # on every interface, and no token
        assert status == 200 and json.loads(body)["leases"][0]["key"] == PERSONAL


# --- the default bind, and no password printed -----------------------------------------------------------


def test_the_exporter_listens_on_127_0_0_1_by_default_and_never_shows_the_redis_password(
    redis_server: EmbeddedRedis, leases: Leases, tmp_path: Path
) -> None:
    assert build_parser().parse_args(["exporter"]).host == "127.0.0.1"
    library = Exporter(leases, port=0)  # the library's default too
    try:
        assert library.server.server_address[0] == "127.0.0.1"
    finally:
        library.close()
    leases.client.config_set("requirepass", SECRET)
    port = free_port()
    log = tmp_path / "exporter.log"
    url = f"redis://:{SECRET}@127.0.0.1:{redis_server.port}/0"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*CLI, "--redis-url", url, "exporter", "--port", str(port), "--interval", "0.2"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def page() -> dict[str, Any] | None:
            assert proc.poll() is None, log.read_text()
            try:
                status, _, body = fetch(f"http://127.0.0.1:{port}/leases")
            except OSError:
                return None
            doc: dict[str, Any] = json.loads(body)
            return doc if status == 200 and doc["leases_total"] else None

        doc = wait_for(page, timeout=30, interval=0.05, what="the Busy view on the default bind")
        assert doc is not None
        listening = {
            c.laddr for c in psutil.Process(proc.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
        }
        assert {(address.ip, address.port) for address in listening} == {("127.0.0.1", port)}
        command = doc["leases"][0]["inspect_command"]
        assert f"--redis-url 'redis://:***@127.0.0.1:{redis_server.port}/0'" in command, command
        assert SECRET not in json.dumps(doc)
    finally:
        proc.terminate()
        proc.wait(10)
    assert SECRET not in log.read_text()


@pytest.fixture
def protected(redis_server: EmbeddedRedis) -> Iterator[int]:
    """The test's Redis, asking for the password ``SECRET``."""
    client = redis.Redis(port=redis_server.port)
    client.config_set("requirepass", SECRET)
    client.close()
    yield redis_server.port


def test_no_cli_output_carries_the_redis_password(
    protected: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = free_port()
    wrong = f"redis://:{SECRET}x@127.0.0.1:{protected}/0"
    urls = [
        f"redis://:{SECRET}@127.0.0.1:{dead}/0",  # nothing listens
        wrong,  # a wrong password
        f"redis://default:{SECRET}x@127.0.0.1:{protected}/0",
        f"redis://127.0.0.1:{dead}/0?password={SECRET}",
        f"redis://:{SECRET}@127.0.0.1:notaport/0",  # redis-py's own message about the URL
        f"redi://:{SECRET}@127.0.0.1:{dead}/0",
        f"redis://:{SECRET}@127.0.0.1:{dead}/0?socket_timeout=abc",
        f"redis://:{SECRET}@[::1:{dead}/0",
        f"redis+cluster://:{SECRET}@127.0.0.1:{dead}",
        f"unix://:{SECRET}@/nonexistent/redis.sock",
    ]
    commands = [["list"], ["show", "k"], ["release", "k", "--if-dead"], ["exporter", "--port", "0"]]
    runs = [["--redis-url", url, *command] for url in urls for command in commands]
    runs += [
        # One command: a Sentinel that does not answer takes seconds of redis-py's retries.
        ["--redis-url", f"redis+sentinel://127.0.0.1:{dead}/mymaster?sentinel_password={SECRET}", "list"],
        ["list", f"--redis_url=redis://:{SECRET}@127.0.0.1:{dead}/0"],  # a misspelt flag, echoed by argparse
        ["show", "k", f"--redis-url={wrong}", "--jsn"],
    ]
    for argv in runs:
        code = main(argv)
        out, err = capsys.readouterr()
        assert code in (2, 4), (argv, code, err)
        assert SECRET not in out + err, (argv, out + err)
        assert err.startswith(("dramatiq-leases: ", "usage: ")), (argv, err)
        if "--jsn" not in argv:  # the URL is named, redacted
            assert "***" in err or "<unparsable URL>" in err, (argv, err)
    monkeypatch.setenv("REDIS_URL", wrong)
    assert main(["list"]) == 4
    out, err = capsys.readouterr()
    assert SECRET not in out + err and "AuthenticationError" in err


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


# --- masked keys ---------------------------------------------------------------------------------------------


def test_mask_keys_masks_the_busy_view_and_the_history(leases: Leases) -> None:
    assert build_parser().parse_args(["exporter", "--mask-keys"]).mask_keys
    assert not build_parser().parse_args(["exporter"]).mask_keys
    digest = "sha256:" + hashlib.sha256(PERSONAL.encode()).hexdigest()[:16]
    with serving(leases, None, host="127.0.0.1", mask_keys=True) as exporter:
        base = f"http://127.0.0.1:{exporter.port}"
        doc = json.loads(fetch(base + "/leases")[2])
        (row,) = doc["leases"]
        assert row["key"] == digest and row["inspect_command"] is None
        status, _, body = fetch(base + doc["history_path"] + digest.replace(":", "%3A"))
        assert status == 200, body
        history = json.loads(body)
        assert history["key"] == digest and [e["event"] for e in history["events"]] == ["granted"]
        assert history["events"][0]["holder"] == "worker-3:4242"
        for query, expected in ((PERSONAL, 400), ("sha256:" + "0" * 16, 404), ("sha256:short", 400)):
            status, _, body = fetch(base + "/leases/history?key=" + urllib.parse.quote(query))
            assert status == expected, (query, body)
            assert PERSONAL.encode() not in body
        assert PERSONAL not in json.dumps(doc)


def test_mask_keys_keeps_the_key_out_of_history_errors_and_logs(
    leases: Leases, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """A history of the wrong type (400) and Redis gone with the last scan still cached (503): the digest
    is mapped back to the key for Redis, but neither answer, nor a log line, nor stderr names the key."""
    digest = "sha256:" + hashlib.sha256(PERSONAL.encode()).hexdigest()[:16]
    url = "/leases/history?key=" + urllib.parse.quote(digest)
    with (
        caplog.at_level(logging.DEBUG),
        serving(leases, None, host="127.0.0.1", mask_keys=True) as exporter,
    ):
        base = f"http://127.0.0.1:{exporter.port}"
        name = history_name(leases.prefix, PERSONAL)
        leases.client.delete(name)
        leases.client.set(name, "not a list")  # by hand: the core's error quotes the key and its Redis name
        answers = [fetch(base + url)]
        redis_server.stop()  # the scan stays cached: the digest still maps to the key
        answers.append(fetch(base + url))
        answers.append(fetch(base + "/leases"))
        assert [status for status, _, _ in answers] == [400, 503, 200], answers
        for status, headers, body in answers:
            for secret in (PERSONAL, "alice"):
                assert secret not in body.decode() and secret not in json.dumps(headers), (status, body)
        assert digest in answers[0][2].decode() and digest in answers[1][2].decode()
    out, err = capfd.readouterr()
    for text in (caplog.text, out, err):
        assert PERSONAL not in text and "alice" not in text, text


# --- a bad configuration, refused at start ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "field", "why"),
    [
        ({"basic_auth_user": {}}, "basic_auth_user", "unknown field"),
        ({"basic_auth_users": {USER: "plain-text"}}, f"basic_auth_users.{USER}", "bcrypt hash"),
        ({"basic_auth_users": {USER: "$2y$10$tooshort"}}, f"basic_auth_users.{USER}", "not a valid bcrypt hash"),
        (
            {"tls_server_config": {"cert_file": "missing.crt", "key_file": "missing.key"}},
            "tls_server_config.cert_file",
            "cannot read",
        ),
        ({"tls_server_config": {"key_file": "x.key"}}, "tls_server_config.cert_file", "required"),
        (
            {"tls_server_config": {"cert_file": "CERT", "key_file": "KEY", "min_version": "TLS11"}},
            "tls_server_config.min_version",
            "TLS12 or TLS13",
        ),
        (
            {"tls_server_config": {"cert_file": "CERT", "key_file": "KEY", "client_auth_type": "RequireAnyClientCert"}},
            "tls_server_config.client_auth_type",
            "RequireAndVerifyClientCert",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "CERT",
                    "key_file": "KEY",
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
            },
            "tls_server_config.client_auth_type",
            "needs client_ca_file",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "CERT",
                    "key_file": "KEY",
                    "cipher_suites": ["TLS_AES_128_GCM_SHA256"],
                }
            },
            "tls_server_config.cipher_suites",
            "cannot be honoured",
        ),
        (
            {"tls_server_config": {"cert_file": "CERT", "key_file": "CLIENT_KEY"}},
            "tls_server_config.cert_file, key_file",
            "cannot load",
        ),
        (
            {"http_server_config": {"headers": {"X-Frame-Options": "allow"}}},
            "http_server_config.headers.X-Frame-Options",
            "deny or sameorigin",
        ),
        ({"http_server_config": {"headers": {"Server": "x"}}}, "http_server_config.headers.Server", "cannot be set"),
        ({"rate_limit": {"interval": "1s"}}, "rate_limit", "not supported"),
        ("[not: a mapping", "", "not valid YAML"),
    ],
)
def test_a_bad_web_config_is_refused_at_start_naming_the_file_and_field(
    tmp_path: Path, certs: Certs, capsys: pytest.CaptureFixture[str], doc: Any, field: str, why: str
) -> None:
    path = tmp_path / "web.yml"
    text = doc if isinstance(doc, str) else json.dumps(doc)
    text = text.replace('"CERT"', json.dumps(str(certs.server_cert))).replace(
        '"KEY"', json.dumps(str(certs.server_key))
    )
    path.write_text(text.replace('"CLIENT_KEY"', json.dumps(str(certs.client_key))))
    # Nothing listens at this Redis: the file is refused before it is asked anything (exit 2, not 4).
    code = main(["--redis-url", f"redis://127.0.0.1:{free_port()}/0", "exporter", "--web.config.file", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith(f"dramatiq-leases exporter: error: argument --web.config.file: {path}: {field}"), last
    assert why in last and "Traceback" not in err


def test_a_config_needing_bcrypt_without_it_says_which_extra_to_install(tmp_path: Path) -> None:
    path = write_config(tmp_path / "web.yml", {"basic_auth_users": {USER: HASH}})
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['bcrypt'] = None; from dramatiq_leases.cli import main; "
            f"sys.exit(main(['exporter', '--web.config.file', {str(path)!r}]))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].endswith(
        f"{path}: basic_auth_users: checking passwords needs bcrypt: pip install 'dramatiq-leases[exporter]'"
    )


@pytest.mark.parametrize(
    ("argv", "replacement"),
    [
        (["--busy-token-file", "TOKEN"], "--web.config.file FILE and its basic_auth_users or client certificates"),
        (["--busy-view", "open"], "--open-lease-views"),
        (["--busy-view", "local"], "--open-lease-views"),
        (["--busy-keys", "hashed"], "--mask-keys"),
        (["--busy-view"], "--open-lease-views"),
    ],
)
def test_the_busy_views_own_flags_are_refused_naming_the_one_access_system(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], replacement: str
) -> None:
    """The bearer token and the view's own open rule are gone: giving one is a usage error at start, naming
    what replaces it, never a flag silently dropped (a token ignored on a loopback bind would let every local
    user read the view it guarded)."""
    token = tmp_path / "token"
    token.write_text("s3cr3t-busy-token-0123456789")
    argv = [str(token) if word == "TOKEN" else word for word in argv]
    # Nothing listens at this Redis: the flag is refused before it is asked anything (exit 2, not 4).
    code = main(["--redis-url", f"redis://127.0.0.1:{free_port()}/0", "exporter", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith(f"dramatiq-leases exporter: error: argument {argv[0]}: removed in 0.2: "), last
    assert replacement in last and "s3cr3t" not in err
    assert main(["exporter", "--help"]) == 0
    assert argv[0] not in capsys.readouterr().out, "a removed flag is not offered"


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


# --- one access system: the web configuration, or the loopback, or the one flag ------------------------------


def test_without_authentication_a_public_bind_serves_metrics_and_refuses_the_lease_views(
    leases: Leases, certs: Certs, tmp_path: Path
) -> None:
    """TLS alone authenticates nobody: on 0.0.0.0 the lease views stay closed (403) to every path spelling and
    method, while /metrics is served; --open-lease-views opens them, and nothing else does."""
    tls = {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)}
    config = write_config(tmp_path / "web.yml", {"tls_server_config": tls})
    context = client_context(certs)
    history = "/leases/history?key=" + urllib.parse.quote(PERSONAL)
    for path_config in (None, config):
        scheme = "https" if path_config else "http"
        with serving(leases, path_config) as exporter:
            base = f"{scheme}://127.0.0.1:{exporter.port}"
            assert fetch(base + "/metrics", context=context if path_config else None)[0] == 200
            for path in ("/leases", "/busy", history):
                status, _, body = fetch(base + path, context=context if path_config else None)
                assert status == 403 and json.loads(body)["error"] == "forbidden", (path_config, path, body)
                assert "--open-lease-views" in json.loads(body)["detail"]
                assert PERSONAL.encode() not in body
        with serving(leases, path_config, open_lease_views=True) as exporter:
            base = f"{scheme}://127.0.0.1:{exporter.port}"
            for path in ("/leases", "/busy", history):
                assert fetch(base + path, context=context if path_config else None)[0] == 200, (path_config, path)


def test_open_lease_views_opens_nothing_the_web_config_closes(leases: Leases, tmp_path: Path) -> None:
    """With basic auth every path needs the credentials, the flag notwithstanding: it only concerns requests
    the web configuration lets through unauthenticated, and basic auth lets none through."""
    config = write_config(tmp_path / "web.yml", {"basic_auth_users": {USER: HASH}})
    with serving(leases, config, open_lease_views=True) as exporter:
        base = f"http://127.0.0.1:{exporter.port}"
        for path in ("/metrics", "/leases", "/busy", "/leases/history?key=" + urllib.parse.quote(PERSONAL)):
            status, _, body = fetch(base + path)
            assert status == 401 and PERSONAL.encode() not in body, (path, status)
            assert fetch(base + path, GOOD)[0] == 200, path


def test_a_client_certificate_given_if_asked_opens_the_lease_views_only_to_its_holder(
    leases: Leases, certs: Certs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """VerifyClientCertIfGiven lets a client without a certificate in: it reads /metrics, not the lease views."""
    tls = {
        "cert_file": str(certs.server_cert),
        "key_file": str(certs.server_key),
        "client_auth_type": "VerifyClientCertIfGiven",
        "client_ca_file": str(certs.client_cert),
    }
    with (
        caplog.at_level(logging.INFO),
        serving(leases, write_config(tmp_path / "web.yml", {"tls_server_config": tls})) as exporter,
    ):
        url = f"https://127.0.0.1:{exporter.port}"
        assert fetch(url + "/metrics", context=client_context(certs))[0] == 200
        status, _, body = fetch(url + "/leases", context=client_context(certs))
        assert status == 403 and PERSONAL.encode() not in body
        status, _, body = fetch(url + "/leases", context=client_context(certs, client=True))
        assert status == 200 and json.loads(body)["leases"][0]["key"] == PERSONAL
    assert "are served to holders of a client certificate --web.config.file" in caplog.text
