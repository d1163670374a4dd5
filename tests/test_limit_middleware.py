"""``lock_limit`` and ``lock_on_busy`` inside a real Dramatiq Worker, on real Redis: checks, capacity, policies."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import dramatiq
import pytest
import redis
from prometheus_client import CollectorRegistry

from dramatiq_leases import DuplicateMessage, LeaseLimitError, LeaseOptionError, PrometheusMetrics, current_lease
from dramatiq_leases.core.unique import UniqueRecords
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.middleware.options import ORDER_OPTION

from .support.brokers import redis_dead_letters
from .support.runs import Runs
from .support.stack import MakeStack, Stack
from .support.waiting import wait_for


@pytest.fixture
def make_stack(make_stack: MakeStack) -> MakeStack:
    """conftest's stacks (leases on database 1 of the test's server), each with a metrics registry of its own
    (and no endpoint of its own, whose multiprocess mode would share values between the tests' registries)."""

    def make(**options: Any) -> Stack:
        options.setdefault("metrics", PrometheusMetrics(registry=CollectorRegistry()))
        options.setdefault("metrics_endpoint", False)
        return make_stack(**options)

    return make


def leases_written(server: EmbeddedRedis) -> int:
    """How many keys the lease store (database 1) holds."""
    return int(redis.Redis.from_url(server.url(1)).dbsize())


def latest_waiter(stack: Stack) -> str:
    """The pointer to key ``k``'s latest waiter (``"L <waiter> <first_ms>"``), or ``""``."""
    raw: bytes | None = stack.leases.client.hget("dramatiq-leases:waiters:{k}", "")  # type: ignore[assignment]
    return raw.decode() if raw else ""


def not_run(stack: Stack, actor: str, reason: str) -> float:
    """``dramatiq_lease_not_run_total`` of ``actor`` for ``reason``."""
    registry = stack.leases_mw.metrics._registry  # type: ignore[attr-defined]  # PrometheusMetrics' registry
    labels = {"actor_name": actor, "queue_name": "default", "reason": reason}
    return registry.get_sample_value("dramatiq_lease_not_run_total", labels) or 0.0


# Declaration and send time ----------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"lock_limit": 0}, "lock_limit=0; a limit is an int from 1 to 1000"),
        ({"lock_limit": -1}, "lock_limit=-1"),
        ({"lock_limit": 1001}, "lock_limit=1001"),
        ({"lock_limit": True}, "lock_limit=True"),
        ({"lock_limit": 1.5}, "lock_limit=1.5"),
        ({"lock_limit": 2.0}, "lock_limit=2.0"),
        ({"lock_limit": "2"}, "lock_limit='2'"),
        ({"lock_on_busy": "explode"}, "lock_on_busy must be one of ('wait', 'skip', 'fail', 'latest'), got 'explode'"),
        ({"lock_on_busy": 1}, "lock_on_busy must be one of"),
    ],
)
def test_bad_limits_and_policies_fail_at_declaration(
    make_stack: MakeStack, redis_server: EmbeddedRedis, options: dict[str, Any], expected: str
) -> None:
    stack = make_stack()
    with pytest.raises(LeaseOptionError) as info:

        @stack.actor(actor_name="call_vendor", lock_key="tenant:{tenant}", **options)
        def call_vendor(tenant: str) -> None:
            pass

    assert "actor 'call_vendor'" in str(info.value) and info.value.actor == "call_vendor"
    assert expected in str(info.value)
    assert leases_written(redis_server) == 0


def test_bad_middleware_limit_fails_at_construction(redis_server: EmbeddedRedis) -> None:
    from dramatiq_leases import LeaseMiddleware

    with pytest.raises(LeaseOptionError, match="LeaseMiddleware: lock_limit=0"):
        LeaseMiddleware(redis_url=redis_server.url(1), lock_limit=0)
    with pytest.raises(LeaseOptionError, match="LeaseMiddleware: lock_on_busy must be one of"):
        LeaseMiddleware(redis_url=redis_server.url(1), lock_on_busy="queue")


def test_bad_limits_are_refused_at_send_time(make_stack: MakeStack, redis_server: EmbeddedRedis) -> None:
    stack = make_stack()

    def tiers(tenant: str) -> Any:
        return {"gold": 5, "float": 1.5, "text": "2", "zero": 0}[tenant]

    @stack.actor(lock_key="tenant:{tenant}", lock_limit=tiers)
    def call_vendor(tenant: str) -> None:
        pass

    @stack.actor(lock_key="tenant:{tenant}")
    def plain(tenant: str) -> None:
        pass

    for tenant, value in (("float", "1.5"), ("text", "'2'"), ("zero", "0")):
        with pytest.raises(
            LeaseOptionError, match=rf"actor 'call_vendor': lock_limit <function .*tiers.*> returned {value}"
        ):
            call_vendor.send(tenant)
    with pytest.raises(
        LeaseOptionError, match=r"actor 'call_vendor': lock_limit <function .*> raised KeyError: 'nobody'"
    ):
        call_vendor.send("nobody")
    with pytest.raises(LeaseOptionError, match="actor 'plain': lock_limit=1.5"):
        plain.send_with_options(args=("gold",), lock_limit=1.5)
    with pytest.raises(LeaseOptionError, match="actor 'plain': a message's lock_limit must be an int"):
        plain.send_with_options(args=("gold",), lock_limit=lambda tenant: 2)
    with pytest.raises(LeaseOptionError, match="actor 'plain': lock_on_busy must be one of"):
        plain.send_with_options(args=("gold",), lock_on_busy="later")
    assert stack.recorder.enqueues == []  # nothing reached the queue
    assert leases_written(redis_server) == 0  # nor the lease store
    call_vendor.send("gold")  # a good answer goes through
    assert len(stack.recorder.enqueues) == 1


# Capacity -----------------------------------------------------------------------


def run_concurrently(stack: Stack, runs: Runs) -> dict[str, int]:
    """The most runs at once per tenant, from the runs' own start/end records."""
    peaks: dict[str, int] = {}
    for item in runs.where(kind="run"):
        overlapping = [
            o for o in runs.where(kind="run", tenant=item["tenant"]) if o["start"] <= item["start"] < o["end"]
        ]
        peaks[item["tenant"]] = max(peaks.get(item["tenant"], 0), len(overlapping))
    return peaks


def test_at_most_the_limit_run_at_once_per_key_and_a_callable_sets_it_per_tenant(make_stack: MakeStack) -> None:
    stack = make_stack(threads=8)
    runs = Runs()

    @stack.actor(lock_key="tenant:{tenant}", lock_limit=lambda tenant, n: 3 if tenant == "gold" else 1, max_retries=0)
    def call_vendor(tenant: str, n: int) -> None:
        start = time.monotonic()
        time.sleep(0.2)
        runs.add(kind="run", tenant=tenant, n=n, start=start, end=time.monotonic())

    stack.start()
    for n in range(9):
        call_vendor.send("gold", n)
    for n in range(3):
        call_vendor.send("free", n)
    wait_for(lambda: runs.count(kind="run") == 12, timeout=30, what="12 runs")
    assert sorted(r["n"] for r in runs.where(tenant="gold")) == list(range(9)), "a job ran twice or never"
    assert run_concurrently(stack, runs) == {"gold": 3, "free": 1}


# Policies ---------------------------------------------------------------------------


def hold_key(stack: Stack, runs: Runs, **options: Any) -> tuple[Any, threading.Event]:
    """An actor of key ``k`` whose n=0 run holds it until the returned event is set."""
    release = threading.Event()

    @stack.actor(actor_name="job", lock_key="k", max_retries=3, **options)
    def job(n: int) -> None:
        runs.add(kind="start", n=n, at=time.monotonic())
        if n == 0:
            release.wait(30)
        runs.add(kind="run", n=n, at=time.monotonic())

    return job, release


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_skip_and_fail_leave_at_once_with_a_log_line_and_a_count(
    make_stack: MakeStack, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    stack = make_stack()
    runs = Runs()
    job, release = hold_key(stack, runs, lock_on_busy=policy)
    stack.start()
    holder = job.send(0)
    wait_for(lambda: runs.count(kind="start", n=0) == 1, timeout=10, what="the holder to start")
    caplog.set_level(logging.INFO, logger="dramatiq_leases")
    sent = time.monotonic()
    busy = job.send(1)
    outcome = stack.recorder.wait_settled(busy.message_id, timeout=10)
    assert time.monotonic() - sent < 2.0, "not at once"
    assert outcome == ("acked" if policy == "skip" else "nacked")
    reason = "skipped" if policy == "skip" else "failed"
    assert not_run(stack, "job", reason) == 1
    lines = [
        r.getMessage() for r in caplog.records if busy.message_id in r.getMessage() and "did not run" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    assert f"({reason})" in lines[0] and "'job'" in lines[0] and holder.message_id in lines[0], lines[0]
    # Not a retry: Retries never saw it (one enqueue: the send).
    assert [m for m, _, _ in stack.recorder.enqueues].count(busy.message_id) == 1
    release.set()
    wait_for(lambda: runs.count(kind="run", n=0) == 1, timeout=10, what="the holder to end")
    assert runs.count(kind="start", n=1) == 0


def test_latest_runs_only_the_newest_waiting_message(make_stack: MakeStack, caplog: pytest.LogCaptureFixture) -> None:
    stack = make_stack()
    runs = Runs()
    job, release = hold_key(stack, runs, lock_on_busy="latest")
    stack.start()
    job.send(0)
    wait_for(lambda: runs.count(kind="start", n=0) == 1, timeout=10, what="the holder to start")
    caplog.set_level(logging.INFO, logger="dramatiq_leases")
    sent = []
    for n in range(1, 6):
        sent.append(job.send(n))
        # The next is sent once this one is the key's latest waiter, so first attempts follow n.
        waiter = f"L {sent[-1].message_id}:0 "
        wait_for(lambda: latest_waiter(stack).startswith(waiter), timeout=10, what=f"{n} to wait")  # noqa: B023
    # Each older one is acknowledged without running once a newer one joined (in place or parked).
    for message in sent[:-1]:
        assert stack.recorder.wait_settled(message.message_id, timeout=10) == "acked"
    assert not_run(stack, "job", "superseded") == 4
    superseded = [r.getMessage() for r in caplog.records if "(superseded)" in r.getMessage()]
    assert len(superseded) == 4 and all("a newer message of its key took its place" in line for line in superseded)
    release.set()
    wait_for(lambda: runs.count(kind="run") == 2, timeout=10, what="the newest to run")
    assert [r["n"] for r in runs.where(kind="run")] == [0, 5]
    assert runs.count(kind="start") == 2  # every older message was settled above, without running


# A callable that fails on the worker ---------------------------------------------------


class FlakyTiers:
    """A ``lock_limit`` callable of ``tenant`` backed by a tier service that the worker may find down.

    It answers 1 in the test's own thread (the producer's check at send time); in any other (the worker's
    deliveries, Retries' enqueues, the consumers moving delayed messages) it raises ``ConnectionError`` for
    its first ``failures`` calls, or while :attr:`down` is set, then answers ``answer``.
    """

    def __init__(self, *, failures: int = 0, answer: Any = 1) -> None:
        self.producer = threading.current_thread()
        self.failures = failures
        self.answer = answer
        self.down = threading.Event()
        self.raised = 0

    def __repr__(self) -> str:
        return "tiers"

    def __call__(self, tenant: str, *_: Any) -> Any:
        if threading.current_thread() is self.producer:
            return 1
        if self.down.is_set() or self.raised < self.failures:
            self.raised += 1
            raise ConnectionError("tier service unreachable")
        return self.answer


def retries_of(stack: Stack, message_id: str) -> list[int]:
    """The ``retries`` options of the enqueues of ``message_id`` (its send, then Retries' retries), each once."""
    return sorted({int(options.get("retries", 0)) for mid, _, options in stack.recorder.enqueues if mid == message_id})


def test_a_limit_callable_that_raises_on_the_worker_is_retried_by_retries_then_runs_under_its_lease(
    make_stack: MakeStack, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    stack = make_stack()
    tiers = FlakyTiers(failures=2)
    held: list[tuple[str, int]] = []

    @stack.actor(lock_key="tenant:{tenant}", lock_limit=tiers, max_retries=5, min_backoff=10, max_backoff=50)
    def call_vendor(tenant: str) -> None:
        lease = current_lease()
        held.append((lease.key, lease.fence))

    caplog.set_level(logging.INFO, logger="dramatiq_leases")
    message = call_vendor.send("gold")  # the callable works at send time
    stack.start()
    assert stack.recorder.wait_settled(message.message_id, timeout=20) == "acked"
    # Retried by Retries, as an actor's failure is: each failed delivery sent a retry with a growing count.
    assert retries_of(stack, message.message_id) == [0, 1, 2]
    assert tiers.raised == 2
    # Ran once, under its lease: the key's only grant ever; the failed deliveries took none.
    assert len(held) == 1 and held[0][0] == "tenant:gold"
    assert stack.leases.fence_state("tenant:gold")["fence"] == held[0][1]
    assert redis_dead_letters(redis_server) == []
    # Each failed delivery is logged, naming the actor, its key and the callable's error, and counted.
    lines = [r.getMessage() for r in caplog.records if "limit_error" in r.getMessage()]
    assert len(lines) == 2, lines
    for line in lines:
        assert "'call_vendor'" in line and message.message_id in line and "'tenant:gold'" in line, line
        assert "ConnectionError: tier service unreachable" in line and "Retries" in line, line
    assert not_run(stack, "call_vendor", "limit_error") == 2


def test_a_limit_callable_that_keeps_raising_is_dead_lettered_once_retries_gives_up(
    make_stack: MakeStack, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    stack = make_stack()
    tiers = FlakyTiers()
    tiers.down.set()
    ran: list[str] = []

    @stack.actor(lock_key="tenant:{tenant}", lock_limit=tiers, max_retries=0)
    def call_vendor(tenant: str) -> None:
        ran.append(tenant)

    caplog.set_level(logging.INFO)
    message = call_vendor.send("gold")
    stack.start()
    assert stack.recorder.wait_settled(message.message_id, timeout=20) == "nacked"
    assert ran == [] and tiers.raised == 1
    assert retries_of(stack, message.message_id) == [0]  # max_retries=0: no retry sent
    # Retries decided, as for an actor's failure: it gave up and failed the message.
    assert any(
        r.name.startswith("dramatiq.middleware.retries") and "Retries exceeded" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    [dead] = redis_dead_letters(redis_server)
    assert dead.message_id == message.message_id
    # Its failure, as Dramatiq logged it: the callable's error, the cause of the middleware's.
    [failure] = [r.exc_info[1] for r in caplog.records if r.exc_info and r.name.startswith("dramatiq.worker")]
    assert isinstance(failure, LeaseLimitError) and failure.actor == "call_vendor" and failure.key == "tenant:gold"
    assert isinstance(failure.__cause__, ConnectionError) and failure.limit is tiers
    assert stack.leases.fence_state("tenant:gold") == {}  # never granted
    assert not_run(stack, "call_vendor", "limit_error") == 1


def test_a_limit_callable_returning_a_bad_value_on_the_worker_is_dead_lettered_at_once(
    make_stack: MakeStack, redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    stack = make_stack()
    tiers = FlakyTiers(answer=0)  # 2 at send time, 0 on the worker (a tier table changed in between)
    ran: list[str] = []

    @stack.actor(lock_key="tenant:{tenant}", lock_limit=tiers, max_retries=5, min_backoff=10, max_backoff=50)
    def call_vendor(tenant: str) -> None:
        ran.append(tenant)

    caplog.set_level(logging.INFO, logger="dramatiq_leases")
    message = call_vendor.send("gold")
    stack.start()
    assert stack.recorder.wait_settled(message.message_id, timeout=20) == "nacked"
    assert ran == []
    assert retries_of(stack, message.message_id) == [0]  # not retried: a bad setting, not a passing failure
    [dead] = redis_dead_letters(redis_server)
    assert dead.message_id == message.message_id
    [line] = [r.getMessage() for r in caplog.records if "dead-letter" in r.getMessage()]
    assert message.message_id in line and "actor 'call_vendor': lock_limit tiers returned 0" in line, line
    assert stack.leases.fence_state("tenant:gold") == {}
    assert not_run(stack, "call_vendor", "limit_error") == 1


def test_a_unique_message_keeps_its_record_through_the_retries_of_a_failing_limit_callable(
    make_stack: MakeStack,
) -> None:
    stack = make_stack()
    tiers = FlakyTiers()
    tiers.down.set()  # raises on the worker, in its deliveries and in Retries' enqueues, until cleared
    ran: list[int] = []

    @stack.actor(
        lock_key="tenant:{tenant}",
        lock_limit=tiers,
        lock_unique="until_done",
        max_retries=1000,
        min_backoff=10,
        max_backoff=100,
    )
    def call_vendor(tenant: str, n: int) -> None:
        ran.append(n)

    message = call_vendor.send("gold", 1)
    stack.start()
    wait_for(lambda: max(retries_of(stack, message.message_id)) >= 2, timeout=20, what="two retries")
    # Still the key's unique message between its retries: its record lives on, as of its latest attempt.
    [record] = UniqueRecords(stack.leases).records("tenant:gold")
    assert record.message_id == message.message_id and record.attempt >= 2
    with pytest.raises(DuplicateMessage) as refused:
        call_vendor.send("gold", 2)
    assert refused.value.message_id == message.message_id
    tiers.down.clear()
    assert stack.recorder.wait_settled(message.message_id, timeout=20) == "acked"
    assert ran == [1]
    # Done for good: the record ended with it, and the key takes a new message.
    assert UniqueRecords(stack.leases).records("tenant:gold") == []
    after = call_vendor.send("gold", 3)
    assert stack.recorder.wait_settled(after.message_id, timeout=20) == "acked"
    assert ran == [1, 3]


def test_a_first_send_from_a_consumer_thread_counts_as_an_enqueue_again(make_stack: MakeStack) -> None:
    """The limit (docs/guide.md): LeaseMiddleware tells an enqueue of a message sent before (a delayed copy
    that Dramatiq's consumer thread moves to its queue) by the thread it runs on. A *first* send made on a
    consumer thread (another middleware's hook there) is taken for one: its ``lock_limit`` callable is not
    asked at send (the delivery asks it), and a ``"latest"`` message takes no order (ordered by its
    ``message_timestamp``)."""
    stack = make_stack()

    def no_tier(tenant: str) -> int:
        raise ConnectionError("tier service unreachable")

    @stack.actor(actor_name="tiered", lock_key="tenant:{tenant}", lock_limit=no_tier, max_retries=0)
    def tiered(tenant: str) -> None:
        pass

    @stack.actor(actor_name="revise", lock_key="doc:{doc}", lock_on_busy="latest", max_retries=0)
    def revise(doc: int) -> None:
        pass

    with pytest.raises(LeaseOptionError, match="tier service unreachable"):
        tiered.send("gold")  # a first send on any other thread asks the callable
    sent: dict[str, Any] = {}

    class Announcer(dramatiq.Middleware):
        def after_consumer_thread_boot(self, broker: dramatiq.Broker, thread: Any) -> None:
            if sent:
                return
            sent["tiered"] = tiered.send("gold")
            sent["revise"] = revise.send(1)

    stack.broker.add_middleware(Announcer())
    stack.start()
    wait_for(lambda: len(sent) == 2, timeout=10, what="the sends from the consumer thread")
    assert ORDER_OPTION not in sent["revise"].options
    assert stack.recorder.wait_settled(sent["tiered"].message_id) == "nacked"  # refused at its delivery
