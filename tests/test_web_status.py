"""``web.status``: what a page polls to know when its Export button may be used again, on a real Redis.

Each state a page shows is read from the same Redis the acquires write: free, a request's lease whose
message is queued, a worker's lease it adopted, a line of waiters, a lease that ended by release or by
TTL, a key held by several at once, and Redis away.
"""

from __future__ import annotations

import math

import pytest

from dramatiq_leases import LeaseUnavailableError, web
from dramatiq_leases.core import Lease, Leases
from dramatiq_leases.embedded import EmbeddedRedis, free_port

from .support.waiting import wait_for

KEY = "export:report:7"
TTL = 30_000


def granted(answer: Lease | web.Locked) -> Lease:
    assert isinstance(answer, Lease), answer
    return answer


def test_a_key_never_held_is_free_and_reading_it_writes_nothing(leases: Leases) -> None:
    assert web.status(leases, KEY) == {
        "key": KEY,
        "free": True,
        "held": False,
        "holders": 0,
        "fence": None,
        "state": None,
        "running": None,
        "message_id": None,
        "heartbeat_age": None,
        "ttl_left": 0.0,
        "retry_after": 0,
        "line_length": 0,
        "last_fence": 0,
        "last": None,
    }
    assert leases.client.dbsize() == 0, "a page polling a key must not create anything in Redis"


def test_a_request_lease_then_its_worker_held_then_released(leases: Leases) -> None:
    lease = granted(web.try_acquire(leases, KEY, TTL))
    queued = web.status(leases, KEY)
    locked = web.try_acquire(leases, KEY, TTL)
    assert isinstance(locked, web.Locked)
    assert queued["free"] is False and queued["held"] is True and queued["holders"] == 1
    assert queued["fence"] == lease.fence == queued["last_fence"] and queued["last"] == "held"
    assert queued["running"] is False, "nobody renews a request's lease: its message is still queued"
    assert queued["message_id"] is None
    assert queued["state"] == "alive"
    assert TTL / 1000 - 1 < queued["ttl_left"] <= TTL / 1000
    # The countdown the page shows after polling is the one a 423 would have started.
    assert queued["retry_after"] == math.ceil(queued["ttl_left"]) == web.retry_after(locked)

    adopted = leases.adopt(KEY, lease.token, 5_000, interval=1_000, meta={"message_id": "m-1"})
    assert isinstance(adopted, Lease)
    running = web.status(leases, KEY)
    assert running["running"] is True and running["fence"] == lease.fence, "adopting keeps the grant's fence"
    assert running["message_id"] == "m-1", "the worker's metadata names the message it runs"
    assert 4 < running["ttl_left"] <= 5 and running["retry_after"] == 5
    assert 0 <= running["heartbeat_age"] < 1

    assert leases.release(adopted)
    done = web.status(leases, KEY)
    assert done["free"] is True and done["held"] is False and done["retry_after"] == 0
    assert (done["last_fence"], done["last"]) == (lease.fence, "released"), "the job ended: its holder let go"


def test_a_lease_nobody_released_reads_expired_once_its_ttl_ran_out(leases: Leases) -> None:
    lease = granted(web.try_acquire(leases, KEY, 400))
    assert web.status(leases, KEY)["held"] is True
    free = wait_for(lambda: (s := web.status(leases, KEY))["free"] and s, timeout=5, what="the lease to expire")
    assert (free["last_fence"], free["last"]) == (lease.fence, "expired"), "its holder vanished: nobody let go"
    again = granted(web.try_acquire(leases, KEY, TTL))
    assert web.status(leases, KEY)["last"] == "held" and again.fence > lease.fence


def test_waiters_in_the_line_make_the_key_not_free_even_once_released(leases: Leases) -> None:
    holder = granted(web.try_acquire(leases, KEY, TTL))
    busy = leases.line.join(KEY, TTL, waiter="m1:0", may_wait=False)  # a worker's message queues on the key
    assert not isinstance(busy, Lease)
    held = web.status(leases, KEY)
    assert held["line_length"] == 1 and held["held"] is True
    assert held["retry_after"] == 1, "a line goes first: come back at once with the ticket to take a place"
    leases.release(holder)
    handing = web.status(leases, KEY)
    assert handing["held"] is False and handing["free"] is False, "the free key goes to the head of its line"
    assert (handing["retry_after"], handing["line_length"], handing["last"]) == (1, 1, "released")
    locked = web.try_acquire(leases, KEY, TTL)
    assert isinstance(locked, web.Locked), "not free: a request without a ticket is answered 423"


def test_a_key_held_by_several_reads_the_holder_that_ends_last(leases: Leases) -> None:
    short = leases.try_acquire(KEY, 5_000, limit=2)
    long = leases.try_acquire(KEY, 20_000, limit=2)
    assert isinstance(short, Lease) and isinstance(long, Lease)
    status = web.status(leases, KEY)
    assert status["holders"] == 2 and status["fence"] == long.fence
    assert 19 < status["ttl_left"] <= 20 and status["retry_after"] == 20
    assert status["last"] == "held"
    leases.release(long)
    leases.release(short)
    status = web.status(leases, KEY)
    assert status["free"] is True
    assert status["last"] is None, "per-slot records: the counter does not say how the last grant ended"


def test_redis_away_raises_unavailable_for_a_503() -> None:
    leases = Leases.from_url(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(LeaseUnavailableError):
        web.status(leases, KEY)


def test_status_of_a_key_without_ttl_never_promises_that_it_ends(redis_server: EmbeddedRedis) -> None:
    store = Leases.from_url(redis_server.url())
    try:
        lease = store.try_acquire("export:report:5", 30_000)
        assert isinstance(lease, Lease)
        store.client.persist("dramatiq-leases:lease:{export:report:5}")
        answer = web.status(store, "export:report:5")
        assert answer["held"] and not answer["free"] and answer["ttl_left"] is None
        assert answer["retry_after"] >= 1  # never "retry now" while it is held
    finally:
        store.client.close()
