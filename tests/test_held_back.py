"""A key held back by its holder: ``Leases.release(hold=)``, ``Line.hold_back`` and, in an actor,
``raise RateLimited(retry_after=MS)`` (``middleware/held_back.py``). Real Redis; real Dramatiq workers on both
brokers.

Grant and hold times are read from the fences and the key's history (the Redis server's clock), so every
check is on the times the scripts decided with, whatever this machine's speed.
"""

from __future__ import annotations

import json
import pickle
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from prometheus_client import CollectorRegistry

from dramatiq_leases import PrometheusMetrics, RateLimited, current_lease
from dramatiq_leases.cli import main
from dramatiq_leases.core import Busy, Lease, LeaseConfigError, Leases
from dramatiq_leases.core.protocol import Turn
from dramatiq_leases.embedded import EmbeddedRedis

from .support.brokers import BROKERS, RABBITMQ_URL, delete_rabbitmq_queues, unique_queue
from .support.runs import Runs
from .support.stack import Stack
from .support.waiting import wait_for

# --- the store ------------------------------------------------------------------------------------------------


def test_a_hold_keeps_every_slot_of_the_key_free_until_it_ends(redis_client: redis.Redis) -> None:
    """No grant of any slot of the key during the hold, each refusal busy for the rest of it; then granted
    again, by the plain path too (the hold is forgotten at the first grant after it)."""
    leases = Leases(redis_client, prefix="t")
    a = leases.try_acquire("k", 10_000, limit=3)
    b = leases.try_acquire("k", 10_000, limit=3)
    assert isinstance(a, Lease) and isinstance(b, Lease)
    assert leases.release(a, hold=400)
    refusals = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = leases.try_acquire("k", 10_000, limit=3)
        if isinstance(got, Lease):
            break
        assert isinstance(got, Busy) and 0 < got.ttl_left <= 400
        refusals += 1
        time.sleep(0.02)
    assert isinstance(got, Lease) and refusals > 0
    released_ms = int(redis_client.hget("t:fence:{k}", "released_ms") or 0)
    assert got.fence // 1000 >= released_ms + 400  # not before the hold's end, on the server's clock
    assert redis_client.hget("t:fence:{k}", "hold_until") is None
    for lease in (b, got):
        assert leases.release(lease)
    assert isinstance(leases.try_acquire("k", 10_000), Lease)


def test_only_its_holder_holds_a_key_back(redis_client: redis.Redis) -> None:
    """A release by a token that no longer holds the key touches nothing: no hold, no place."""
    leases = Leases(redis_client, prefix="t")
    lease = leases.try_acquire("k", 10_000)
    assert isinstance(lease, Lease) and leases.release(lease)
    assert not leases.release(lease, hold=60_000)
    assert not leases.line.hold_back("k", lease.token, hold=60_000, waiter="m:0", fence=lease.fence)
    assert redis_client.hget("t:fence:{k}", "hold_until") is None
    assert redis_client.exists("t:line:{k}") == 0
    assert isinstance(leases.try_acquire("k", 10_000), Lease)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "500", 86_400_001])
def test_a_bad_hold_is_refused_before_redis_is_asked(redis_client: redis.Redis, bad: Any) -> None:
    leases = Leases(redis_client, prefix="t")
    lease = leases.try_acquire("k", 10_000)
    assert isinstance(lease, Lease)
    with pytest.raises(LeaseConfigError, match="hold"):
        leases.release(lease, hold=bad)
    with pytest.raises(LeaseConfigError, match="retry_after"):
        RateLimited(bad)
    assert leases.holders("k")[0].fence == lease.fence  # still held: nothing was asked


def test_an_operator_cannot_hold_a_key_back(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t")
    lease = leases.try_acquire("k", 10_000)
    assert isinstance(lease, Lease)
    with pytest.raises(LeaseConfigError, match="only the holder"):
        leases.release_token("k", lease.token, by="ops@host", hold=1000)


def test_the_held_back_waiter_goes_first_once_the_hold_ends(redis_client: redis.Redis) -> None:
    """Its place is the head of the line, ahead of waiters that joined long before; it lapses if it never
    comes back (promote_ms after the hold), so a lost message cannot hold the line."""
    leases = Leases(redis_client, prefix="t", history=50)
    holder = leases.try_acquire("k", 10_000)
    assert isinstance(holder, Lease)
    early = leases.line.join("k", 10_000, token="t1", waiter="early:0", first_ms=1, may_wait=False, joins=True)
    assert isinstance(early, Busy)
    assert leases.line.hold_back("k", holder.token, hold=300, waiter="held:0", fence=holder.fence, promote_ms=500)
    assert redis_client.zrange("t:line:{k}", 0, -1) == [b"held:0", b"early:0"]
    time.sleep(0.35)
    assert isinstance(leases.line.join("k", 10_000, token="t2", waiter="early:0", may_wait=False, joins=True), Busy)
    got = leases.line.join("k", 10_000, token="t3", waiter="held:0", first_ms=1, may_wait=False, joins=True)
    assert isinstance(got, Lease)
    events = [(e.event, e.reason, e.waiter) for e in leases.history("k")]
    assert ("rate_limited", "hold 300 ms", "held:0") in events
    assert leases.release(got)
    # Held back again, by a message that never comes back: once the hold ends its turn comes, and its place
    # lapses when it does not show up within promote_ms, as any waiter's called forward.
    again = leases.line.join("k", 10_000, token="t4", waiter="early:0", may_wait=False, joins=True)
    assert isinstance(again, Lease)
    assert leases.line.hold_back("k", again.token, hold=100, waiter="gone:0", fence=again.fence, promote_ms=200)

    def late() -> Lease | Turn:
        return leases.line.join("k", 10_000, token="t5", waiter="late:0", may_wait=False, joins=True, promote_ms=200)

    assert isinstance(late(), Turn)
    wait_for(lambda: isinstance(late(), Lease), timeout=10, what="the lapsed place to let the next waiter in")


def test_show_tells_a_key_is_held_back_and_when_it_may_start(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis
) -> None:
    """``show KEY`` on a held-back key: its line (the held-back message at its head) waits for the hold, not for
    a holder, and says when the next start may be."""
    leases = Leases(redis.Redis.from_url(redis_server.url(0)))
    lease = leases.try_acquire("vendor:acme", 10_000)
    assert isinstance(lease, Lease)
    assert leases.line.hold_back("vendor:acme", lease.token, hold=60_000, waiter="m:0", fence=lease.fence)
    assert main(["--redis-url", redis_server.url(0), "show", "vendor:acme"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"head m:0; oldest waiting .*; waiting for rate: next start in 5\d{4} ms", out), out
    assert main(["--redis-url", redis_server.url(0), "show", "vendor:acme", "--json"]) == 0
    line = json.loads(capsys.readouterr().out)["line"]
    assert line["waiting_for"] == "rate" and 55_000 < line["next_start_ms"] <= 60_000


def test_no_key_of_a_hold_lives_without_ttl(redis_client: redis.Redis) -> None:
    """With a fence retention, every key the hold writes ends: the counter lives at least as long as the hold."""
    leases = Leases(redis_client, prefix="t", fence_retention=1_000)
    lease = leases.try_acquire("k", 10_000)
    assert isinstance(lease, Lease)
    assert leases.line.hold_back("k", lease.token, hold=5_000, waiter="m:0", fence=lease.fence)
    for name in redis_client.keys("t:*"):
        text = name.decode() if isinstance(name, bytes) else name
        if not text.startswith("t:epoch:"):  # a slot's epoch record is kept for ever (lua/prelude.lua's epoch)
            assert redis_client.pttl(name) > 0, name
    assert redis_client.pttl("t:fence:{k}") > 4_000


def test_retry_after_reads_an_http_header() -> None:
    assert RateLimited.after_header("30").retry_after == 30_000
    assert RateLimited.after_header("Wed, 21 Oct 2015 07:28:30 GMT", now=1445412480.0).retry_after == 30_000
    assert RateLimited.after_header(None, default=2_000).retry_after == 2_000
    assert RateLimited.after_header("soon").retry_after == 1_000
    assert RateLimited.after_header("0").retry_after == 1
    assert RateLimited.after_header(str(10**9)).retry_after == 86_400_000
    error = pickle.loads(pickle.dumps(RateLimited(1500)))
    assert error.retry_after == 1500 and str(error) == "rate limited: retry after 1500 ms"


# --- in an actor -----------------------------------------------------------------------------------------------


@pytest.fixture(params=BROKERS)
def stack(request: pytest.FixtureRequest, redis_server: EmbeddedRedis) -> Iterator[Stack]:
    """A worker of 4 threads on each broker, leases in database 1 with a history."""
    options: dict[str, Any] = {
        "metrics": PrometheusMetrics(registry=CollectorRegistry()),
        "metrics_endpoint": False,
        "history": 100,
    }
    if request.param == "rabbitmq":
        queue = unique_queue("held-back")
        s = Stack("", redis_server.url(1), broker=RabbitmqBroker(url=RABBITMQ_URL), **options)
        s.queue = queue  # type: ignore[attr-defined]
    else:
        s = Stack(redis_server.url(0), redis_server.url(1), **options)
        s.queue = "default"  # type: ignore[attr-defined]
    yield s
    s.stop()
    if request.param == "rabbitmq":
        delete_rabbitmq_queues(s.queue)  # type: ignore[attr-defined]


def not_run(stack: Stack, actor: str, queue: str, reason: str) -> float:
    registry = stack.leases_mw.metrics._registry  # type: ignore[attr-defined]
    labels = {"actor_name": actor, "queue_name": queue, "reason": reason}
    return registry.get_sample_value("dramatiq_lease_not_run_total", labels) or 0.0


@pytest.mark.parametrize("limit", [1, 2])
def test_rate_limited_holds_the_key_back_and_runs_again_first_without_a_retry(stack: Stack, limit: int) -> None:
    """The vendor said 429: no message of the key starts during the hold (none of its slots), the message that
    raised runs again first once it ends, acknowledged, its retry untouched (``max_retries=0``)."""
    runs = Runs()
    raised = threading.Event()
    queue: str = stack.queue  # type: ignore[attr-defined]

    @stack.actor(queue_name=queue, lock_key="vendor:{tenant}", lock_limit=limit, max_retries=0)
    def call_vendor(tenant: str, n: int) -> None:
        runs.add(kind="start", n=n, fence=current_lease().fence)
        if n == 0 and not raised.is_set():
            raised.set()
            raise RateLimited(retry_after=800)
        if n == 0:
            time.sleep(0.2)  # holds its slot a moment: the others start behind it, not beside it

    stack.start()
    first = call_vendor.send("acme", 0)
    assert raised.wait(20)
    others = [call_vendor.send("acme", n) for n in range(1, 4)]
    for message in [first, *others]:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    [held] = [e for e in stack.leases.history("vendor:acme") if e.event == "rate_limited"]
    assert held.reason == "hold 800 ms" and held.waiter == f"{first.message_id}:0"
    starts = runs.where(kind="start")
    again = [r for r in starts if r["n"] == 0][1]
    later = [r for r in starts if r["n"] != 0]
    assert len(later) == 3
    # Nothing started during the hold (server µs), and the held-back message started among the first after it
    # (first of all with one slot; with two, the line's first two go together).
    assert all(int(r["fence"]) // 1000 >= held.time_ms + 800 for r in [again, *later])
    assert sum(int(r["fence"]) < int(again["fence"]) for r in later) < limit
    assert not_run(stack, "call_vendor", queue, "rate_limited") == 1
    assert not stack.recorder.nacked
    assert all(opts.get("retries", 0) == 0 for _, _, opts in stack.recorder.enqueues)


def test_rate_limited_with_a_rate_waits_for_both(stack: Stack) -> None:
    """With ``lock_rate`` the hold adds to the rate: each start waits for both, and the rate still holds."""
    runs = Runs()
    queue: str = stack.queue  # type: ignore[attr-defined]
    raised = threading.Event()

    @stack.actor(queue_name=queue, lock_key="vendor:{tenant}", lock_rate="2/s", max_retries=0)
    def call_vendor(tenant: str, n: int) -> None:
        runs.add(kind="start", n=n, fence=current_lease().fence)
        if n == 1 and not raised.is_set():
            raised.set()
            raise RateLimited(retry_after=600)

    stack.start()
    messages = [call_vendor.send("acme", n) for n in range(5)]
    for message in messages:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    fences = sorted(int(r["fence"]) for r in runs.where(kind="start"))
    assert len(fences) == 6  # five messages, one of them twice
    assert all(b - a >= 500_000 for a, b in zip(fences, fences[2:]))  # at most 2 in any second
    [held] = [e for e in stack.leases.history("vendor:acme") if e.event == "rate_limited"]
    assert all(f // 1000 >= held.time_ms + 600 for f in fences if f // 1000 > held.time_ms)


def test_rate_limited_in_an_async_actor(stack: Stack) -> None:
    """An async actor raises it through Dramatiq's event loop: the same hold, the same second run."""
    from dramatiq.middleware import AsyncIO

    stack.broker.add_middleware(AsyncIO())
    runs = Runs()
    queue: str = stack.queue  # type: ignore[attr-defined]

    @stack.actor(queue_name=queue, lock_key="vendor:{tenant}", max_retries=0)
    async def call_vendor(tenant: str) -> None:
        runs.add(kind="start")
        if runs.count(kind="start") == 1:
            raise RateLimited(retry_after=300)

    stack.start()
    message = call_vendor.send("acme")
    wait_for(lambda: runs.count(kind="start") == 2, timeout=30, what="the second run")
    assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    assert [e.event for e in stack.leases.history("vendor:acme")].count("rate_limited") == 1
