"""The web examples end to end, over real HTTP: one export per user at a time, 423 + Retry-After otherwise.

Each app (Flask under its dev server, FastAPI under uvicorn) runs as a
subprocess against a private Redis; a real ``dramatiq`` worker runs the
jobs on database 0, and nothing consumes database 1 (a job nobody picks up).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from dramatiq_leases.core import Leases, State
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
RUNS_KEY = "examples:export_report:runs"  # where examples.web_tasks records its jobs

APPS = {
    "flask": ["-m", "flask", "--app", "examples.flask_app", "run", "--host", "127.0.0.1", "--port", "{port}"],
    "fastapi": ["-m", "uvicorn", "examples.fastapi_app:app", "--host", "127.0.0.1", "--port", "{port}"],
}
WORKER_DB, NO_WORKER_DB = 0, 1
SHORT_TTL_MS = 1500  # the lease of the apps on the database nobody consumes


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started by this module, and its process group.

    SIGTERM goes to the leader only: a dramatiq worker that gets a second
    SIGTERM (its parent forwards one) exits at once instead of cleanly.
    """
    proc.terminate()
    try:
        proc.wait(10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever outlived the leader
        proc.wait()


class Stack:
    """A private Redis, one worker and the web apps, started on first use and stopped at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.redis = EmbeddedRedis().start()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.apps: dict[tuple[str, int], str] = {}
        self.worker_started = False

    def client(self, db: int) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url(db), socket_timeout=5)

    def leases(self, db: int) -> Leases:
        return Leases.from_url(self.redis.url(db))

    def _spawn(self, name: str, argv: list[str], db: int, ttl_ms: int) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "REDIS_URL": self.redis.url(db),
            "EXPORT_LOCK_TTL_MS": str(ttl_ms),
            "PYTHONUNBUFFERED": "1",
        }
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def start_worker(self) -> None:
        if self.worker_started:
            return
        dramatiq = str(Path(sys.executable).with_name("dramatiq"))
        proc = self._spawn(
            "worker", [dramatiq, "examples.web_tasks", "--processes", "1", "--threads", "2"], WORKER_DB, 30_000
        )
        client = self.client(WORKER_DB)

        def polling() -> bool:
            assert proc.poll() is None, self.log("worker")
            return bool(client.zcard("dramatiq:__heartbeats__"))  # it has asked the queue for work

        wait_for(polling, timeout=30, interval=0.05, what="the worker to poll the queue")
        self.worker_started = True

    def app(self, kind: str, db: int, ttl_ms: int) -> str:
        if (kind, db) in self.apps:
            return self.apps[kind, db]
        port = free_port()
        name = f"{kind}-db{db}"
        proc = self._spawn(name, [sys.executable, *(a.format(port=port) for a in APPS[kind])], db, ttl_ms)
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, self.log(name)
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, timeout=30, interval=0.05, what=f"the {kind} app to answer")
        self.apps[kind, db] = url
        return url

    def close(self) -> None:
        for proc in self.procs:
            _stop(proc)
        self.redis.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("web-logs"))
    try:
        yield s
    finally:
        s.close()


def runs(client: redis.Redis, message_id: str) -> dict[str, dict[str, Any]]:
    """What the job of ``message_id`` recorded, by event (started, finished)."""
    records = [json.loads(raw) for raw in client.lrange(RUNS_KEY, 0, -1)]
    return {r["event"]: r for r in records if r["message_id"] == message_id}


def post(url: str, user_id: int, seconds: float, ticket: str | None = None) -> httpx.Response:
    headers = {"Lease-Ticket": ticket} if ticket else {}
    return httpx.post(f"{url}/exports/{user_id}", params={"seconds": seconds}, headers=headers, timeout=10)


@pytest.mark.parametrize("kind", sorted(APPS))
def test_one_export_per_user_the_worker_adopts_the_lease_and_releases_it(stack: Stack, kind: str) -> None:
    stack.start_worker()
    url = stack.app(kind, WORKER_DB, 30_000)
    client, leases = stack.client(WORKER_DB), stack.leases(WORKER_DB)
    user = {"flask": 1, "fastapi": 2}[kind]
    key = f"export:report:{user}"

    first = post(url, user, 1.5)
    assert first.status_code == 202, first.text
    accepted = first.json()
    assert accepted["key"] == key and accepted["fence"] >= 1 and accepted["message_id"]

    second = post(url, user, 1.5)
    ttl_left = client.pttl(leases.lease_name(key)) / 1000
    assert second.status_code == 423, second.text
    retry_after = int(second.headers["Retry-After"])
    # Whole seconds rounded up from the TTL left when it answered; the read after it is a little later.
    assert ttl_left - 0.1 <= retry_after <= ttl_left + 1.1
    ticket = second.headers["Lease-Ticket"]
    assert second.json() == {
        "error": "locked",
        "key": key,
        "retry_after": retry_after,
        "detail": f"A job for {key!r} is already running; retry in {retry_after} s.",
        "line_length": 0,
        "place": None,
        "ticket": ticket,
    }

    other = post(url, user + 100, 0.1)
    assert other.status_code == 202, "the lease is per user: another user's export starts at once"

    started = wait_for(
        lambda: runs(client, accepted["message_id"]).get("started"), timeout=15, what="the worker to start the export"
    )
    assert started is not None  # for mypy: wait_for returns only a truthy value
    assert started["fence"] == accepted["fence"], "the worker must adopt the lease taken by the web app"

    def accepted_again() -> httpx.Response | None:
        response = post(url, user, 0.1)
        assert response.status_code in (202, 423), response.text
        return response if response.status_code == 202 else None

    third = wait_for(accepted_again, timeout=15, interval=0.1, what="a 202 once the export is over")
    assert third is not None  # for mypy: wait_for returns only a truthy value
    assert "finished" in runs(client, accepted["message_id"]), "a new export started before the first ended"
    assert third.json()["fence"] > accepted["fence"]
    assert leases.fence_state(key)["released"] >= accepted["fence"], "the job released its lease, not its TTL"


@pytest.mark.parametrize("kind", sorted(APPS))
def test_the_lease_expires_by_its_ttl_when_no_worker_takes_the_job(stack: Stack, kind: str) -> None:
    url = stack.app(kind, NO_WORKER_DB, SHORT_TTL_MS)
    client, leases = stack.client(NO_WORKER_DB), stack.leases(NO_WORKER_DB)
    user = {"flask": 11, "fastapi": 12}[kind]
    key = f"export:report:{user}"
    name = leases.lease_name(key)

    first = post(url, user, 1.0)
    assert first.status_code == 202, first.text
    fence = first.json()["fence"]

    before = client.pttl(name)
    second = post(url, user, 1.0)
    after = client.pttl(name)
    assert second.status_code == 423, second.text
    # Nobody renews this lease, so its TTL only falls: Retry-After is the TTL left, rounded up.
    assert math.ceil(after / 1000) <= int(second.headers["Retry-After"]) <= math.ceil(before / 1000)

    # Queued, not dead: `dramatiq-leases release --if-dead` must not free it while it waits for a worker.
    late = wait_for(
        lambda: (i := leases.inspect(key)) is not None and i.ttl_left < 400 and i,
        timeout=5,
        what="the lease to near its end",
    )
    assert late  # for mypy: wait_for returns only a truthy value
    assert late.state is State.ALIVE

    started = time.monotonic()
    wait_for(lambda: client.exists(name) == 0, timeout=10, what="the unadopted lease to expire")
    assert time.monotonic() - started <= SHORT_TTL_MS / 1000 + 0.5

    third = post(url, user, 1.0)
    assert third.status_code == 202, third.text
    assert third.json()["fence"] > fence
    assert leases.fence_state(key)["expired"] == fence, "the fence history records that the grant expired"


@pytest.mark.parametrize("kind", sorted(APPS))
def test_a_web_caller_that_sends_its_ticket_back_gets_its_export_while_workers_keep_queueing(
    stack: Stack, kind: str
) -> None:
    """Steady contention: jobs for the same key keep arriving from elsewhere (a scheduler, a batch), so its line
    never empties; a click on "Export" must still start an export, in its turn, not get 423 for ever."""
    from dramatiq import Message
    from dramatiq.brokers.redis import RedisBroker

    stack.start_worker()
    url = stack.app(kind, WORKER_DB, 30_000)
    client, leases = stack.client(WORKER_DB), stack.leases(WORKER_DB)
    user = {"flask": 31, "fastapi": 32}[kind]
    key = f"export:report:{user}"
    producer = RedisBroker(url=stack.redis.url(WORKER_DB), middleware=[])  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
    sent: list[str] = []

    def finished() -> int:
        return sum(1 for m in sent if "finished" in runs(client, m))

    def feed() -> None:
        """Keep six jobs of this key sent and not finished: one runs, the others queue in its line (some still on
        their way there on a loaded machine: enough that one is behind the caller when its turn comes)."""
        while len(sent) - finished() < 6:
            message: Message[Any] = Message(
                queue_name="default", actor_name="export_report", args=(user, 0.3), kwargs={}, options={}
            )
            sent.append(producer.enqueue(message).message_id)

    try:
        feed()
        wait_for(
            lambda: feed() or leases.inspect_line(key).length >= 2,  # type: ignore[func-returns-value]  # feed() tops the line up, then the condition is read
            timeout=30,
            interval=0.05,
            what="workers queueing on the key",
        )
        first = post(url, user, 0.1)
        assert first.status_code == 423, first.text
        body = first.json()
        ticket = first.headers["Lease-Ticket"]
        assert body["ticket"] == ticket and body["place"] is None and body["line_length"] >= 1
        assert first.headers["Retry-After"] == "1", "the line goes first: take a place now, not at the TTL"

        answers: list[dict[str, Any]] = []

        def exported() -> httpx.Response | None:
            feed()
            response = post(url, user, 0.1, ticket)
            if response.status_code == 202:
                return response
            assert response.status_code == 423, response.text
            answer = response.json()
            assert answer["ticket"] == ticket and answer["place"] is not None, "the ticket holds a place"
            assert 1 <= int(response.headers["Retry-After"]) <= 3, "ask again in time to keep it"
            answers.append(answer)
            return None

        accepted = wait_for(exported, timeout=60, interval=0.2, what="the web caller's turn")
        assert accepted is not None  # for mypy: wait_for returns only a truthy value
        assert answers, "its first ask with the ticket took a place behind the queued workers"
        last = answers[-1]
        # When it last asked, workers were queued behind it, and they still were when its turn came:
        # a caller without a place could not have taken the key then.
        assert last["line_length"] - last["place"] - 1 >= 1, answers
        message_id = accepted.json()["message_id"]
        done = wait_for(lambda: runs(client, message_id).get("finished"), timeout=30, what="the web export")
        assert done is not None  # for mypy: wait_for returns only a truthy value
        assert done["fence"] == accepted.json()["fence"], "the worker adopted the web request's lease"
    finally:
        sent.clear()  # feed no more: the jobs still queued run out by themselves
        producer.close()
