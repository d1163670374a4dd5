"""Promises an adversarial review found broken, each kept by a test on real Redis and a real Dramatiq Worker.

1. A lease handed over by a producer is adopted once.
2. An adopted lease honours ``lock_max_hold``.
3. A message-level ``lock_key`` (or any lease option) is never silently ignored.
4. Retries do not inherit the wait clock, and the wait histogram never counts run time.
5. Nothing after a completed actor fails it.
6. Graceful shutdown keeps the lease of an actor still running past the stop timeout.
7. The heartbeat survives a renewal hung on a socket.
8. ``release --if-dead`` never frees a holder cut off but still running; an async actor keeps its lease.
9. The wait line: a stray copy of a message that ran never runs; shutdown is not held up by waiters.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
import time
from typing import Any

import pytest
import redis
from dramatiq.middleware import AsyncIO
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

from dramatiq_leases import (
    Busy,
    LeaseKeyRenderError,
    LeaseLost,
    LeaseMetrics,
    LeaseMiddleware,
    LeaseOptionError,
    Leases,
    current_lease,
)
from dramatiq_leases.core import Lease, State
from dramatiq_leases.embedded import EmbeddedRedis

from .support.runs import Runs
from .support.stack import MakeStack, Stack, taking_over_broker
from .support.waiting import wait_for


def busy_for(leases: Leases, key: str, seconds: float) -> bool:
    """True if a rival asking for ``key`` every 50 ms during ``seconds`` was turned away every time."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rival = leases.try_acquire(key, ttl=5_000)
        if not isinstance(rival, Busy):
            leases.release(rival)
            return False
        time.sleep(0.05)  # sampling the key over a span of time, not waiting for an event
    return True


# 1. Adopted once ------------------------------------------------------------------------------------------


def test_a_handed_over_lease_is_adopted_once(make_stack: MakeStack) -> None:
    stack = make_stack(lock_min_backoff=20, lock_max_backoff=60)
    runs = Runs()
    started, go = threading.Event(), threading.Event()

    @stack.actor(lock_key="export:{user_id}", lock_ttl=2_000, max_retries=0)
    def export(user_id: int) -> None:
        begin = time.monotonic()
        fence = current_lease().fence
        runs.add(started=begin)
        started.set()
        go.wait(10)
        runs.add(start=begin, end=time.monotonic(), fence=fence)

    stack.start()
    lease = stack.leases.try_acquire("export:7", ttl=10_000)  # the web request
    assert not isinstance(lease, Busy)
    message = export.message_with_options(args=(7,), lease=lease)
    stack.broker.enqueue(message)  # the producer sends the same message twice
    stack.broker.enqueue(message)
    assert started.wait(10)
    # The worker adopted it: the producer's token no longer owns the key, and cannot end the run's hold.
    assert stack.leases.release(lease) is False
    info = stack.leases.inspect("export:7")
    assert info is not None and info.token != lease.token and info.fence == lease.fence
    # The second delivery waits in the key's line like any message, not polling with backoff for the whole hold.
    wait_for(lambda: stack.leases.inspect_line("export:7").length == 1, what="the second delivery to join the line")
    assert sum("started" in r for r in runs.items) == 1, "the second delivery ran while the first held the lease"
    go.set()
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert len(stack.recorder.delays(message.message_id)) <= 3, "a waiting message cost more than 3 enqueues"
    spans = sorted((r["start"], r["end"], r["fence"]) for r in runs.items if "end" in r)
    assert len(spans) == 2, spans
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), (
        f"two runs of one handed-over lease overlapped: {spans}"
    )
    assert spans[0][2] == lease.fence < spans[1][2]  # the first adopted the grant; the second was granted anew
    wait_for(lambda: list(stack.leases.scan()) == [], what="the last release (sent off the worker thread)")


# 2. Max hold of an adopted lease ----------------------------------------------------------------------------


def test_an_adopted_lease_honours_lock_max_hold(make_stack: MakeStack) -> None:
    stack = make_stack()
    runs = Runs()

    @stack.actor(lock_key="hung:{n}", lock_ttl=600, lock_max_hold=1_000, max_retries=0)
    def hung(n: int) -> None:
        begin, fence = time.monotonic(), current_lease().fence
        try:
            while time.monotonic() - begin < 8:  # hung, but bounded so that a failure ends
                time.sleep(0.01)
        except LeaseLost as e:
            runs.add(after=time.monotonic() - begin, error=str(e), fence=fence)
            raise
        runs.add(after=time.monotonic() - begin, error=None, fence=fence)

    stack.start()
    lease = stack.leases.try_acquire("hung:1", ttl=5_000)  # no max hold of its own
    assert not isinstance(lease, Busy)
    message = hung.send_with_options(args=(1,), lease=lease)
    assert stack.recorder.wait_settled(message.message_id, timeout=15) == "nacked"
    [run] = runs.items
    assert run["fence"] == lease.fence, "the handed-over lease was not adopted"
    assert run["error"] is not None and "max_hold" in run["error"], f"renewed past lock_max_hold: {run}"
    assert 0.8 <= run["after"] < 1.8, run
    wait_for(lambda: stack.leases.inspect("hung:1") is None, timeout=2, what="the adopted lease to end")


# 3. Message-level lease options ---------------------------------------------------------------------------


def test_lease_options_on_an_actor_without_lock_key_are_refused_at_send_time(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    stack = make_stack()

    @stack.actor(actor_name="plain")
    def plain(n: int) -> None:
        pass

    lease = stack.leases.try_acquire("plain:1", ttl=5_000)
    assert not isinstance(lease, Busy)
    options: dict[str, Any] = {
        "lock_key": "x",
        "lock_ttl": 1_000,
        "lock_renew_interval": 100,
        "lock_max_hold": 1_000,
        "lock_min_backoff": 10,
        "lock_max_backoff": 100,
        "lock_max_wait": 1_000,
        "lock_give_up": "drop",
        "lease": lease,
    }
    for name, value in options.items():
        with pytest.raises(LeaseOptionError) as info:
            plain.send_with_options(args=(1,), **{name: value})
        assert "actor 'plain'" in str(info.value), info.value
        shown = "lease=Lease(key='plain:1'" if name == "lease" else f"{name}={value!r}"
        assert shown in str(info.value), info.value
    assert stack.recorder.enqueues == []
    broker = redis.Redis.from_url(redis_server.url(0))
    assert broker.llen("dramatiq:default") == 0 and broker.hlen("dramatiq:default.msgs") == 0


def test_a_message_level_lock_key_is_honoured_or_refused_at_send_time(make_stack: MakeStack) -> None:
    stack = make_stack(lock_min_backoff=20, lock_max_backoff=60)
    runs = Runs()

    @stack.actor(actor_name="keyed", lock_key="inv:{n}", max_retries=0)
    def keyed(n: int) -> None:
        runs.add(key=current_lease().key)

    for template in ("other:{missing}", "other:{n"):
        with pytest.raises((LeaseOptionError, LeaseKeyRenderError)) as info:
            keyed.send_with_options(args=(5,), lock_key=template)
        assert "actor 'keyed'" in str(info.value) and template in str(info.value), info.value
    with pytest.raises((LeaseOptionError, LeaseKeyRenderError), match="actor 'keyed'"):
        keyed.send_with_options(args=(5,), lock_key="other:{n.real.missing}")
    assert stack.recorder.enqueues == []

    stack.start()
    holder = stack.leases.try_acquire("other:5", ttl=10_000)  # someone holds the message's own key
    assert not isinstance(holder, Busy)
    message = keyed.send_with_options(args=(5,), lock_key="other:{n}")
    wait_for(lambda: stack.leases.inspect_line("other:5").length == 1, what="the message to wait for other:5")
    assert runs.items == [], "ran while its message-level key was held"
    assert stack.leases.release(holder)
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert runs.items == [{"key": "other:5"}]


# 4. The wait clock of retries ------------------------------------------------------------------------------


def test_retries_do_not_inherit_the_wait_clock(make_stack: MakeStack) -> None:
    waits: list[float] = []

    class Waits(LeaseMetrics):
        def wait(self, meta: Any, seconds: float) -> None:
            waits.append(seconds)

    stack = make_stack(lock_min_backoff=20, lock_max_backoff=60, metrics=Waits())
    runs = Runs()
    running = threading.Event()

    @stack.actor(
        actor_name="flaky", lock_key="r:{n}", lock_max_wait=300, max_retries=1, min_backoff=200, max_backoff=400
    )
    def flaky(n: int) -> None:
        runs.add(at=time.monotonic())
        if len(runs.items) == 1:
            running.set()
            time.sleep(0.7)  # work, longer than the wait budget
            raise RuntimeError("try again")

    stack.start()
    holder = stack.leases.try_acquire("r:1", ttl=10_000)
    assert not isinstance(holder, Busy)
    message = flaky.send(1)
    wait_for(lambda: stack.leases.inspect_line("r:1").length == 1, what="the first delivery to wait in line")
    assert stack.leases.release(holder)
    assert running.wait(10)
    # The moment the failed run releases, another holder takes the key (Retries waits >= 200 ms).
    rival = wait_for(
        lambda: stack.leases.try_acquire("r:1", ttl=10_000) or None, interval=0.005, what="the failed run to release"
    )
    assert isinstance(rival, Lease)  # for mypy: wait_for returns only a truthy value, and a Busy is falsy
    # The Retries copy is a new waiter, with a wait clock of its own: on its first delivery's clock it
    # would be given up at once (over 300 ms have passed).
    wait_for(
        lambda: (
            stack.leases.inspect_line("r:1").head == f"{message.message_id}:1"
            or message.message_id in stack.recorder.nacked
        ),
        what="the Retries copy to meet the busy key",
    )
    assert stack.leases.release(rival)
    assert stack.recorder.wait_settled(message.message_id) == "acked", "the retry was given up on its first clock"
    assert len(runs.items) == 2

    # What dramatiq_lease_wait_duration_seconds observes: both deliveries waited, neither for the 0.7 s run.
    assert len(waits) == 2 and all(w >= 0 for w in waits) and sum(waits) > 0, waits
    assert max(waits) < 0.5, f"a wait of over 0.5 s was observed (the 0.7 s run counted as waiting?): {waits}"


# 5. After a completed actor --------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [redis.exceptions.RedisClusterException("slot not covered"), RuntimeError("boom")])
def test_nothing_after_a_completed_actor_fails_it(
    make_stack: MakeStack, redis_server: EmbeddedRedis, error: Exception
) -> None:
    stack = make_stack()
    backend = RedisBackend(url=redis_server.url(2))
    stack.broker.add_middleware(Results(backend=backend))  # type: ignore[no-untyped-call]  # dramatiq leaves it unannotated
    runs = Runs()
    calls: list[str] = []

    def failing_release(key: str, token: str, **_: Any) -> bool:
        calls.append(key)
        raise error

    stack.leases_mw.leases.release_token = failing_release  # type: ignore[method-assign]

    @stack.actor(lock_key="done:{n}", store_results=True, max_retries=3, min_backoff=10, max_backoff=20)
    def done(n: int) -> int:
        runs.add(n=n)
        return n * 6

    stack.start()
    message = done.send(7)
    assert message.get_result(backend=backend, block=True, timeout=10_000) == 42
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    # Sent by the releaser thread, which may come to it after the ack.
    wait_for(lambda: calls, what="the release to be attempted")
    assert len(runs.items) == 1
    assert [mid for mid, _, _ in stack.recorder.enqueues if mid == message.message_id] == [message.message_id]


# 6. Graceful shutdown -------------------------------------------------------------------------------------


def test_shutdown_keeps_the_lease_of_an_actor_still_running(make_stack: MakeStack) -> None:
    stack = make_stack(threads=2)
    runs = Runs()
    started, go = threading.Event(), threading.Event()

    @stack.actor(lock_key="quick:{n}")
    def quick(n: int) -> None:
        runs.add(kind="quick")

    @stack.actor(lock_key="stuck:{n}", lock_ttl=900, max_retries=0)
    def stuck(n: int) -> None:
        started.set()
        begin = time.monotonic()
        while not go.is_set() and time.monotonic() - begin < 15:
            time.sleep(0.01)
        runs.add(kind="stuck-done")

    stack.start()
    assert stack.recorder.wait_settled(quick.send(1).message_id) == "acked"
    stuck.send(1)
    assert started.wait(10)
    worker, stack.worker = stack.worker, None
    assert worker is not None
    worker.stop(timeout=500)
    try:
        assert not runs.where(kind="stuck-done"), "the actor was expected to outlive the stop timeout"
        assert [i.key for i in stack.leases.scan()] == ["stuck:1"]  # the finished actor's lease is gone
        # Held, and renewed, for three TTLs after shutdown returned: nobody else may run stuck:1.
        assert busy_for(stack.leases, "stuck:1", 2.7), "the lease of a still-running actor was released at shutdown"
        assert not runs.where(kind="stuck-done")
    finally:
        go.set()
    wait_for(lambda: runs.where(kind="stuck-done"), what="the actor to finish")
    wait_for(lambda: list(stack.leases.scan()) == [], timeout=5, what="its lease to be released")


# 7. A renewal hung on a socket -----------------------------------------------------------------------------


class FreezableProxy:
    """A TCP proxy on 127.0.0.1 to a Redis port that can black-hole its connections, closing nothing.

    :meth:`freeze` stops forwarding, both ways, on every connection open or opened until :meth:`thaw`;
    those stay hung for good, like half-open TCP connections whose peer is gone (no reply ever comes,
    no error either). After :meth:`thaw`, new connections work: the network is back, the hung sockets
    are not. (Were the hung sockets to resume, a stuck renewer would recover by itself, unnoticed.)
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.frozen = False
        self.closed = False
        self.links: list[tuple[threading.Event, socket.socket, socket.socket]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                return
            flowing = threading.Event()
            if not self.frozen:
                flowing.set()
            self.links.append((flowing, client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(flowing, src, dst), daemon=True).start()

    def _pump(self, flowing: threading.Event, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                flowing.wait()  # hung: hold what was read, forward nothing
                if not data or self.closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def freeze(self) -> None:
        self.frozen = True
        for flowing, _, _ in self.links:
            flowing.clear()

    def thaw(self) -> None:
        self.frozen = False

    def reset_hung(self) -> None:
        """Reset the hung connections: whoever waits on one gets a connection error (and may reconnect)."""
        for flowing, client, upstream in self.links:
            if not flowing.is_set():
                client.close()
                upstream.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for flowing, client, upstream in self.links:
            flowing.set()
            client.close()
            upstream.close()


@pytest.mark.parametrize("new_job", ["once_the_renewer_is_replaced", "as_soon_as_the_network_is_back"])
def test_the_heartbeat_survives_a_renewal_hung_on_a_socket(
    redis_server: EmbeddedRedis, caplog: Any, new_job: str
) -> None:
    proxy = FreezableProxy(redis_server.port)
    hanging = redis.Redis(host="127.0.0.1", port=proxy.port, db=1, socket_timeout=None)  # a renewal can hang
    stack = Stack(
        redis_server.url(0), "", middleware=LeaseMiddleware(client=hanging, lock_min_backoff=20, lock_max_backoff=60)
    )
    direct = Leases.from_url(redis_server.url(1))
    runs = Runs()
    started = threading.Event()

    @stack.actor(lock_key="frozen:{n}", lock_ttl=1_500, max_retries=0)
    def frozen(n: int) -> None:
        started.set()
        begin = time.monotonic()
        try:
            while time.monotonic() - begin < 10:
                time.sleep(0.01)
        except LeaseLost as e:
            runs.add(kind="lost", at=time.monotonic(), error=str(e))
            raise

    @stack.actor(lock_key="after:{n}", lock_ttl=600, max_retries=0)
    def after(n: int) -> None:
        begin = time.monotonic()
        try:
            while time.monotonic() - begin < 2.0:  # more than three TTLs
                time.sleep(0.01)
        except LeaseLost as e:
            runs.add(kind="after-lost", error=str(e))
            raise
        runs.add(kind="after-done", n=n, fence=current_lease().fence)

    try:
        stack.start()
        frozen.send(1)
        assert started.wait(10)
        wait_for(
            lambda: (i := direct.inspect("frozen:1")) is not None and i.renewed_ms > i.acquired_ms,
            what="a first renewal",
        )
        proxy.freeze()
        frozen_at = time.monotonic()
        expires_at = frozen_at + direct.client.pttl(direct.lease_name("frozen:1")) / 1000
        [lost] = wait_for(lambda: runs.where(kind="lost"), timeout=5, what="LeaseLost in the frozen actor")
        assert "unreachable" in lost["error"], lost
        assert lost["at"] < expires_at, f"LeaseLost {lost['at'] - expires_at:.3f}s after the key could expire"
        # The network is back; the sockets that hung stay hung (no socket_timeout). Idle pooled connections died in the outage too: drop them, so that what
        # follows depends on the heartbeat alone.
        proxy.thaw()
        hanging.connection_pool.disconnect(inuse_connections=False)
        if new_job == "once_the_renewer_is_replaced":
            wait_for(
                lambda: any("starting a new heartbeat thread" in r.getMessage() for r in caplog.records),
                timeout=5,
                what="the watchdog to replace the hung renewer",
            )

        # The worker thread that ran the frozen actor kept its connection, hung for good too (no socket_timeout):
        # a message that thread takes waits on it. One per thread, so that others are taken by threads that
        # never connected during the outage.
        sent = {n: after.send(n) for n in range(2, 2 + stack.threads)}
        n = wait_for(
            lambda: [n for n in sent if direct.inspect(f"after:{n}") is not None], what="a new message to acquire"
        )[0]
        assert busy_for(direct, f"after:{n}", 1.5), "the new lease was not kept (the heartbeat is stuck?)"
        assert stack.recorder.wait_settled(sent[n].message_id) == "acked"
        assert not runs.where(kind="after-lost") and runs.where(kind="after-done", n=n), runs.items
    finally:
        proxy.thaw()
        proxy.reset_hung()  # first: whoever waits on a hung socket gets an error and moves on
        stack.stop()
        proxy.close()
        hanging.close()
        direct.client.close()


def test_release_if_dead_never_frees_a_holder_cut_off_but_still_running(redis_server: EmbeddedRedis) -> None:
    """The reviewer's reproduction: a worker cut off from Redis keeps running until its own deadline.

    Its heartbeat is overdue long before that; an operator polling ``release --if-dead`` must not
    free the key until the holder has stopped trusting it, so a second run never overlaps the first.
    """
    proxy = FreezableProxy(redis_server.port)
    cut_off = redis.Redis(host="127.0.0.1", port=proxy.port, db=1, socket_timeout=0.2)
    stack = Stack(redis_server.url(0), "", middleware=LeaseMiddleware(client=cut_off))
    operator = Leases.from_url(redis_server.url(1))
    runs = Runs()
    started = threading.Event()

    @stack.actor(lock_key="bill:{n}", lock_ttl=3_000, lock_renew_interval=500, max_retries=0)
    def bill(n: int) -> None:
        started.set()
        try:
            while True:
                time.sleep(0.005)
        except LeaseLost:
            runs.add(stopped=time.monotonic())
            raise

    try:
        stack.start()
        bill.send(1)
        assert started.wait(10)
        wait_for(
            lambda: (i := operator.inspect("bill:1")) is not None and i.renewed_ms > i.acquired_ms,
            what="a first renewal",
        )
        proxy.freeze()
        wait_for(
            lambda: operator.inspect("bill:1").state is State.HEARTBEAT_OVERDUE,  # type: ignore[union-attr]
            what="the heartbeat to be overdue",
            timeout=5,
        )
        refused_while_overdue = 0
        deadline = time.monotonic() + 10
        while True:  # the operator, following the old runbook, tries again and again
            result = operator.release_if_dead("bill:1")
            if result.released is not False:
                break
            refused_while_overdue += 1
            assert time.monotonic() < deadline, "the key was never freed, not even by its TTL"
            time.sleep(0.01)  # the operator's polling pace
        freed_at = time.monotonic()
        [run] = wait_for(lambda: runs.items, what="the holder to stop", timeout=5)
        assert refused_while_overdue > 10
        # Freed (or expired) only once the holder could no longer believe it held the key.
        assert run["stopped"] <= freed_at, (
            f"the key was freed {run['stopped'] - freed_at:.3f}s before its holder stopped"
        )
    finally:
        proxy.thaw()
        proxy.reset_hung()
        stack.stop()
        proxy.close()
        cut_off.close()
        operator.client.close()


def test_an_async_actor_that_outlives_its_cancellation_keeps_its_lease(make_stack: MakeStack) -> None:
    """Dramatiq stops waiting for a coroutine 1 s after cancelling it; the coroutine may run on.

    Its lease must stay held (and renewed) until the coroutine really ends, then be released.
    """
    stack = make_stack()
    stack.broker.add_middleware(AsyncIO())
    runs = Runs()

    @stack.actor(lock_key="async:{n}", lock_ttl=600, lock_max_hold=20_000, time_limit=500, max_retries=0)
    async def stubborn(n: int) -> None:
        begin = time.monotonic()
        while time.monotonic() - begin < 3.0:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                runs.add(kind="cancelled", at=time.monotonic())  # ignored: it goes on working
        runs.add(kind="ended", at=time.monotonic())

    stack.start()
    message = stubborn.send(1)
    wait_for(lambda: runs.where(kind="cancelled"), what="the time limit to cancel the coroutine", timeout=5)
    assert stack.recorder.wait_settled(message.message_id) == "nacked"  # the worker gave up waiting
    assert not runs.where(kind="ended")
    # The coroutine still runs: its key stays busy past several TTLs, until it ends.
    deadline = time.monotonic() + 10
    while not runs.where(kind="ended"):
        assert isinstance(stack.leases.try_acquire("async:1", ttl=1_000), Busy), "a second holder while it ran"
        assert time.monotonic() < deadline, "the coroutine never ended"
        time.sleep(0.05)  # a rival tries every 50 ms
    wait_for(lambda: stack.leases.inspect("async:1") is None, what="the lease to be released as it ended")


# 9. The wait line ---------------------------------------------------------------------------------------------


def test_a_stray_copy_of_a_message_that_waited_and_ran_never_runs(make_stack: MakeStack) -> None:
    """A worker killed between parking a message and acknowledging it leaves two copies: one runs."""
    stack = make_stack()
    runs = Runs()

    @stack.actor(lock_key="invoice:{n}", max_retries=0)
    def charge(n: int) -> None:
        runs.add(n=n, fence=current_lease().fence)

    stack.start()
    holder = stack.leases.try_acquire("invoice:1", ttl=10_000)
    assert isinstance(holder, Lease)
    message = charge.send(1)
    wait_for(lambda: stack.leases.inspect_line("invoice:1").length == 1, what="the message to wait in line")
    assert stack.leases.release(holder)
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert len(runs.items) == 1
    # The copy a crash would have left in the broker (same id, same retry count): acknowledged, not run.
    stack.broker.enqueue(message.copy())
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert len(runs.items) == 1, "a stray copy of a message that ran ran again"
    # A retry (Retries: a new retry count) is a new waiter, and runs.
    stack.broker.enqueue(message.copy(options={"retries": 1}))
    wait_for(lambda: len(runs.items) == 2, what="the retry to run")


def test_shutdown_wakes_the_threads_waiting_in_place_and_loses_no_message(
    make_stack: MakeStack, redis_server: EmbeddedRedis
) -> None:
    first = make_stack()
    runs = Runs()

    def declare(stack: Stack) -> Any:
        @stack.actor(actor_name="export", lock_key="export:{n}", max_retries=0)
        def export(n: int, i: int) -> None:
            runs.add(i=i)

        return export

    export = declare(first)
    first.start()
    holder = first.leases.try_acquire("export:1", ttl=30_000)
    assert isinstance(holder, Lease)
    messages = [export.send(1, i) for i in range(2)]
    wait_for(
        lambda: first.leases.inspect_line("export:1").states.get("in_place") == 2, what="two threads waiting in place"
    )
    started = time.monotonic()
    first.stop()
    assert time.monotonic() - started < 5, "the shutdown waited for the threads waiting in place"
    assert all(first.recorder.delays(m.message_id) for m in messages), "each waiter was parked on the way out"

    # Another worker on the same broker and lease store: they run once the key is free, once each.
    second = make_stack(broker=taking_over_broker(redis_server.url(0)))
    declare(second)
    second.start()
    assert second.leases.release(holder)
    wait_for(lambda: sorted(r["i"] for r in runs.items) == [0, 1], timeout=20, what="both messages to run")
    assert len(runs.items) == 2


def test_waiting_in_place_stays_within_a_quarter_of_the_time_limit(make_stack: MakeStack) -> None:
    """TimeLimit counts the wait in the hook: past a quarter of the limit the message parks, never times out."""
    stack = make_stack()
    runs = Runs()

    @stack.actor(lock_key="report:{n}", time_limit=2_000, max_retries=0)
    def report(n: int) -> None:
        runs.add(n=n)

    stack.start()
    holder = stack.leases.try_acquire("report:1", ttl=30_000)
    assert isinstance(holder, Lease)
    message = report.send(1)
    wait_for(lambda: stack.leases.inspect_line("report:1").states.get("in_place") == 1, what="it waits in place")
    started = time.monotonic()
    wait_for(lambda: stack.recorder.delays(message.message_id), timeout=5, what="it to park")
    assert time.monotonic() - started < 1.5  # a quarter of 2 s, plus a round trip
    assert stack.leases.release(holder)
    # Never failed (max_retries=0: a TimeLimit in the hook would have dead-lettered it), run once.
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert runs.items == [{"n": 1}]


def test_a_spare_parked_copy_of_a_message_that_ran_is_dropped_without_being_sent_on(make_stack: MakeStack) -> None:
    stack = make_stack()
    runs = Runs()

    @stack.actor(lock_key="invoice:{n}", max_retries=0)
    def charge(n: int) -> None:
        runs.add(n=n)

    stack.start()
    holder = stack.leases.try_acquire("invoice:7", ttl=10_000)
    assert isinstance(holder, Lease)
    message = charge.send(7)
    wait_for(lambda: stack.leases.inspect_line("invoice:7").states.get("in_place") == 1, what="it to wait in place")
    # A spare copy, parked (as a worker killed between parking and acknowledging would leave it).
    stack.broker.enqueue(message.copy(options={"lease_line": "invoice:7"}), delay=300_000)
    waiting = stack.leases_mw.waiting
    wait_for(lambda: waiting.parked == 1, what="the spare copy to be registered by this process")
    assert stack.leases.release(holder)
    wait_for(lambda: len(runs.items) == 1, what="the message to run")
    # Released: the release remembers its waiter as having run (the run itself comes first, and a check in
    # between may rightly send the spare on, to be dropped at its delivery).
    wait_for(lambda: not stack.leases.holders("invoice:7"), what="the message's release")
    sent = len(stack.recorder.enqueues)
    waiting.tend()  # what the periodic check does: the spare's waiter ran, so it is dropped here
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert len(stack.recorder.enqueues) == sent, "the spare was sent on instead of dropped"
    assert len(runs.items) == 1
