"""The failover grace (``Leases(failover_grace=MS)``, on by default): once the server's replication id changed
under the records it kept (a replica promoted, a restart from a snapshot), no key of a Cluster slot is granted,
nor a handed-over lease adopted, until the grace has passed from the slot's first grant asked since. Real
servers. A change is made real (a restart from a snapshot, a replica promoted) or written into the slot's
epoch record by hand (its id set to one the server never had), as a promoted replica's record would read.
A real Sentinel failover with a cut-off holder: tests/test_replication.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from dramatiq_leases import Busy, Leader, Lease, LeaseConfigError, Leases, current_lease
from dramatiq_leases.core.keys import epoch_name
from dramatiq_leases.core.protocol import Turn, Wait
from dramatiq_leases.embedded import EmbeddedRedis

from .support.stack import MakeStack
from .support.waiting import wait_for

TTL = 5_000
GRACE = 3_000


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as started:
        yield started


@pytest.fixture
def client(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis(port=server.port, socket_timeout=2)
    yield client
    client.close()


def in_the_slot_of(key: str) -> str:
    """Another key in the same Cluster slot as ``key``."""
    slot = key_slot(key.encode())
    return next(k for i in range(1_000_000) if key_slot((k := f"other:{i}").encode()) == slot)


def granted(leases: Leases, key: str, ttl: int = TTL) -> Lease:
    lease = leases.try_acquire(key, ttl)
    assert isinstance(lease, Lease), lease
    return lease


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def lease_or_none(answer: object) -> Lease | None:
    return answer if isinstance(answer, Lease) else None


def change_the_id(client: redis.Redis, key: str, prefix: str = "dramatiq-leases") -> None:
    """The slot's epoch record as a promoted replica would have it: written under another replication id."""
    record = epoch_name(prefix, key)
    written = client.get(record)
    assert written, "the slot's first grant wrote its record"
    client.set(record, b" ".join([b"f" * 40, *written.split()[1:]]))


def test_a_changed_id_holds_every_key_of_its_slot_and_no_other_until_the_grace_passed(client: redis.Redis) -> None:
    leases = Leases(client, failover_grace=GRACE)
    first = granted(leases, "a")
    assert leases.release(first)
    change_the_id(client, "a")
    busy = leases.try_acquire("a", TTL)
    assert isinstance(busy, Busy) and 0 < busy.ttl_left <= GRACE and busy.line == 0
    neighbour = leases.try_acquire(in_the_slot_of("a"), TTL)
    assert isinstance(neighbour, Busy) and neighbour.ttl_left <= busy.ttl_left, "the whole slot waits"
    assert leases.release(granted(leases, "c")), "another slot's record saw no change"
    lease = wait_for(lambda: lease_or_none(leases.try_acquire("a", TTL)), timeout=10)
    assert lease is not None and lease.acquired_at * 1000 >= busy.now_ms + busy.ttl_left, (
        "granted before the grace had passed"
    )
    assert lease.fence > first.fence
    record = client.get(epoch_name("dramatiq-leases", "a"))
    assert isinstance(record, bytes) and not record.startswith(b"f" * 40), "the record names the new id"


def test_without_the_grace_a_changed_id_holds_nothing_back(client: redis.Redis) -> None:
    leases = Leases(client, failover_grace=GRACE)
    assert leases.release(granted(leases, "a"))
    change_the_id(client, "a")
    for off in (Leases(client, failover_grace=0), Leases(client, failover_grace=None)):
        assert off.release(granted(off, "a"))


def test_waiters_keep_their_places_in_the_line_through_the_grace(client: redis.Redis) -> None:
    leases = Leases(client, failover_grace=GRACE)
    assert leases.release(granted(leases, "a"))
    change_the_id(client, "a")
    first = leases.line.join("a", TTL, waiter="m1:0")
    second = leases.line.join("a", TTL, waiter="m2:0")
    assert not isinstance(first, Lease) and not isinstance(second, Lease)
    assert (first.place, second.place) == (0, 1) and first.ttl_left <= GRACE
    # Never joining the line: told it is the grace, not that the key is busy for good (skip and fail send back).
    outside = leases.line.join("a", TTL, waiter="m3:0", joins=False)
    assert not isinstance(outside, Lease) and outside.wait is Wait.GRACE
    ends = first.now_ms + first.ttl_left
    wait_for(lambda: server_ms(client) >= ends, timeout=10, what="the grace over")
    assert not isinstance(leases.line.join("a", TTL, waiter="m2:0"), Lease), "the second before the first"
    lease = leases.line.join("a", TTL, waiter="m1:0")
    assert isinstance(lease, Lease) and lease.acquired_at * 1000 >= ends


def test_a_handed_over_lease_is_not_adopted_within_the_grace(client: redis.Redis) -> None:
    """An adoption the store lost leaves the lease under its handed-over token: adopted again, two would hold it."""
    leases = Leases(client, failover_grace=GRACE)
    handed = granted(leases, "a", ttl=30_000)
    change_the_id(client, "a")
    refused = leases.adopt("a", handed.token, TTL)
    assert isinstance(refused, Turn) and refused.wait is Wait.GRACE, "not taken for another holder"
    assert 0 < refused.ttl_left <= GRACE and refused.fence == handed.fence
    adopted = wait_for(lambda: lease_or_none(leases.adopt("a", handed.token, TTL)), timeout=10)
    assert adopted is not None and adopted.fence == handed.fence and adopted.acquired_at == handed.acquired_at


def test_an_epoch_record_of_another_type_is_taken_for_a_change_and_written_again(client: redis.Redis) -> None:
    leases = Leases(client, failover_grace=GRACE)
    assert leases.release(granted(leases, "a"))
    record = epoch_name("dramatiq-leases", "a")
    client.delete(record)
    client.hset(record, "rid", "written by hand")
    busy = leases.try_acquire("a", TTL)
    assert isinstance(busy, Busy) and 0 < busy.ttl_left <= GRACE, "neither granted nor an error"
    assert client.type(record) == b"string"


def test_a_change_seen_later_than_now_holds_the_slot_no_longer_than_the_grace(client: redis.Redis) -> None:
    """The server's clock stepped back after the change was seen: the grace starts again now, not then."""
    leases = Leases(client, failover_grace=GRACE)
    assert leases.release(granted(leases, "a"))
    rid = client.info("replication")["master_replid"]
    client.set(epoch_name("dramatiq-leases", "a"), f"{rid} {server_ms(client) + 86_400_000}")  # seen tomorrow
    busy = leases.try_acquire("a", TTL)
    assert isinstance(busy, Busy) and 0 < busy.ttl_left <= GRACE
    assert wait_for(lambda: lease_or_none(leases.try_acquire("a", TTL)), timeout=10)


def test_a_user_denied_info_is_granted_without_a_grace(server: EmbeddedRedis, client: redis.Redis) -> None:
    """INFO is in ACL's @dangerous: a grant must not fail for it (the guide says such a user has no grace)."""
    client.acl_setuser("app", enabled=True, passwords=["+secret"], keys=["*"], commands=["+@all", "-@dangerous"])
    app = Leases(redis.Redis(port=server.port, username="app", password="secret", socket_timeout=2))
    with pytest.raises(redis.exceptions.NoPermissionError):
        app.client.info("replication")
    client.set(epoch_name("dramatiq-leases", "a"), f"{'f' * 40} 0")  # a change it cannot see
    assert app.release(granted(app, "a"))
    assert app.release(granted(app, "a"))


def test_a_promoted_replica_holds_back_a_slot_it_has_no_record_of() -> None:
    """A record can be missing on the promoted replica (the slot's first grant had not reached it): a server
    promoted since its start (INFO's master_replid2) takes that for a change; one never promoted does not."""
    with EmbeddedRedis() as primary, EmbeddedRedis() as replica:
        promoted = redis.Redis(port=replica.port, socket_timeout=2)
        promoted.replicaof("127.0.0.1", primary.port)
        wait_for(lambda: promoted.info("replication")["master_link_status"] == "up", timeout=10)
        promoted.replicaof("NO", "ONE")
        never = Leases(redis.Redis(port=primary.port, socket_timeout=2), failover_grace=GRACE)
        assert never.release(granted(never, "a"))
        leases = Leases(promoted, failover_grace=GRACE)
        busy = leases.try_acquire("b", TTL)
        assert isinstance(busy, Busy) and 0 < busy.ttl_left <= GRACE
        wait_for(lambda: isinstance(leases.try_acquire("b", TTL), Lease), timeout=10)


@pytest.mark.parametrize("grace", [0, 7_000])
def test_a_restart_from_a_snapshot_waits_the_grace(server: EmbeddedRedis, grace: int) -> None:
    """The server restarts from a snapshot older than a grant (its replication id is new, the slot's epoch
    record from the snapshot names the old one): with the grace, the key waits until the forgotten holder's
    deadline has passed; without it (the control), it is granted again while that holder runs."""
    client = redis.Redis(port=server.port, socket_timeout=2)
    holder = Leases(client, failover_grace=grace)
    contender = Leases(redis.Redis(port=server.port, socket_timeout=2), failover_grace=grace)
    assert holder.release(granted(holder, "job"))
    client.save()  # the snapshot: the key's counter and its slot's epoch record, no lease
    lease = granted(holder, "job", ttl=6_000)
    server.stop()  # no save on shutdown (no save points): the restart loads the snapshot
    server.start()
    answers: list[tuple[float, Busy]] = []
    while True:
        asked_at = time.monotonic()
        got = contender.try_acquire("job", 6_000)
        if isinstance(got, Lease):
            break
        assert isinstance(got, Busy) and time.monotonic() < lease.valid_until + 10
        answers.append((asked_at, got))
        time.sleep(0.05)
    assert got.fence > lease.fence
    if grace:
        assert asked_at >= lease.valid_until, f"granted {lease.valid_until - asked_at:.2f} s before its deadline"
        assert answers and all(0 < busy.ttl_left <= grace for _, busy in answers)
    else:
        assert asked_at < lease.valid_until and not answers


@pytest.mark.parametrize("grace", [0, 1_500])
def test_a_restart_from_a_snapshot_under_a_leader_gives_two_leaders_only_without_the_grace(
    server: EmbeddedRedis, grace: int
) -> None:
    """A leader and its standby (TTL 1.5 s, the standby asking every 20 ms); the server restarts from a
    snapshot taken before the leader's grant. Each side's own record: when the leader last trusted its lease
    (its deadline as it stood at the restart; when it was told of the loss) and when the standby led."""
    leases = Leases.from_url(server.url(0), socket_timeout=0.5, failover_grace=grace)
    probe = redis.Redis(port=server.port, socket_timeout=2)
    assert leases.release(granted(leases, "scheduler"))
    probe.save()  # the slot's epoch record, no lease
    told: list[float] = []
    first = Leader(leases, "scheduler", ttl=1_500, on_lost=lambda lease, reason: told.append(time.monotonic()))
    second = Leader(leases, "scheduler", ttl=1_500, poll=20)
    assert first.wait(timeout=5) and first.lease is not None
    led: list[float] = []
    standby = threading.Thread(target=lambda: led.append(time.monotonic()) if second.wait(timeout=20) else None)
    standby.start()
    deadline = first.lease.valid_until  # it trusts the lease at least this long, whatever happens now
    server.stop()
    server.start()
    standby.join(25)
    wait_for(lambda: told, timeout=10, what="the leader told of its loss")
    first.release()
    second.release()
    assert led, "the standby never led"
    if grace:
        assert led[0] > told[0] and led[0] > deadline, "the standby led while the first still trusted its lease"
    else:
        assert led[0] < deadline, "the control: two leaders"


@pytest.mark.parametrize("value", [-1, 1.5, "1000", True, 10**13])
def test_a_bad_grace_is_refused_naming_it(client: redis.Redis, value: object) -> None:
    with pytest.raises(LeaseConfigError, match=r"Leases: failover_grace must be a whole number"):
        Leases(client, failover_grace=value)  # type: ignore[arg-type]


def test_a_leader_whose_ttl_outlasts_the_grace_is_named_in_a_warning(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dramatiq_leases.leader"):
        Leader(Leases(client, failover_grace=10_000), "scheduler", ttl=10_000)
        assert not caplog.records
        Leader(Leases(client, failover_grace=10_000), "scheduler", ttl=20_000)
    assert [r.getMessage() for r in caplog.records] == [
        "Leader 'scheduler': ttl=20000 is longer than the store's failover_grace=10000: after a failover, a "
        "standby may be granted the key while a leader the store forgot still leads"
    ]


def test_a_message_carrying_a_lease_met_by_the_grace_adopts_it_after_the_grace(make_stack: MakeStack) -> None:
    """Not dropped as "taken by another holder": sent back with its token, and the job adopts the handed lease
    (the grant's fence) once the grace is over."""
    stack = make_stack(failover_grace=GRACE)
    ran: list[tuple[int, float]] = []

    @stack.actor(lock_key="export:{n}", max_retries=0, min_backoff=100, max_backoff=500)
    def export(n: int) -> None:
        ran.append((current_lease().fence, time.monotonic()))

    lease = stack.leases.try_acquire("export:7", ttl=30_000)  # the web request
    assert isinstance(lease, Lease)
    assert isinstance(stack.leases.client, redis.Redis)
    change_the_id(stack.leases.client, "export:7", prefix=stack.leases.prefix)
    refused_at = time.monotonic()
    message = export.send_with_options(args=(7,), lease=lease)
    stack.start()
    assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert len(ran) == 1 and ran[0][0] == lease.fence, "adopted, not granted anew"
    assert ran[0][1] >= refused_at + GRACE / 1000 - 0.1, "ran within the grace"
    assert stack.recorder.delays(message.message_id), "sent back while the grace lasted"
