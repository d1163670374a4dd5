"""The restart grace (``Leases(restart_grace=MS)``): a store that restarted without persistence forgot its
grants while their holders run on; within the grace of the server's start, a key the store knows nothing of
(no fence counter) is granted to nobody, so a forgotten holder stops at its deadline before anyone starts. The
failover grace: tests/test_failover_grace.py. Real servers, real restarts; each holder's own record of when it
trusted its lease."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from dramatiq_leases import Busy, Leader, Lease, LeaseConfigError, Leases
from dramatiq_leases.core.protocol import Turn, Wait
from dramatiq_leases.embedded import EmbeddedRedis

from .support.stack import Stack
from .support.waiting import wait_for

TTL = 1_500
KEY = "scheduler"


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as started:
        yield started


def uptime_ms(client: redis.Redis) -> int:
    return int(client.info("server")["uptime_in_seconds"]) * 1000


def test_a_new_key_waits_out_the_grace_after_the_server_starts_and_a_known_one_does_not(
    server: EmbeddedRedis,
) -> None:
    client = redis.Redis(port=server.port)
    known = Leases(client)  # no grace: grants "known" at once, and so gives it a counter
    first = known.try_acquire("known", TTL)
    assert isinstance(first, Lease) and known.release(first)
    grace = 3_000
    leases = Leases(client, restart_grace=grace)
    busy = leases.try_acquire("new", TTL)
    assert isinstance(busy, Busy), "granted within the grace of the server's start"
    assert 0 < busy.ttl_left <= grace and busy.fence == 0  # the rest of the grace, and no holder's fence
    again = leases.try_acquire("known", TTL)
    assert isinstance(again, Lease) and again.fence > first.fence, "a key with a counter: nothing was forgotten"
    lease = wait_for(lambda: (got := leases.try_acquire("new", TTL)) and got, timeout=10, what="the grant after")
    assert isinstance(lease, Lease)
    assert uptime_ms(client) >= grace, "granted before the server had been up for the grace"


def test_the_grace_asks_info_only_for_a_key_without_a_counter(server: EmbeddedRedis) -> None:
    """INFO costs more than a command: a key with a counter never pays for it, nor a store without a grace (the
    failover grace's INFO, one per grant, is off here: tests/test_protocol.py counts it)."""
    client = redis.Redis(port=server.port)
    leases = Leases(client, restart_grace=1_000, failover_grace=0)
    plain = Leases(client, prefix="p", failover_grace=0)
    wait_for(lambda: uptime_ms(client) >= 1_000, timeout=5, what="the server up for the grace")

    def infos(cycle: object) -> int:
        client.config_resetstat()
        assert callable(cycle)
        cycle()
        stats = client.info("commandstats")
        return int(stats.get("cmdstat_info", {}).get("calls", 0))  # the INFO reading them is not in them yet

    def held_twice(store: Leases, key: str) -> None:
        for _ in range(2):
            lease = store.try_acquire(key, TTL)
            assert isinstance(lease, Lease) and store.release(lease)

    assert infos(lambda: held_twice(leases, "k")) == 1  # the first grant only: the second finds the counter
    assert infos(lambda: held_twice(plain, "k")) == 0


@pytest.mark.parametrize("value", [-1, 1.5, "1000", True, 10**13])
def test_a_bad_grace_is_refused_naming_it(server: EmbeddedRedis, value: object) -> None:
    with pytest.raises(LeaseConfigError, match=r"Leases: restart_grace must be a whole number"):
        Leases(redis.Redis(port=server.port), restart_grace=value)  # type: ignore[arg-type]


def _leader_across_a_restart(server: EmbeddedRedis, grace: int) -> tuple[float, float, float]:
    """A leader and its standby; the server restarts without persistence. When the leader last trusted its
    lease (its deadline as it stood at the restart, and when it was told of the loss), and when the standby
    was granted the key (monotonic clock)."""
    leases = Leases.from_url(server.url(0), socket_timeout=0.5, restart_grace=grace)
    told: list[float] = []
    first = Leader(leases, KEY, ttl=TTL, on_lost=lambda lease, reason: told.append(time.monotonic()))
    second = Leader(leases, KEY, ttl=TTL, poll=20)
    probe = redis.Redis(port=server.port)
    wait_for(lambda: uptime_ms(probe) >= grace, timeout=10, what="the server up for the grace")
    assert first.wait(timeout=5)
    granted: list[float] = []
    standby = threading.Thread(target=lambda: granted.append(time.monotonic()) if second.wait(timeout=20) else None)
    standby.start()
    assert first.lease is not None
    deadline = first.lease.valid_until  # it trusts the lease at least this long, whatever happens now
    server.stop()
    server.start()
    standby.join(25)
    wait_for(lambda: told, timeout=10, what="the leader told of its loss")
    first.release()
    second.release()
    assert granted, "the standby never led"
    return deadline, told[0], granted[0]


def test_a_restart_under_a_leader_gives_no_second_leader_within_the_grace(server: EmbeddedRedis) -> None:
    deadline, told, granted = _leader_across_a_restart(server, grace=TTL)
    assert granted > told and granted > deadline, "the standby led while the first still trusted its lease"


def test_without_the_grace_a_restart_gives_two_leaders(server: EmbeddedRedis) -> None:
    """What the grace is for, reproduced: the standby is granted the forgotten key while the leader still
    trusts its lease (until its next renewal finds the key gone)."""
    deadline, _, granted = _leader_across_a_restart(server, grace=0)
    assert granted < deadline


def test_a_restart_of_the_lease_store_under_a_running_actor_lets_its_waiter_run_only_after_it_stopped(
    redis_server: EmbeddedRedis, server: EmbeddedRedis
) -> None:
    """The lease store (its own server, the broker's stays up) restarts while one message of a key runs and
    another waits for the key: the first is interrupted at its next renewal, the second runs once, after the
    first stopped (each run's own record of its start and end)."""
    probe = redis.Redis(port=server.port)
    wait_for(lambda: uptime_ms(probe) >= TTL, timeout=10, what="the lease store up for the grace")
    stack = Stack(redis_server.url(0), server.url(0), threads=2, restart_grace=TTL, lock_ttl=TTL)
    runs: dict[int, list[float]] = {}
    started = threading.Event()

    @stack.actor(lock_key="doc:1", max_retries=0)
    def edit(n: int) -> None:
        runs[n] = [time.monotonic()]
        started.set()
        try:
            while n == 1:  # the first runs until told its lease is lost
                time.sleep(0.005)
        finally:
            runs[n].append(time.monotonic())

    try:
        stack.start()
        first = edit.send(1)
        assert started.wait(10)
        second = edit.send(2)
        wait_for(lambda: stack.leases.inspect_line("doc:1").length == 1, timeout=10, what="the second waiting")
        server.stop()
        server.start()
        assert stack.recorder.wait_settled(first.message_id) == "nacked"  # LeaseLost: dead-lettered, no retries
        assert stack.recorder.wait_settled(second.message_id, timeout=30) == "acked"
        assert sorted(runs) == [1, 2]
        assert runs[2][0] > runs[1][1], "the waiter ran while the first was still running under its lease"
    finally:
        stack.stop()


def test_within_the_grace_a_caller_outside_the_line_is_told_to_come_back_not_refused_for_good(
    server: EmbeddedRedis,
) -> None:
    """lock_on_busy skip or fail asks without joining the line: within the grace it is told GRACE, and a copy
    sent back is not remembered as refused (no done record), so its message runs once the grace ends."""
    client = redis.Redis(port=server.port)
    leases = Leases(client, restart_grace=60_000)
    turn = leases.line.join("k", TTL, waiter="m1:1", joins=False, final=True)
    assert isinstance(turn, Turn) and turn.wait is Wait.GRACE and 0 < turn.ttl_left <= 60_000
    assert not client.exists("dramatiq-leases:done:{k}"), "remembered as refused for good"


def test_a_skip_actor_meeting_the_grace_runs_after_it_and_is_not_skipped(
    redis_server: EmbeddedRedis, server: EmbeddedRedis
) -> None:
    stack = Stack(redis_server.url(0), server.url(0), threads=1, restart_grace=4_000, lock_min_backoff=100)
    ran: list[int] = []

    @stack.actor(lock_key="doc:{n}", lock_on_busy="skip", max_retries=0)
    def edit(n: int) -> None:
        ran.append(n)

    try:
        stack.start()
        message = edit.send(1)
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
        assert ran == [1], "skipped for the grace"
        assert len(stack.recorder.delays(message.message_id)) >= 1, "sent back while the grace lasted"
        assert uptime_ms(redis.Redis(port=server.port)) >= 4_000
    finally:
        stack.stop()


def test_an_actor_whose_ttl_outlasts_the_grace_is_named_in_a_warning(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The grace covers holders of its length only: a longer lock_ttl is said at declaration."""
    stack = Stack(redis_server.url(0), redis_server.url(1), restart_grace=10_000)
    with caplog.at_level(logging.WARNING, logger="dramatiq_leases"):

        @stack.actor(lock_key="a:{n}", lock_ttl=10_000)
        def covered(n: int) -> None:
            pass

        @stack.actor(lock_key="b:{n}", lock_ttl=30_000)
        def longer(n: int) -> None:
            pass

    warned = [r.getMessage() for r in caplog.records if "restart_grace" in r.getMessage()]
    assert warned == [
        "actor 'longer': lock_ttl=30000 is longer than restart_grace=10000: after a restart of the lease store, its "
        "key may be granted while a holder the store forgot still runs"
    ]
    stack.stop()
