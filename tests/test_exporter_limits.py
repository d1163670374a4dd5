"""The exporter's endpoint under a hostile client: idle connections, a slow request head, wrong passwords.

Every server is real: ``dramatiq-leases exporter`` as a subprocess (its open files limit lowered, as a
container's 1024 would be, so an attack is realistic and bounded) or the in-process :class:`Exporter`, and
the attacker's sockets are real ones. The attacker connects from ``127.0.0.2`` (any 127/8 address is this
host on Linux): one client address, as the review's attacker was, apart from Prometheus' own.
"""

from __future__ import annotations

import base64
import json
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import bcrypt
import psutil

from dramatiq_leases.core import Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port
from dramatiq_leases.exporter import Exporter
from dramatiq_leases.exporter.webconfig import BCRYPT_AT_ONCE, load_web_config

from .support.waiting import wait_for

USER, PASSWORD = "prometheus", "correct horse battery staple"
ATTACKER = "127.0.0.2"


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


GOOD = basic(USER, PASSWORD)


def auth_config(tmp_path: Path, rounds: int = 4) -> Path:
    path = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=rounds)).decode()
    path.write_text(json.dumps({"basic_auth_users": {USER: hashed}}))  # JSON is YAML
    return path


def get(port: int, path: str, headers: dict[str, str] | None = None, timeout: float = 20) -> int:
    """The status of one request (errors included); ``timeout``: a scrape that hangs fails, not the suite."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as e:
        with e:
            return e.code


#: Lowers the soft open files limit, then becomes the command (same pid): no preexec_fn in a threaded parent.
LIMITED = (
    "import os, resource, sys; limit = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
    "os.execv(sys.executable, [sys.executable, '-m', 'dramatiq_leases.cli', *sys.argv[2:]])"
)


@contextmanager
def exporter_process(
    redis_server: EmbeddedRedis, tmp_path: Path, *flags: str, open_files: int
) -> Iterator[tuple[int, psutil.Process, Path]]:
    """``dramatiq-leases exporter`` behind basic auth, on 127.0.0.1, with ``open_files`` as its soft limit."""
    port = free_port()
    log = tmp_path / f"exporter-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                LIMITED,
                str(open_files),
                "--redis-url",
                redis_server.url(),
                "exporter",
                "--port",
                str(port),
                "--interval",
                "0.5",
                "--web.config.file",
                str(auth_config(tmp_path)),
                *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def serving() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return get(port, "/metrics", GOOD, timeout=5) == 200
            except OSError:
                return False

        wait_for(serving, timeout=30, interval=0.05, what="the exporter to serve /metrics")
        yield port, psutil.Process(proc.pid), log
    finally:
        proc.terminate()
        proc.wait(10)


def idle_connections(stack: ExitStack, port: int, count: int, sources: list[str]) -> int:
    """Open ``count`` connections to ``port`` that send nothing, from ``sources`` in turn; how many connected
    (a refused or unanswered one is left out: the attacker just keeps the others)."""
    connected = 0
    for i in range(count):
        sock = stack.enter_context(socket.socket())
        sock.settimeout(2)
        try:
            sock.bind((sources[i % len(sources)], 0))
            sock.connect(("127.0.0.1", port))
            connected += 1
        except OSError:
            pass
    return connected


def test_a_scrape_answers_while_one_client_holds_more_idle_connections_than_the_exporter_has_files(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    # A read timeout longer than the test: what lets the scrape in is the bound on connections, not the
    # attacker's connections timing out.
    with (
        exporter_process(redis_server, tmp_path, "--web.read-timeout", "300", open_files=256) as (port, proc, log),
        ExitStack() as attack,
    ):
        cpu_before, started = sum(proc.cpu_times()[:2]), time.monotonic()
        connected = idle_connections(attack, port, 300, [ATTACKER])
        assert connected > 0, "the attack did not even connect: it proves nothing"
        for _ in range(3):
            assert get(port, "/metrics", GOOD) == 200, log.read_text()
            assert get(port, "/metrics") == 401  # an unauthenticated scraper too is still answered
        # Not pinning a core meanwhile: the exporter's CPU time stays well under the time the attack lasted,
        # held for a window long enough that a spinning loop would show against the scrapes' own cost.
        time.sleep(max(0.0, started + 2 - time.monotonic()))
        busy = sum(proc.cpu_times()[:2]) - cpu_before
        assert busy < 0.5 * (time.monotonic() - started), f"{busy:.2f}s of CPU: a busy loop?\n{log.read_text()}"
    assert "Refused" in log.read_text(), log.read_text()


def test_out_of_open_files_the_exporter_waits_instead_of_spinning_and_serves_again(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    # Connections allowed above the open files limit (a misconfiguration), from many client addresses: accept
    # then fails with EMFILE, which the accepting thread must not retry in a loop.
    flags = ("--web.max-connections", "2000", "--web.read-timeout", "300")
    with exporter_process(redis_server, tmp_path, *flags, open_files=128) as (port, proc, log):
        with ExitStack() as attack:
            idle_connections(attack, port, 200, [f"127.0.0.{i}" for i in range(2, 10)])
            wait_for(lambda: proc.num_fds() >= 127, timeout=20, what="the exporter to run out of open files")
            # A window while out of files (a measurement, not a wait for something to happen): a spinning
            # accept loop burns it all on CPU.
            cpu_before, started = sum(proc.cpu_times()[:2]), time.monotonic()
            time.sleep(2)
            busy = sum(proc.cpu_times()[:2]) - cpu_before
            assert busy < 0.5 * (time.monotonic() - started), f"{busy:.2f}s of CPU: a busy loop\n{log.read_text()}"
        # The attacker lets go: the exporter serves again, having said once what happened.
        wait_for(lambda: get(port, "/metrics", GOOD) == 200, timeout=30, what="a scrape after the attack")
        assert log.read_text().count("Cannot accept connections") == 1, log.read_text()


def test_a_request_head_sent_a_byte_at_a_time_is_cut_off_at_the_read_timeout(redis_server: EmbeddedRedis) -> None:
    leases = Leases.from_url(redis_server.url())
    exporter = Exporter(leases, host="127.0.0.1", port=0, read_timeout=1.0)
    head = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"x" * 400 + b"\r\n\r\n"
    try:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as sock:
            sent, answer, deadline = 0, b"", time.monotonic() + 60
            # A byte every 50 ms, each well within any per-read timeout: only a deadline for the whole head
            # cuts it off (the head would take over 20 s).
            while sent < len(head) and time.monotonic() < deadline:
                try:
                    sock.sendall(head[sent : sent + 1])
                except OSError:
                    break  # reset by the exporter
                sent += 1
                if select.select([sock], [], [], 0.05)[0]:
                    with suppress(OSError):
                        answer = sock.recv(4096)
                    break  # closed (or answered) by the exporter
        assert sent < len(head), f"the whole head was read, {len(head)} bytes over {len(head) * 0.05:.0f}s"
        assert not answer.startswith(b"HTTP/1.0 200"), answer
        # The endpoint itself is fine.
        assert get(exporter.port, "/metrics") == 200
    finally:
        exporter.close()
        leases.client.close()


def test_wrong_passwords_run_a_bounded_number_of_bcrypt_checks_and_a_good_one_is_served_meanwhile(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    leases = Leases.from_url(redis_server.url())
    # A costly hash (as a real one is): each wrong password takes a core for a while.
    config = load_web_config(str(auth_config(tmp_path, rounds=12)))
    exporter = Exporter(leases, host="127.0.0.1", port=0, web_config=config)
    try:
        assert get(exporter.port, "/metrics", GOOD) == 200  # checked once, then cached
        statuses: list[int] = []
        good: list[int] = []
        stop = threading.Event()

        def flood() -> None:
            while not stop.is_set():
                statuses.append(get(exporter.port, "/metrics", basic(USER, "wrong password")))

        threads = [threading.Thread(target=flood) for _ in range(4 * BCRYPT_AT_ONCE)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: 503 in statuses, timeout=60, what="a password check refused at once (503)")
            good.append(get(exporter.port, "/metrics", GOOD))
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        assert set(statuses) <= {401, 503}, statuses
        assert good == [200]
    finally:
        exporter.close()
        leases.client.close()


def test_with_one_connection_one_idle_client_holds_it_until_the_read_timeout(redis_server: EmbeddedRedis) -> None:
    """The limit (docs/guide.md): half of ``--web.max-connections`` 1 is still 1, so one client that connects and
    sends nothing holds the endpoint for ``--web.read-timeout``; every other client, Prometheus too, is refused
    (503) meanwhile. One request per connection (HTTP/1.0): a second request pipelined on it is not answered,
    so no connection holds a place past its one answer."""
    leases = Leases.from_url(redis_server.url())
    exporter = Exporter(leases, host="127.0.0.1", port=0, max_connections=1, read_timeout=1.5)
    try:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=5):
            wait_for(lambda: get(exporter.port, "/metrics") == 503, timeout=5, what="the scrape refused")
            wait_for(lambda: get(exporter.port, "/metrics") == 200, timeout=10, what="the idle client cut off")

        def pipelined() -> bytes:
            with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as sock:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
                return answer

        # The last scrape's place is given back just after its answer: asked again until it is.
        def served() -> bytes:
            answer = pipelined()
            return b"" if b" 503 " in answer else answer

        answer = wait_for(served, timeout=10, what="a place")
        assert answer.count(b"HTTP/1.0 200") == 1 and answer.count(b"HTTP/") == 1
        wait_for(lambda: get(exporter.port, "/metrics") == 200, timeout=5, what="its place given back")
    finally:
        exporter.close()
        leases.client.close()
