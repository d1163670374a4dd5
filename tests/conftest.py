"""Shared fixtures: private Redis servers on free ports (helpers live in tests/support/)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.middleware import Interrupt
from dramatiq.middleware.time_limit import TimeLimit
from dramatiq.worker import WorkerThread
from prometheus_client import CollectorRegistry

from dramatiq_leases import Leases, PrometheusMetrics
from dramatiq_leases.embedded import EmbeddedRedis

from .support import servers
from .support.brokers import BROKERS, RABBITMQ_URL, delete_rabbitmq_queues, unique_queue
from .support.limit_workers import LimitWorkers
from .support.stack import MakeLeases, MakeStack, Stack

_SERVER: tuple[str, str] = ("redis", "")


def pytest_configure(config: pytest.Config) -> None:
    """Every server the tests start is the one ``DRAMATIQ_LEASES_TEST_SERVER`` names (tests/support/servers.py)."""
    global _SERVER
    try:
        _SERVER = servers.select()
    except (ValueError, RuntimeError) as problem:
        raise pytest.UsageError(str(problem)) from None


def pytest_report_header(config: pytest.Config) -> str:
    """The server this run tests against, as its binary prints it."""
    name, version = _SERVER
    return f"{servers.VARIABLE}={name}: {version}"


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    """A private server (the one ``DRAMATIQ_LEASES_TEST_SERVER`` chooses) for one test."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """A client of the test's private Redis, database 0."""
    client = redis.Redis.from_url(redis_server.url(0), socket_timeout=2)
    yield client
    client.close()


@pytest.fixture
def make_leases(redis_server: EmbeddedRedis) -> Iterator[MakeLeases]:
    """Lease stores on database ``db`` (0 unless told) of the test's redis-server, made with ``Leases.from_url``'s
    options (``prefix``, ``history``, ``fence_retention``...); their clients are closed after the test."""
    stores: list[Leases] = []

    def make(db: int = 0, **options: Any) -> Leases:
        store = Leases.from_url(redis_server.url(db), **options)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.client.close()


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    """A store with the default options on database 0 of the test's redis-server (the database of ``redis_client``).
    A module whose every test wants other options (a prefix, a history) overrides it with ``make_leases``."""
    return make_leases()


@pytest.fixture(autouse=True)
def _in_process_metric_values() -> Iterator[None]:
    """Each test starts with prometheus_client's in-process values, whatever an earlier one booted.

    A LeaseMiddleware that serves its own endpoint sets ``PROMETHEUS_MULTIPROC_DIR`` and switches
    prometheus_client to file-backed values for the rest of the process, as a worker must; in the test
    process every later metric of the same name would then share those files, and count the earlier
    tests' events as its own.
    """
    from prometheus_client import values

    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR"), values.ValueClass
    yield
    directory, values.ValueClass = before
    if directory is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


@pytest.fixture(autouse=True)
def _no_time_limit_outlives_its_test() -> Iterator[None]:
    """Each test ends with no TimeLimit deadline armed.

    Dramatiq's TimeLimit keeps a deadline per thread id in a monitor thread that runs for the rest of the
    process. A test that interrupts a delivery's after-hooks (an injected ``TimeLimitExceeded``) leaves its
    thread's deadline set; ten minutes later the monitor raises into whatever thread then has that id, such
    as another test's worker or pytest-timeout's timer, which hung CI twice.
    """
    yield
    for thread in threading.enumerate():
        manager = getattr(thread, "deadlines", None)
        if isinstance(manager, dict) and type(thread).__module__ == TimeLimit.__module__:
            with thread.mu:  # type: ignore[attr-defined]  # Dramatiq's monitor thread, unannotated
                manager.clear()


@pytest.fixture
def make_stack(redis_server: EmbeddedRedis) -> Iterator[MakeStack]:
    """Stacks whose broker is database 0 and whose leases are database 1 of the test's redis-server (a module
    may define its own, such as one with the leases on a server of their own)."""
    stacks: list[Stack] = []

    def make(**options: Any) -> Stack:
        stack = Stack(redis_server.url(0), redis_server.url(1), **options)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()


@pytest.fixture(params=BROKERS)
def make_broker_stack(request: pytest.FixtureRequest, redis_server: EmbeddedRedis) -> Iterator[MakeStack]:
    """Stacks on each broker (Redis: database 0 of the test's server; RabbitMQ: a queue of the test's own, deleted
    after it), leases in database 1 with a history of 200 events and metrics of their own; each stack's queue is
    ``stack.queue``. Keyword options go to :class:`Stack` (``threads``, ``broker``, the middleware's)."""
    stacks: list[Stack] = []
    queue = unique_queue("stack") if request.param == "rabbitmq" else "default"

    def make(**options: Any) -> Stack:
        options = {
            "metrics": PrometheusMetrics(registry=CollectorRegistry()),
            "metrics_endpoint": False,
            "history": 200,
            **options,
        }
        if request.param == "rabbitmq":
            options.setdefault("broker", RabbitmqBroker(url=RABBITMQ_URL, confirm_delivery=True))
        stack = Stack(redis_server.url(0), redis_server.url(1), queue=queue, **options)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()
    if request.param == "rabbitmq":
        delete_rabbitmq_queues(queue)


@pytest.fixture
def survivable_worker_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dramatiq's own handler of a failed message can be interrupted too, and the interruption then ends its
    worker thread (as TimeLimit can do in production). Keep the threads alive: a storm of interruptions tests this
    package's bookkeeping, not that window of Dramatiq's."""
    process = WorkerThread.process_message

    def surviving(self: WorkerThread, message: Any) -> None:
        with contextlib.suppress(Interrupt):
            process(self, message)

    monkeypatch.setattr(WorkerThread, "process_message", surviving)


@pytest.fixture(params=BROKERS)
def workers(request: pytest.FixtureRequest, redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[LimitWorkers]:
    """A fleet of `dramatiq tests.apps.limit_app` processes on each broker (tests/support/limit_workers.py), killed
    after the test (tests/test_workers.py has a fleet of its own app under the same name)."""
    fleet = LimitWorkers(request.param, redis_server, tmp_path)
    yield fleet
    fleet.stop()
