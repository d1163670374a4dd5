"""Replicas and failover: leases through Redis Sentinel, ``min_replicas`` (WAIT), and what a failover loses.

Real servers: a primary and its replica (``tests/support/sentinel.py``), with three Sentinels where a test
needs them. Replication is cut with Redis' own access control (the replica's user is disabled and its link
closed), so a write made during the cut is deterministically missing on the replica: nothing holds it in a
buffer. See docs/replication.md for the model these tests pin down.
"""

from __future__ import annotations

import json
import queue
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import pytest
import redis
from redis.cluster import RedisCluster
from redis.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

from dramatiq_leases import (
    Busy,
    Lease,
    LeaseConfigError,
    LeaseMiddleware,
    Leases,
    LeaseUnavailableError,
    current_lease,
)
from dramatiq_leases.cli import EXIT_OK, EXIT_USAGE, main
from dramatiq_leases.core import Heartbeat, LostReason, Renewal
from dramatiq_leases.core.client import client_from_url
from dramatiq_leases.embedded import EmbeddedRedis

from .support.sentinel import Replicated
from .support.stack import Stack
from .support.waiting import wait_for

T = TypeVar("T")

#: WAIT's timeout in these tests (ms): short, since a cut replica makes every grant wait this long.
TIMEOUT_MS = 100

DAY_MS = 86_400_000


@pytest.fixture
def replicated() -> Iterator[Replicated]:
    """A primary and its replica, no Sentinels."""
    with Replicated(sentinels=0) as setup:
        yield setup


@pytest.fixture
def sentinels() -> Iterator[Replicated]:
    """A primary, its replica and three Sentinels (quorum 2) watching them."""
    with Replicated() as setup:
        yield setup


def grant(leases: Leases, key: str, ttl: int = 30_000, **options: Any) -> Lease:
    lease = leases.try_acquire(key, ttl, **options)
    assert isinstance(lease, Lease), lease
    return lease


def refusal(what: str, key: str, asked: int = 1, acked: int = 0, timeout_ms: int = TIMEOUT_MS) -> str:
    return (
        f"could not {what} lease {key!r}: granted, but acknowledged by {acked} of the {asked} replica(s) asked "
        f"(min_replicas) within {timeout_ms} ms, so a failover could lose it; released"
    )


# The Sentinel URL ----------------------------------------------------------------------------------------


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_primary_s_options() -> None:
    client = client_from_url(
        "redis+sentinel://app:p%40ss@s1:26380,s2,[::1]:26381/billing/3?health_check_interval=7&sentinel_password=sp",
        socket_timeout=1.5,
    )
    assert isinstance(client, redis.Redis)  # for mypy: a Sentinel URL gives a Redis, never a RedisCluster
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "billing"
    expected = {
        "db": 3,
        "username": "app",
        "password": "p@ss",
        "health_check_interval": 7,
        "socket_timeout": 1.5,
        "socket_connect_timeout": 1.5,
    }
    assert {k: pool.connection_kwargs.get(k) for k in expected} == expected
    assert "sentinel_password" not in pool.connection_kwargs
    members = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(m["host"], m["port"]) for m in members] == [("s1", 26380), ("s2", 26379), ("::1", 26381)]
    # The Sentinels get their own password and the timeouts, never the primary's credentials.
    assert {k: members[0].get(k) for k in ("password", "username", "socket_timeout", "db")} == {
        "password": "sp",
        "username": None,
        "socket_timeout": 1.5,
        "db": 0,
    }

    tls = cast(redis.Redis, client_from_url("rediss+sentinel://s1/billing")).connection_pool
    assert tls.connection_class is SentinelManagedSSLConnection and tls.connection_kwargs["db"] == 0
    assert isinstance(
        cast(redis.Redis, Leases.from_url("redis+sentinel://s1/billing").client).connection_pool, SentinelConnectionPool
    )


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://s1:26379",  # no service name
        "redis+sentinel://s1:26379/",
        "redis+sentinel://s1:26379?db=1",
        "redis+sentinel://s1:port/billing",
        "redis+sentinel://s1,/billing",  # an empty member
        "redis+sentinel://s1/billing/zero",
        "redis+sentinel://s1/billing/0/more",
    ],
)
def test_an_invalid_sentinel_url_is_refused(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError):  # the message varies; the CLI shows it
        client_from_url(url)
    assert main(["--redis-url", url, "list"]) == EXIT_USAGE
    assert f"invalid --redis-url '{url}'" in capsys.readouterr().err


def test_the_cli_never_prints_a_sentinel_url_s_passwords(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--redis-url", "redis+sentinel://app:hunter2@s1,s2/billing/x?sentinel_password=swordfish", "list"])
        == EXIT_USAGE
    )
    err = capsys.readouterr().err
    assert "redis+sentinel://app:***@s1,s2/billing/x?sentinel_password=***" in err
    assert "hunter2" not in err and "swordfish" not in err


# Checks at construction -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 101, 1.5, True, "1", None])
def test_min_replicas_must_be_a_whole_number_from_0_to_100(value: Any) -> None:
    expected = f"min_replicas must be a whole number from 0 to 100, got {value!r}"
    with pytest.raises(LeaseConfigError, match=re.escape(f"Leases: {expected}")):
        Leases(redis.Redis(), min_replicas=value)
    with pytest.raises(LeaseConfigError, match=re.escape(f"LeaseMiddleware: {expected}")):
        LeaseMiddleware(redis_url="redis://127.0.0.1:1/0", min_replicas=value)


@pytest.mark.parametrize("value", [0, -5, 0.5, "100"])
def test_the_replica_timeout_is_whole_milliseconds(value: Any) -> None:
    with pytest.raises(
        LeaseConfigError,
        match=re.escape(
            f"Leases: replica_timeout must be a whole number of milliseconds from 1 to 1000000000000, got {value!r}"
        ),
    ):
        Leases(redis.Redis(), min_replicas=1, replica_timeout=value)
    with pytest.raises(
        LeaseConfigError,
        match=re.escape(
            f"LeaseMiddleware: replica_timeout must be a whole number "
            f"of milliseconds from 1 to 1000000000000, got {value!r}"
        ),
    ):
        LeaseMiddleware(redis_url="redis://127.0.0.1:1/0", min_replicas=1, replica_timeout=value)


def test_min_replicas_needs_a_replica_timeout_under_the_socket_timeout_and_no_cluster() -> None:
    assert Leases(redis.Redis(), min_replicas=2.0).min_replicas == 2  # type: ignore[arg-type]  # a whole float is taken
    assert Leases(redis.Redis(socket_timeout=0.3)).min_replicas == 0  # not asked: nothing to check
    with pytest.raises(
        LeaseConfigError,
        match=re.escape(
            "Leases: replica_timeout must be shorter than the Redis client's socket_timeout (0.5 s), got 500"
        ),
    ):
        Leases(redis.Redis(socket_timeout=0.5), min_replicas=1)
    assert Leases(redis.Redis(socket_timeout=0.5), min_replicas=1, replica_timeout=400).replica_timeout == 400
    cluster = RedisCluster.__new__(RedisCluster)  # never connected: refused before it is used
    with pytest.raises(LeaseConfigError, match="min_replicas is not available with RedisCluster"):
        Leases(cluster, min_replicas=1)


# min_replicas on a primary and its replica -----------------------------------------------------------------


@pytest.mark.parametrize("thread_connections", [False, True], ids=["pooled", "per-thread"])
def test_a_grant_counts_once_a_replica_acknowledged_it(replicated: Replicated, thread_connections: bool) -> None:
    primary, replica = replicated.node(replicated.primary_port), replicated.node(replicated.replica_port)
    leases = Leases(
        replicated.node(replicated.primary_port),
        thread_connections=thread_connections,
        min_replicas=1,
        replica_timeout=TIMEOUT_MS,
    )
    held = grant(leases, "invoice:1")
    other = grant(leases, "invoice:2", ttl=20_000)  # another TTL: renewed by a second script call
    handed = grant(leases, "invoice:3")
    # WAIT answered only once the replica had applied the grant.
    assert replica.hget(leases.lease_name("invoice:1"), "token") == held.token.encode()

    replicated.cut()
    started = time.monotonic()
    with pytest.raises(LeaseUnavailableError) as refused:
        leases.try_acquire("invoice:4", 30_000)
    assert time.monotonic() - started >= TIMEOUT_MS / 1000, "WAIT waited for its timeout"
    assert str(refused.value) == refusal("acquire", "invoice:4")
    assert refused.value.key == "invoice:4"
    assert not primary.exists(leases.lease_name("invoice:4")), "the untrusted grant was released"
    # A busy answer grants nothing: nothing to distrust.
    busy = leases.try_acquire("invoice:1", 30_000)
    assert isinstance(busy, Busy) and busy.fence == held.fence

    # Renewals reach the primary, but none is confirmed: the local deadlines run on.
    deadlines = held.valid_until, other.valid_until
    assert leases.renew_many([held, other]) == [Renewal.ERROR, Renewal.ERROR]
    assert (held.valid_until, other.valid_until) == deadlines
    primary.delete(leases.lease_name("invoice:2"))
    assert leases.renew_many([held, other]) == [Renewal.ERROR, Renewal.GONE], "a lease found gone is lost as ever"

    with pytest.raises(LeaseUnavailableError) as refused:
        leases.adopt("invoice:3", handed.token, 30_000)
    assert str(refused.value) == refusal("adopt", "invoice:3")
    assert not primary.exists(leases.lease_name("invoice:3")), "the untrusted adoption was released"

    replicated.heal()
    assert leases.renew(held) is Renewal.OK
    assert held.valid_until > deadlines[0]
    taken = int(primary.hget(leases.fence_name("invoice:4"), "fence") or 0)
    assert taken > 0, "the refused grant took a fence"
    assert grant(leases, "invoice:4").fence > taken


def test_a_lease_whose_renewals_no_replica_acknowledges_is_lost_at_its_deadline(replicated: Replicated) -> None:
    primary = replicated.node(replicated.primary_port)
    leases = Leases(replicated.node(replicated.primary_port), min_replicas=1, replica_timeout=50)
    lease = grant(leases, "report:1", ttl=600)  # renewed every 200 ms
    # The deadline it had when it was declared lost (after which remaining() reads 0).
    lost: queue.SimpleQueue[tuple[float, LostReason, float]] = queue.SimpleQueue()
    heartbeat = Heartbeat(leases)
    heartbeat.track(lease, lambda lease, reason: lost.put((lease.valid_until, reason, time.monotonic())))
    try:
        wait_for(lambda: lease.valid_until > time.monotonic() + 0.5, what="a confirmed renewal")
        replicated.cut()
        cut_at = time.monotonic()
        deadline, reason, lost_at = lost.get(timeout=10)
        assert reason is LostReason.UNREACHABLE
        assert deadline <= lost_at, "not lost before its deadline"
        assert deadline <= cut_at + 0.54, "no renewal made during the cut extended it"
        assert lease.remaining() == 0
        # The primary had renewed the key all along: nobody else could take it while its holder trusted it.
        assert primary.pttl(leases.lease_name("report:1")) > 0
    finally:
        heartbeat.stop()


# Sentinel: the middleware end to end ------------------------------------------------------------------------


def test_lease_middleware_through_sentinel_with_min_replicas(
    sentinels: Replicated, redis_server: EmbeddedRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    # The URL form, and the CLI's --redis-url.
    by_url = LeaseMiddleware(redis_url=sentinels.url(0), metrics_endpoint=False).leases
    shown = grant(by_url, "export:9")
    assert main(["--redis-url", sentinels.url(0), "list", "--json"]) == EXIT_OK
    assert [row["key"] for row in json.loads(capsys.readouterr().out)] == ["export:9"]
    assert by_url.release(shown)

    # client=Sentinel(...).master_for(...), as the README shows it.
    middleware = LeaseMiddleware(
        client=sentinels.master_client(), min_replicas=1, replica_timeout=TIMEOUT_MS, metrics_endpoint=False
    )
    stack = Stack(redis_server.url(0), "", middleware=middleware)
    ran: list[tuple[int, int]] = []

    @stack.actor(lock_key="invoice:{invoice_id}", lock_ttl=5_000)
    def bill(invoice_id: int) -> None:
        lease = current_lease()
        assert lease is not None
        ran.append((invoice_id, lease.fence))

    stack.start()
    try:
        first = bill.send(1)
        assert stack.recorder.wait_settled(first.message_id) == "acked"
        assert [n for n, _ in ran] == [1]

        sentinels.cut()
        second = bill.send(2)
        wait_for(lambda: len(stack.recorder.delays(second.message_id)) >= 2, what="the message sent back twice")
        assert [n for n, _ in ran] == [1], "no grant without the replica's acknowledgement"
        sentinels.heal()
        assert stack.recorder.wait_settled(second.message_id) == "acked"
        # Each refused grant took a fence, then was released; the message was sent back after each.
        assert [n for n, _ in ran] == [1, 2] and ran[1][1] > ran[0][1]
        assert len(stack.recorder.delays(second.message_id)) >= 2
    finally:
        stack.stop()


# Sentinel: a real failover -----------------------------------------------------------------------------------


def eventually(call: Callable[[], T], failures: list[Exception], timeout: float = 10.0) -> T:
    """``call()`` until it does not raise LeaseUnavailableError (each failure kept in ``failures``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except LeaseUnavailableError as e:
            failures.append(e)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.system
def test_a_failover_loses_unreplicated_grants_unless_min_replicas(sentinels: Replicated) -> None:
    """SIGKILL the primary after grants its replica never received; the Sentinels promote the replica. Without
    the failover grace (next test): what the store alone promises."""
    # As LeaseMiddleware uses them: a client= from Sentinel, per-thread connections. The others: the URL form.
    workers = Leases(sentinels.master_client(), thread_connections=True, failover_grace=0)
    timed = Leases.from_url(sentinels.url(0), fence_retention=DAY_MS, failover_grace=0)  # expires when idle
    plain = Leases.from_url(sentinels.url(0), failover_grace=0)
    acked = Leases.from_url(sentinels.url(0), min_replicas=1, replica_timeout=TIMEOUT_MS, failover_grace=0)

    # Replicated before the cut: three grants of each key, and one lease acknowledged by the replica, held
    # across the failover.
    for _ in range(3):
        assert workers.release(grant(workers, "invoice:1"))
        assert timed.release(grant(timed, "invoice:2"))
    kept = grant(acked, "invoice:6")
    sentinels.wait_in_sync()

    sentinels.cut()
    first = grant(workers, "invoice:1")
    first_timed = grant(timed, "invoice:2")
    with pytest.raises(LeaseUnavailableError) as refused:
        acked.try_acquire("invoice:5", 30_000)
    assert str(refused.value) == refusal("acquire", "invoice:5")
    # Two holders whose renewals go through a heartbeat: one outlasts the failover, one does not.
    long_lived = grant(plain, "report:3", ttl=20_000, interval=1_000)
    short_lived = grant(plain, "report:4", ttl=300)  # promotion takes seconds (down-after alone: 1 s)
    # Each loss with the deadline its lease had then (after which remaining() reads 0).
    lost: queue.SimpleQueue[tuple[str, LostReason, float, float]] = queue.SimpleQueue()
    heartbeat = Heartbeat(plain)
    for lease in (long_lived, short_lived):
        heartbeat.track(lease, lambda lease, reason: lost.put((lease.key, reason, time.monotonic(), lease.valid_until)))
    try:
        sentinels.kill_primary()
        killed_at = time.monotonic()
        sentinels.wait_promoted()

        replica = sentinels.node(sentinels.replica_port)
        for key in ("invoice:1", "invoice:2", "report:3", "report:4", "invoice:5"):
            assert not replica.exists(plain.lease_name(key)), f"{key}: granted during the cut, lost with the primary"
        assert replica.exists(plain.lease_name("invoice:6")), "acknowledged by the replica: it survived"

        # A double grant: the first holder still trusts its lease when the new primary grants the key again.
        failures: list[Exception] = []
        second = eventually(lambda: grant(workers, "invoice:1"), failures)
        assert len(failures) <= 1, f"a per-thread connection follows the failover at its next call: {failures}"
        assert first.remaining() > 0 and second.remaining() > 0
        # The new primary's counter missed the last grant; fences from the server's clock are larger than every
        # fence granted before all the same, lost or not, with or without a retention.
        assert second.fence > first.fence
        second_timed = grant(timed, "invoice:2")
        assert second_timed.fence > first_timed.fence
        assert first_timed.remaining() > 0, "a double grant all the same: only the fence tells them apart"

        # What the first holders see: the key re-owned (stolen) or gone, or Redis silent past their deadline.
        assert workers.renew(first) is Renewal.STOLEN
        losses = {key: (reason, at, until) for key, reason, at, until in (lost.get(timeout=15) for _ in range(2))}
        # A TTL shorter than the failover (its deadline passed with no primary to ask): lost at that deadline.
        reason, at, until = losses["report:4"]
        assert until < killed_at + 0.3
        assert reason is LostReason.UNREACHABLE and at >= until, "lost at its local deadline"
        # A TTL longer than the failover: lost at its first renewal on the new primary, before its deadline.
        reason, at, until = losses["report:3"]
        assert reason is LostReason.GONE and killed_at < at < until

        # min_replicas: the acknowledged lease is still held, the refused grant was never anyone's; and with
        # no replica left, every grant is refused until one is attached again.
        busy = plain.try_acquire("invoice:6", 30_000)
        assert isinstance(busy, Busy) and busy.fence == kept.fence
        assert grant(plain, "invoice:5").fence > kept.fence  # never granted before: a fence above all the same
        with pytest.raises(LeaseUnavailableError) as refused:
            acked.try_acquire("invoice:7", 30_000)
        assert str(refused.value) == refusal("acquire", "invoice:7")
    finally:
        heartbeat.stop()


@pytest.mark.system
@pytest.mark.parametrize("grace", [0, 14_000])
def test_after_a_failover_the_key_waits_until_a_cut_off_holder_stopped(sentinels: Replicated, grace: int) -> None:
    """A holder renews on the primary only (replication cut, 5 s), then loses it: it can reach no other server and
    stops at its deadline. The promoted replica has the holder's lease from before the cut, expiring seconds
    before that deadline. With the failover grace (the default, here 14 s over a 10 s TTL) the key waits on the
    new primary until the holder stopped; without it (the control), a contender runs beside the holder."""
    holder = Leases(sentinels.node(sentinels.primary_port, socket_timeout=0.5), failover_grace=grace)
    contender = Leases.from_url(sentinels.url(0), socket_timeout=0.5, failover_grace=grace)
    lease = grant(holder, "job:1", ttl=10_000, interval=1_000)
    lost: queue.SimpleQueue[tuple[LostReason, float, float]] = queue.SimpleQueue()
    heartbeat = Heartbeat(holder)
    heartbeat.track(lease, lambda lease, reason: lost.put((reason, time.monotonic(), lease.valid_until)))
    try:
        sentinels.wait_in_sync()  # the replica has the lease and its slot's epoch record
        sentinels.cut()
        replicated_until = lease.valid_until
        wait_for(lambda: lease.valid_until > replicated_until + 5.0, timeout=15, what="renewals the replica missed")
        sentinels.kill_primary()

        # (when asked, the answer) on the new primary; the replica's copy of the lease ends by replicated_until
        # plus the margin (1 s): a busy answer after that is the grace's.
        busy_after_promotion: list[tuple[float, Busy]] = []
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the contender was never granted the key"
            try:
                asked_at = time.monotonic()
                answer = contender.try_acquire("job:1", 10_000)
            except LeaseUnavailableError:  # no primary yet
                time.sleep(0.1)
                continue
            if isinstance(answer, Lease):
                break
            if answer is not None:
                busy_after_promotion.append((asked_at, answer))
            time.sleep(0.1)
        reason, noticed_at, until = lost.get(timeout=30)
        assert reason is LostReason.UNREACHABLE and noticed_at >= until  # it trusted its lease to its deadline
        assert answer.fence > lease.fence
        if grace:
            assert asked_at >= until, f"granted {until - asked_at:.2f} s before the holder's deadline"
            assert any(at > replicated_until + 1.5 for at, _ in busy_after_promotion), "no busy answer of the grace"
            assert all(0 < busy.ttl_left <= grace for _, busy in busy_after_promotion)
        else:
            assert asked_at < until, "the control: the new primary granted the key while the holder ran"
    finally:
        heartbeat.stop()
