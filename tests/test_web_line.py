"""A web caller and the key's line, on a real Redis: the ticket protocol of ``dramatiq_leases.web``.

Workers' messages are played here by ``Leases.try_acquire`` calls with a
waiter id (as the middleware makes them, ``<message id>:<retries>``), so each
step of the line is taken in a known order; ``tests/test_web.py`` runs the
same protocol through the example apps against a real worker.
"""

from __future__ import annotations

import pytest

from dramatiq_leases import web
from dramatiq_leases.core import Busy, Lease, Leases
from dramatiq_leases.core.protocol import Turn

from .support.waiting import wait_for

KEY = "export:report:7"
TTL = 30_000


def hold(leases: Leases, ttl: int = TTL) -> Lease:
    """The job running now (taken by a web request, or a worker that found the key free)."""
    lease = leases.try_acquire(KEY, ttl)
    assert isinstance(lease, Lease)
    return lease


def server_ms(leases: Leases) -> int:
    seconds, micros = leases.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def worker_asks(leases: Leases, waiter: str) -> Lease | Turn:
    """A worker's message asking for the key (it joins the line if busy), as the middleware does.

    In a millisecond of its own: the line orders by first attempt in ms, and ties by name, so a worker asking
    in the same millisecond as the web caller before it would go first (``m`` sorts before ``web:``).
    """
    before = server_ms(leases)
    wait_for(lambda: server_ms(leases) > before, what="the server's clock to pass a millisecond")
    return leases.line.join(KEY, TTL, waiter=waiter, may_wait=False)


def locked(answer: Lease | web.Locked) -> web.Locked:
    assert isinstance(answer, web.Locked), answer
    return answer


def test_without_its_ticket_a_web_caller_takes_no_place_and_is_told_to_take_one(leases: Leases) -> None:
    holder = hold(leases)
    assert not worker_asks(leases, "m1:0")
    answer = locked(web.try_acquire(leases, KEY, TTL))
    assert web.valid_ticket(answer.ticket) == answer.ticket
    assert (answer.place, answer.busy.line) == (-1, 1)
    assert leases.inspect_line(KEY).length == 1, "a request without a ticket leaves nothing in the line"
    # Honest: waiting for the holder's TTL would not help, the line goes first; take a place now.
    assert web.locked_response_headers(answer) == {"Retry-After": "1", web.TICKET_HEADER: answer.ticket}
    body = web.locked_body(answer)
    assert (body["place"], body["line_length"], body["ticket"], body["retry_after"]) == (None, 1, answer.ticket, 1)
    assert "send the ticket back" in body["detail"]

    leases.release(holder)
    # Free, but the line's head goes first: still no key for a caller without a place.
    again = locked(web.try_acquire(leases, KEY, TTL))
    assert again.ticket != answer.ticket and again.busy.line == 1
    assert isinstance(worker_asks(leases, "m1:0"), Lease)


def test_with_its_ticket_a_web_caller_gets_the_key_in_its_turn_while_workers_keep_queueing(leases: Leases) -> None:
    holder = hold(leases)
    assert not worker_asks(leases, "m1:0")
    ticket = locked(web.try_acquire(leases, KEY, TTL)).ticket
    placed = locked(web.try_acquire(leases, KEY, TTL, ticket=ticket))
    assert placed.ticket == ticket and (placed.place, placed.busy.line) == (1, 2)
    assert not worker_asks(leases, "m2:0"), "a worker that came later queues behind the web caller"
    again = locked(web.try_acquire(leases, KEY, TTL, ticket=ticket))
    assert (again.place, again.busy.line) == (1, 3), "asking again keeps the place, and takes no other"

    leases.release(holder)
    first = worker_asks(leases, "m1:0")
    assert isinstance(first, Lease)
    answer = locked(web.try_acquire(leases, KEY, TTL, ticket=ticket))
    assert answer.place == 0
    # The holder's TTL is 30 s, but the key may be released at any moment: come back in time to keep the place.
    assert web.retry_after(answer) == web.KEEP_PLACE_S
    assert web.locked_body(answer)["place"] == 0 and "next in line" in web.locked_body(answer)["detail"]
    assert not worker_asks(leases, "m3:0")

    leases.line.release(KEY, first.token, waiter="m1:0")
    assert not worker_asks(leases, "m2:0"), "the free key waits for its head, the web caller"
    freed = locked(web.try_acquire(leases, KEY, TTL))
    assert freed.place == -1, "and not for a request without a place"
    granted = web.try_acquire(leases, KEY, TTL, ticket=ticket)
    assert isinstance(granted, Lease) and granted.from_line
    line = leases.inspect_line(KEY)
    assert (line.length, line.head) == (2, "m2:0"), "granted while workers still queue, before those behind it"


def test_retry_after_without_a_line_is_the_holders_ttl_as_before(leases: Leases) -> None:
    hold(leases, ttl=60_000)
    answer = locked(web.try_acquire(leases, KEY, TTL))
    assert web.retry_after(answer) == 60
    body = web.locked_body(answer)
    assert body["detail"] == f"A job for {KEY!r} is already running; retry in 60 s."
    assert (body["place"], body["line_length"]) == (None, 0)
    # A caller of Leases.try_acquire itself (no ticket at all) gets the same answers, without a ticket.
    busy = leases.try_acquire(KEY, TTL)
    assert isinstance(busy, Busy)
    assert web.locked_response_headers(busy) == {"Retry-After": "60"}
    assert "ticket" not in web.locked_body(busy)
    assert not worker_asks(leases, "m1:0")
    busy = leases.try_acquire(KEY, TTL)
    assert isinstance(busy, Busy) and web.locked_response_headers(busy) == {"Retry-After": "1"}
    assert "only once the line is empty" in web.locked_body(busy)["detail"]


@pytest.mark.parametrize("forged", ["m1:0", "web:" + "a" * 32, "A" * 32, "a" * 31, "a" * 33, "", "../" + "a" * 32])
def test_anything_but_a_ticket_of_ours_takes_no_place_nor_a_workers(leases: Leases, forged: str) -> None:
    holder = hold(leases)
    assert not worker_asks(leases, "m1:0")
    answer = locked(web.try_acquire(leases, KEY, TTL, ticket=forged))
    assert answer.place == -1 and answer.ticket != forged
    line = leases.inspect_line(KEY)
    assert (line.length, line.head) == (1, "m1:0")
    leases.release(holder)
    assert not isinstance(web.try_acquire(leases, KEY, TTL, ticket=forged), Lease), "the worker's turn is its own"


def test_a_ticket_not_sent_back_loses_its_place_and_the_workers_go_on(leases: Leases) -> None:
    holder = hold(leases)
    ticket = locked(web.try_acquire(leases, KEY, TTL)).ticket
    assert locked(web.try_acquire(leases, KEY, TTL, ticket=ticket)).place == 0
    assert not worker_asks(leases, "m1:0")
    leases.release(holder)
    # The web client went away (tab closed): the free key waits for it 10 s at most, then goes on down the line.
    granted = wait_for(
        lambda: isinstance(r := worker_asks(leases, "m1:0"), Lease) and r,
        timeout=20,
        interval=0.25,
        what="the worker behind a vanished web caller to get the key",
    )
    assert isinstance(granted, Lease)  # for mypy: wait_for returns only a truthy value, here the Lease
    assert granted.from_line
    comeback = locked(web.try_acquire(leases, KEY, TTL, ticket=ticket))
    assert comeback.place == 0 and comeback.ticket == ticket, "back late, it joins again (the line was empty)"
