"""The heartbeat against a real Redis: renewal, loss verdicts, batching, self-repair, fork, and a renewal hung for
good on a socket (tests/support/freezable.py) under a real Worker."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from dramatiq_leases import (
    LeaseLost,
    LeaseMetrics,
    LeaseMiddleware,
    Leases,
    current_lease,
)
from dramatiq_leases.core import Heartbeat, Lease
from dramatiq_leases.embedded import EmbeddedRedis

from .support.freezable import FreezableProxy
from .support.runs import Runs
from .support.stack import Stack
from .support.waiting import busy_for, wait_for


class Losses:
    def __init__(self) -> None:
        self.events: queue.Queue[tuple[str, str, float]] = queue.Queue()

    def __call__(self, lease: Lease, reason: str) -> None:
        self.events.put((lease.key, reason, time.monotonic()))

    def get(self, timeout: float = 10.0) -> tuple[str, str, float]:
        return self.events.get(timeout=timeout)


@pytest.fixture
def heartbeat(leases: Leases) -> Iterator[Heartbeat]:
    hb = Heartbeat(leases)
    yield hb
    hb.stop()


def acquire(leases: Leases, key: str, ttl: int, **kw: object) -> Lease:
    lease = leases.try_acquire(key, ttl=ttl, **kw)  # type: ignore[arg-type]
    assert isinstance(lease, Lease)
    return lease


def test_a_lease_outlives_many_ttls_while_tracked(leases: Leases, heartbeat: Heartbeat) -> None:
    losses = Losses()
    lease = acquire(leases, "long", ttl=300)
    heartbeat.track(lease, losses)
    deadline = time.monotonic() + 1.2  # four TTLs
    while time.monotonic() < deadline:
        assert leases.inspect("long") is not None
        time.sleep(0.05)
    assert losses.events.empty()
    assert heartbeat.untrack(lease)
    wait_for(lambda: leases.inspect("long") is None, what="the untracked lease to expire")


@pytest.mark.parametrize("how", ["gone", "stolen"])
def test_a_deleted_or_stolen_lease_is_reported_within_one_interval(
    leases: Leases, heartbeat: Heartbeat, redis_client: redis.Redis, how: str
) -> None:
    losses = Losses()
    lease = acquire(leases, "k", ttl=3_000, interval=200)
    heartbeat.track(lease, losses)
    name = leases.lease_name("k")
    tampered = time.monotonic()
    if how == "gone":
        redis_client.delete(name)
    else:
        redis_client.hset(name, "token", "someone-else")
    key, reason, at = losses.get()
    assert (key, reason) == ("k", how)
    assert at - tampered < 0.2 + 0.5  # one interval, plus scheduling slack
    assert heartbeat.tracked() == []


def test_unreachable_redis_ends_the_lease_before_it_can_expire(tmp_path: object) -> None:
    server = EmbeddedRedis().start()
    try:
        leases = Leases(redis.Redis.from_url(server.url(), socket_timeout=0.2, socket_connect_timeout=0.2))
        hb = Heartbeat(leases)
        losses = Losses()
        lease = acquire(leases, "k", ttl=1_000, interval=200)
        hb.track(lease, losses)
        wait_for(lambda: lease.valid_until > time.monotonic() + 0.85, what="a first renewal")
        confirmed_until = lease.valid_until
        server.stop()
        key, reason, at = losses.get()
        assert (key, reason) == ("k", "unreachable")
        # Declared lost no later than the local deadline, which is before the server-side expiry.
        assert at <= confirmed_until + 0.1
        hb.stop()
    finally:
        server.close()


def test_renewal_resumes_after_a_redis_restart(tmp_path: object) -> None:
    server = EmbeddedRedis(persist=True).start()
    try:
        leases = Leases(redis.Redis.from_url(server.url(), socket_timeout=0.2, socket_connect_timeout=0.2))
        hb = Heartbeat(leases)
        losses = Losses()
        lease = acquire(leases, "k", ttl=3_000, interval=300)
        hb.track(lease, losses)
        server.stop()
        server.start()  # same port, data kept (AOF), scripts flushed
        before = lease.valid_until
        wait_for(lambda: lease.valid_until > before, what="a renewal after the restart")
        assert losses.events.empty()
        hb.stop()
    finally:
        server.close()


def test_max_hold_ends_renewal(leases: Leases, heartbeat: Heartbeat) -> None:
    losses = Losses()
    lease = acquire(leases, "hung", ttl=300, max_hold=700)
    heartbeat.track(lease, losses)
    key, reason, _ = losses.get()
    assert (key, reason) == ("hung", "max_hold")
    wait_for(lambda: leases.inspect("hung") is None, what="the lease to expire after its max hold")


def test_one_round_trip_per_round_not_per_lease(
    leases: Leases, heartbeat: Heartbeat, redis_client: redis.Redis
) -> None:
    # A TTL far above the interval: a stall of the machine (other lanes running) costs rounds, never a lease.
    held = [acquire(leases, f"job:{i}", ttl=6_000, interval=200) for i in range(300)]
    before = int(redis_client.info("commandstats")["cmdstat_evalsha"]["calls"])
    for lease in held:
        heartbeat.track(lease, Losses())
    time.sleep(1.0)  # about five rounds; what we measure is how many calls they took
    calls = int(redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]) - before
    assert all(leases.inspect(x.key) for x in held[::50])
    assert calls <= 15, f"{calls} script calls for 300 leases over ~5 rounds"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_heartbeat_restarts_itself_after_dying(leases: Leases) -> None:
    class DiesOnce(LeaseMetrics):
        died = False

        def renew_round(self, seconds: float) -> None:
            if not DiesOnce.died:
                DiesOnce.died = True
                raise SystemExit("simulated thread death")

    hb = Heartbeat(leases, metrics=DiesOnce())
    losses = Losses()
    # A TTL well above a scheduling stall of this loaded 2-core machine (the compatibility lanes run four at
    # once), renewed every 100 ms: a renewer that did not come back loses the lease within one TTL.
    lease = acquire(leases, "k", ttl=1_500, interval=100)
    hb.track(lease, losses)
    wait_for(lambda: DiesOnce.died, what="the renewer to die")
    deadline = time.monotonic() + 4.6  # more than three TTLs
    while time.monotonic() < deadline:
        assert leases.inspect("k") is not None
        time.sleep(0.05)
    assert losses.events.empty()
    hb.stop()


def test_a_forked_child_starts_empty_and_renews_its_own(leases: Leases, heartbeat: Heartbeat) -> None:
    parent_lease = acquire(leases, "parent", ttl=600, interval=100)
    heartbeat.track(parent_lease, Losses())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            ok = heartbeat.tracked() == []
            child_lease = acquire(leases, "child", ttl=300, interval=100)
            heartbeat.track(child_lease, Losses())
            time.sleep(1.0)
            ok = ok and leases.inspect("child") is not None
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    assert leases.inspect("parent") is not None and heartbeat.tracked() == [parent_lease]


def test_stop_returns_what_was_still_held(leases: Leases) -> None:
    hb = Heartbeat(leases)
    a, b = acquire(leases, "a", ttl=1_000), acquire(leases, "b", ttl=1_000)
    hb.track(a, Losses())
    hb.track(b, Losses())
    hb.untrack(a)
    assert hb.stop() == [b]
    assert not hb.running


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
