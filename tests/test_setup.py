"""Zero-config setup: ``LeaseMiddleware()`` without arguments, as Django's settings build it from a dotted path.

Its store is ``DRAMATIQ_LEASES_URL``, else its RedisBroker's own Redis (chosen at its first hook, a client of the
same server and database with connections of its own), else a ``LeaseConfigError`` naming both ways; an explicit
``redis_url`` or ``client`` wins. In process on real servers, then in a real Django project
(tests/apps/django_site) under ``manage.py rundramatiq``: real worker processes, leases in the broker's Redis or
at ``DRAMATIQ_LEASES_URL``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq import Worker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from prometheus_client import CollectorRegistry

from dramatiq_leases import LeaseConfigError, LeaseMiddleware, Leases, PrometheusMetrics, current_lease
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.processes import ROOT, Processes, clean_env, wait_until
from .support.waiting import wait_for

VARIABLE = "DRAMATIQ_LEASES_URL"
#: The lease keys' prefix (the middleware's default); the broker's keys are under ``dramatiq:``.
PREFIX = b"dramatiq-leases:"


@pytest.fixture(autouse=True)
def _no_url_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets ``DRAMATIQ_LEASES_URL`` itself, or runs without it."""
    monkeypatch.delenv(VARIABLE, raising=False)


def quiet(**options: Any) -> LeaseMiddleware:
    """``LeaseMiddleware(**options)`` with metrics of its own and no endpoint."""
    return LeaseMiddleware(metrics=PrometheusMetrics(registry=CollectorRegistry()), metrics_endpoint=False, **options)


def keys(server: EmbeddedRedis, db: int) -> list[bytes]:
    client = redis.Redis.from_url(server.url(db))
    try:
        return sorted(client.scan_iter(count=1000))
    finally:
        client.close()


def lease_keys(server: EmbeddedRedis, db: int) -> list[bytes]:
    return [key for key in keys(server, db) if key.startswith(PREFIX)]


def store_pool(middleware: LeaseMiddleware) -> Any:
    client = middleware.leases.client
    assert isinstance(client, redis.Redis)
    return client.connection_pool


def store_address(middleware: LeaseMiddleware) -> tuple[Any, Any, Any]:
    kwargs = store_pool(middleware).connection_kwargs
    return kwargs.get("host"), kwargs.get("port"), kwargs.get("db")


# --- in process -----------------------------------------------------------------------------------------------


def test_without_arguments_the_leases_live_on_the_brokers_redis_with_connections_of_their_own(
    redis_server: EmbeddedRedis,
) -> None:
    broker = RedisBroker(url=redis_server.url(3))  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    middleware = quiet()
    broker.add_middleware(middleware)
    with pytest.raises(LeaseConfigError, match="no lease store yet"):
        _ = middleware.leases  # the broker is not known before a hook gets it
    fences: list[int] = []

    @dramatiq.actor(broker=broker, lock_key="setup:{n}", lock_ttl=5_000)
    def job(n: int) -> None:
        fences.append(current_lease().fence)

    # Chosen at the declaration, its first hook: the broker's server and database, a pool of its own.
    pool, broker_pool = store_pool(middleware), broker.client.connection_pool
    assert pool is not broker_pool
    assert store_address(middleware) == ("127.0.0.1", redis_server.port, 3)
    assert pool.connection_kwargs["socket_timeout"] == 2.0  # the broker's client has none: a renewal must not hang
    assert middleware.context.leases is middleware.leases and middleware.runs.leases is middleware.leases

    job.send(1)
    broker.emit_after("process_boot")
    worker = Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: fences, timeout=20, what="the actor to run under its lease")
    finally:
        worker.stop(timeout=10_000)
        broker.close()
    # Its keys beside the queue's, in the broker's database, under the middleware's own prefix; nowhere else.
    in_db = keys(redis_server, 3)
    assert any(key.startswith(PREFIX) for key in in_db) and any(key.startswith(b"dramatiq:") for key in in_db)
    assert Leases(redis.Redis.from_url(redis_server.url(3))).fence_state("setup:1")["released"] == fences[0]
    assert [db for db in range(16) if db != 3 and keys(redis_server, db)] == []


def test_the_environment_wins_over_the_brokers_redis(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VARIABLE, redis_server.url(5))
    middleware = quiet()
    assert store_address(middleware) == ("127.0.0.1", redis_server.port, 5)  # known at construction
    broker = RedisBroker(url=redis_server.url(3), middleware=[middleware])  # type: ignore[no-untyped-call]

    @dramatiq.actor(broker=broker, lock_key="setup:{n}")
    def job(n: int) -> None: ...

    lease = middleware.leases.try_acquire("setup:env", ttl=5_000)
    assert lease is not None
    assert lease_keys(redis_server, 5) and lease_keys(redis_server, 3) == []
    broker.close()


def test_an_explicit_url_or_client_wins_over_the_environment(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VARIABLE, redis_server.url(5))
    assert store_address(quiet(redis_url=redis_server.url(6))) == ("127.0.0.1", redis_server.port, 6)
    client = redis.Redis.from_url(redis_server.url(7), socket_timeout=2)
    given = quiet(client=client)
    assert given.leases.client is client
    StubBroker(middleware=[given])  # a broker it could not share: no matter, it has its store
    with pytest.raises(LeaseConfigError, match="one of redis_url or client, not both"):
        quiet(redis_url=redis_server.url(6), client=client)
    with pytest.raises(LeaseConfigError, match="prefix"):  # checked at construction, before a store is chosen
        LeaseMiddleware(prefix="bad*prefix")


@pytest.mark.parametrize("first_hook", ["declare", "send", "worker boot"])
def test_a_broker_without_redis_and_no_environment_fails_naming_both_ways(first_hook: str) -> None:
    """Raised at the first hook, through Dramatiq's (which swallow other errors): nothing runs unprotected."""
    broker = StubBroker(middleware=[quiet()])
    names = rf"{VARIABLE}.*redis_url"
    with pytest.raises(LeaseConfigError, match=names):
        if first_hook == "declare":
            dramatiq.actor(broker=broker, lock_key="setup:{n}")(lambda n: None)
        elif first_hook == "send":  # a producer that declares no actor (one whose actors live elsewhere)
            broker.declare_queue("default")
            broker.enqueue(dramatiq.Message(queue_name="default", actor_name="a", args=(), kwargs={}, options={}))
        else:
            Worker(broker, worker_threads=1).start()
    assert broker.actors == {}


# --- a real Django project --------------------------------------------------------------------------------------

MANAGE = ROOT / "tests" / "apps" / "django_site" / "manage.py"
RUNS = "django-runs"  # tests/apps/django_site/fenced/tasks.py


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path / "logs") as processes:
        yield processes


@pytest.mark.system
@pytest.mark.parametrize("store", ["broker", "environment"])
def test_a_django_project_runs_leased_actors_with_the_middleware_named_in_its_settings(
    store: str, redis_server: EmbeddedRedis, procs: Processes, tmp_path: Path
) -> None:
    """``"dramatiq_leases.LeaseMiddleware"`` in ``DRAMATIQ_BROKER["MIDDLEWARE"]``, nothing else: a send from
    ``manage.py shell`` and ``manage.py rundramatiq``'s workers use the store it finds, the broker's database 0
    or ``DRAMATIQ_LEASES_URL``'s database 4; the other holds no lease key."""
    leases_db = {"broker": 0, "environment": 4}[store]
    extra = {
        "LEASES_TEST_BROKER_URL": redis_server.url(0),
        "LEASES_TEST_RECORD_URL": redis_server.url(1),
        "DJANGO_SETTINGS_MODULE": "tests.apps.django_site.settings",
        "DRAMATIQ_LEASES_METRICS_PORT": str(free_port()),
        "DRAMATIQ_LEASES_METRICS_DIR": str(tmp_path / "metrics"),
    }
    if store == "environment":
        extra[VARIABLE] = redis_server.url(leases_db)
    env = clean_env(**extra)
    procs.start(
        "rundramatiq",
        [sys.executable, str(MANAGE), "rundramatiq", "--processes", "1", "--threads", "2",
         "--worker-shutdown-timeout", "5000"],
        env=env,
    )  # fmt: skip
    send = "from tests.apps.django_site.fenced.tasks import fenced_job; fenced_job.send(7)"
    sender = procs.start("send", [sys.executable, str(MANAGE), "shell", "-c", send], env=env)
    procs.may_exit.add("send")
    assert sender.wait(60) == 0, procs.report()

    record = redis.Redis.from_url(redis_server.url(1))
    raw = wait_until(lambda: record.lrange(RUNS, 0, -1), timeout=60, what="the leased actor's run", procs=procs)
    runs = [json.loads(item) for item in raw]
    assert [(run["n"], run["key"]) for run in runs] == [(7, "django:7")]
    fence = runs[0]["fence"]
    assert fence > 0

    store_client = redis.Redis.from_url(redis_server.url(leases_db))
    wait_until(
        lambda: Leases(store_client).fence_state("django:7").get("released") == fence,
        timeout=10,
        what="the release of the lease, in the store it chose",
        procs=procs,
    )
    other = {0: 4, 4: 0}[leases_db]
    assert lease_keys(redis_server, other) == [], f"lease keys in database {other}, not the store"
    if store == "broker":
        assert any(key.startswith(b"dramatiq:") for key in keys(redis_server, 0))  # beside the queue's keys
