"""``release --if-dead``: it never frees a holder cut off from Redis but still running (a real Worker behind a
proxy that hangs, tests/support/freezable.py), and the fence counter: the release is recorded (the exporter tells
a release from an expiry by it) and no key is left without a TTL, whatever the fleet's retention, which the CLI
does not know. Real Redis, real expiry, the command through its ``main()``."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from dramatiq_leases import (
    LeaseLost,
    LeaseMiddleware,
    Leases,
)
from dramatiq_leases.cli import main
from dramatiq_leases.core import Lease, State
from dramatiq_leases.core.keys import epoch_name
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.exporter.observer import Ending, grant_ending

from .support.freezable import FreezableProxy
from .support.runs import Runs
from .support.stack import Stack
from .support.waiting import wait_for

RETENTION_MS = 300
KEY = "invoice:7"
META = {"actor": "send_invoice", "queue": "default", "message_id": "msg-1", "host": "web-7", "pid": "4242"}


def leak(leases: Leases, client: redis.Redis) -> Lease:
    """A lease of ``KEY`` whose TTL was removed by hand, once its holder's deadline (0.9 s on) has passed."""
    lease = leases.try_acquire(KEY, 1_000, interval=300, meta=META)
    assert isinstance(lease, Lease), lease
    client.persist(leases.lease_name(KEY))
    wait_for(
        lambda: (i := leases.inspect(KEY)) is not None and i.state is State.NO_TTL,
        timeout=5,
        what="the holder's deadline to pass",
    )
    return lease


def release_if_dead(capsys: pytest.CaptureFixture[str], server: EmbeddedRedis) -> tuple[int, str, str]:
    code = main(["--redis-url", server.url(), "release", KEY, "--if-dead"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_counter_expired_under_a_long_leak_is_recorded_again_with_a_ttl(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, redis_client: redis.Redis
) -> None:
    """The fleet keeps idle counters for 300 ms; the leak outlives its counter; the CLI, which has no
    retention, releases it. The counter used to be made again without a TTL: kept for ever."""
    fleet = Leases(redis_client, fence_retention=RETENTION_MS)
    lease = leak(fleet, redis_client)
    counter = fleet.fence_name(KEY)
    wait_for(lambda: not redis_client.exists(counter), what="the idle counter to expire during the leak")
    code, out, err = release_if_dead(capsys, redis_server)
    assert (code, err) == (0, ""), err
    assert out.startswith(f"released {KEY!r} (fence {lease.fence}")
    names = list(redis_client.scan_iter(match=f"{fleet.prefix}:*"))
    assert sorted(names) == sorted([counter.encode(), epoch_name(fleet.prefix, KEY).encode()])
    assert all(redis_client.pttl(name) != -1 for name in names if b":epoch:" not in name)  # kept for ever
    assert 0 < redis_client.pttl(counter) <= 3_600_000
    # Recorded as a release, as when the counter is still there: the exporter counts a release.
    assert fleet.fence_state(KEY) == {"released": lease.fence}
    assert grant_ending(lease.fence, fleet.fence_state(KEY)) is Ending.RELEASED


def test_a_counter_still_there_keeps_its_own_ttl(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, redis_client: redis.Redis
) -> None:
    fleet = Leases(redis_client, fence_retention=600_000)
    lease = leak(fleet, redis_client)
    counter = fleet.fence_name(KEY)
    before = redis_client.pttl(counter)
    assert 0 < before <= 600_000
    assert release_if_dead(capsys, redis_server)[0] == 0
    assert 0 < redis_client.pttl(counter) <= before  # neither removed nor lengthened to the hour
    assert fleet.fence_state(KEY) == {"fence": lease.fence, "released": lease.fence}


def test_without_a_retention_the_counter_is_kept_for_ever_as_before(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, redis_client: redis.Redis
) -> None:
    fleet = Leases(redis_client)
    lease = leak(fleet, redis_client)
    assert release_if_dead(capsys, redis_server)[0] == 0
    assert redis_client.pttl(fleet.fence_name(KEY)) == -1
    assert fleet.fence_state(KEY) == {"fence": lease.fence, "released": lease.fence}
    assert fleet.try_acquire(KEY, 1_000).fence > lease.fence


def test_a_store_with_the_retention_records_it_with_its_own(redis_client: redis.Redis) -> None:
    fleet = Leases(redis_client, fence_retention=RETENTION_MS)
    lease = leak(fleet, redis_client)
    counter = fleet.fence_name(KEY)
    wait_for(lambda: not redis_client.exists(counter), what="the idle counter to expire during the leak")
    assert fleet.release_if_dead(KEY).released is True
    assert 0 < redis_client.pttl(counter) <= RETENTION_MS
    assert fleet.fence_state(KEY) == {"released": lease.fence}


def test_a_counter_of_another_type_is_left_alone_and_the_lease_still_released(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis, redis_client: redis.Redis
) -> None:
    """It used to fail after deleting the lease: exit 4, "cannot use Redis", though the lease was gone."""
    fleet = Leases(redis_client)
    leak(fleet, redis_client)
    counter = fleet.fence_name(KEY)
    redis_client.delete(counter)
    redis_client.set(counter, "written by hand")
    code, out, err = release_if_dead(capsys, redis_server)
    assert (code, err) == (0, ""), err
    assert out.startswith(f"released {KEY!r}")
    assert redis_client.exists(fleet.lease_name(KEY)) == 0
    assert redis_client.get(counter) == b"written by hand"


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
