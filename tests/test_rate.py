"""``lock_rate``: at most N starts of a key in any window, decided in the grant's script (``core/rates.py``,
the ``rate`` section of ``lua/prelude.lua``). Real Redis; the middleware in a real Dramatiq Worker.

Grant times are read from the fences: a fence is the grant's server time in microseconds (or one above the
last), so the windows are checked on the times the script decided with, whatever this machine's speed.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq import Worker
from dramatiq.middleware import Middleware
from prometheus_client import CollectorRegistry

from dramatiq_leases import LeaseOptionError, PrometheusMetrics, current_lease
from dramatiq_leases.cli import main
from dramatiq_leases.core import Busy, Lease, LeaseConfigError, Leases
from dramatiq_leases.core.keys import rate_name
from dramatiq_leases.core.rates import Rate, parse_rate, parse_rates
from dramatiq_leases.embedded import EmbeddedRedis

from .support.runs import Runs
from .support.stack import MakeStack
from .support.waiting import wait_for


def most_in_any_window(times_us: list[int], window_ms: int) -> int:
    """The largest number of ``times_us`` (µs) in any half-open window of ``window_ms``."""
    times, most, first = sorted(times_us), 0, 0
    for last, t in enumerate(times):
        while times[first] <= t - window_ms * 1000:
            first += 1
        most = max(most, last - first + 1)
    return most


@pytest.mark.parametrize(
    ("spec", "rate"),
    [
        ("10/s", Rate(10, 1_000)),
        ("5/10s", Rate(5, 10_000)),
        ("3/500ms", Rate(3, 500)),
        ("5000/d", Rate(5000, 86_400_000)),
    ],
)
def test_a_rate_reads_as_written(spec: str, rate: Rate) -> None:
    assert parse_rate(spec) == rate
    assert parse_rates([spec, "1/h"]) == tuple(sorted({rate, Rate(1, 3_600_000)}))


@pytest.mark.parametrize(
    "bad", ["0/s", "5/0s", "abc", "5/fortnight", "", -1, 5, "5/s ", "1.5/s", [], ["10/s", "x"], ["1/s"] * 5]
)
def test_bad_rates_are_refused_at_declaration_naming_the_actor_and_lock_rate(make_stack: MakeStack, bad: Any) -> None:
    stack = make_stack(metrics=PrometheusMetrics(registry=CollectorRegistry()), metrics_endpoint=False)
    with pytest.raises(LeaseOptionError) as info:

        @stack.actor(actor_name="call_vendor", lock_key="tenant:{tenant}", lock_rate=bad)
        def call_vendor(tenant: str) -> None:
            pass

    assert "actor 'call_vendor'" in str(info.value) and "lock_rate" in str(info.value), info.value
    with pytest.raises(LeaseConfigError, match="rate"):
        parse_rates(bad)


def test_at_most_n_grants_in_any_window_and_the_next_as_soon_as_the_window_allows(redis_client: redis.Redis) -> None:
    """Exact over any window, not per fixed bucket: each grant is checked against the oldest of the last N,
    in the same script. A refusal is busy for exactly as long as the rate says."""
    leases = Leases(redis_client, prefix="t")
    fences: list[int] = []
    deadline = time.monotonic() + 30
    while len(fences) < 12 and time.monotonic() < deadline:  # four windows' worth
        got = leases.try_acquire("k", 10_000, rate="3/300ms")
        if isinstance(got, Lease):
            fences.append(got.fence)
            assert leases.release(got)
        else:
            assert 0 < got.ttl_left <= 300
            time.sleep(got.ttl_left / 1000)
    assert len(fences) == 12
    assert most_in_any_window(fences, 300) == 3
    # Each grant past the first three waited for the one three before it to be a window old, and no longer.
    assert all(fences[i] - fences[i - 3] >= 300_000 for i in range(3, 12))
    ring = rate_name("t", "k", 3, 300)
    assert 0 < redis_client.pttl(ring) <= 301  # kept a window (and a ms) after the last grant, never without a TTL


def test_a_rate_and_a_limit_both_hold(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t")
    held = [leases.try_acquire("k", 10_000, limit=2, rate="3/10s") for _ in range(3)]
    assert [isinstance(h, Lease) for h in held] == [True, True, False]  # the limit
    first = held[0]
    assert isinstance(first, Lease) and leases.release(first)
    third = leases.try_acquire("k", 10_000, limit=2, rate="3/10s")
    assert isinstance(third, Lease)
    assert leases.release(third)
    refused = leases.try_acquire("k", 10_000, limit=2, rate="3/10s")  # a slot is free: the rate refuses
    assert isinstance(refused, Busy) and 9_000 < refused.ttl_left <= 10_000


def test_every_rate_of_a_list_holds(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t")
    granted = 0
    for _ in range(5):
        got = leases.try_acquire("k", 10_000, rate=["4/10s", "2/5s"])
        if isinstance(got, Lease):
            granted += 1
            leases.release(got)
    assert granted == 2  # the stricter of the two, now


def test_a_ring_written_by_hand_is_replaced_and_no_rate_key_lives_without_ttl(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client, prefix="t")
    ring = rate_name("t", "k", 2, 60_000)
    for junk in (lambda: redis_client.hset(ring, "a", 1), lambda: redis_client.set(ring, "abc")):
        redis_client.delete(ring)
        junk()
        got = leases.try_acquire("k", 10_000, rate="2/m")
        assert isinstance(got, Lease), got
        assert leases.release(got)
        assert redis_client.type(ring) == b"string" and 0 < redis_client.pttl(ring) <= 60_001
    assert isinstance(leases.try_acquire("k", 10_000, rate="2/m"), Lease)
    assert isinstance(leases.try_acquire("k", 10_000, rate="2/m"), Busy)  # two grants since the replacement


def test_a_backlog_waits_in_the_line_spends_no_retry_and_starts_at_the_rate(make_stack: MakeStack) -> None:
    """``lock_on_busy="wait"`` (the default): every message runs, none before the rate allows, no retry spent."""
    stack = make_stack(metrics=PrometheusMetrics(registry=CollectorRegistry()), metrics_endpoint=False, threads=4)
    runs = Runs()

    @stack.actor(lock_key="vendor:{tenant}", lock_rate="3/s", max_retries=0)
    def call_vendor(tenant: str, n: int) -> None:
        lease = current_lease()
        assert lease is not None
        runs.add(kind="run", n=n, fence=lease.fence)

    stack.start()
    messages = [call_vendor.send("acme", n) for n in range(9)]
    wait_for(lambda: runs.count(kind="run") == 9, timeout=60, what="every message to run")
    fences = [int(r["fence"]) for r in runs.where(kind="run")]
    assert most_in_any_window(fences, 1_000) == 3
    assert sorted(r["n"] for r in runs.where(kind="run")) == list(range(9))
    for message in messages:
        assert stack.recorder.wait_settled(message.message_id) == "acked"


def test_skip_makes_a_leading_edge_throttle(make_stack: MakeStack) -> None:
    """``lock_rate="1/5s", lock_on_busy="skip"``: the first of a burst runs, the rest are acknowledged at once,
    each counted as skipped."""
    metrics = PrometheusMetrics(registry=CollectorRegistry())
    stack = make_stack(metrics=metrics, metrics_endpoint=False)
    runs = Runs()

    @stack.actor(lock_key="search:{index}", lock_rate="1/5s", lock_on_busy="skip")
    def reindex(index: str, n: int) -> None:
        runs.add(kind="run", n=n)

    stack.start()
    burst = [reindex.send("products", n) for n in range(4)]
    for message in burst:
        assert stack.recorder.wait_settled(message.message_id) == "acked"
    assert runs.count(kind="run") == 1  # whichever of the burst a worker thread took first
    labels = {"actor_name": "reindex", "queue_name": "default", "reason": "skipped"}
    assert metrics._registry.get_sample_value("dramatiq_lease_not_run_total", labels) == 3


def test_a_time_ahead_of_the_clock_holds_the_key_one_window_at_most(redis_client: redis.Redis) -> None:
    """A ring whose times are ahead of the server's clock (the clock stepped back, or written by hand) counts
    them as now: the key waits a window at most, not until the clock catches up."""
    leases = Leases(redis_client, prefix="t")
    ring = rate_name("t", "k", 1, 1_000)
    now_us = int(redis_client.time()[0]) * 1_000_000
    redis_client.set(ring, struct.pack(">d", 1) + struct.pack(">d", now_us + 3_600 * 1_000_000))  # an hour ahead
    refused = leases.try_acquire("k", 10_000, rate="1/s")
    assert isinstance(refused, Busy) and refused.ttl_left <= 1_000
    redis_client.set(ring, struct.pack(">d", 1) + struct.pack(">d", float("inf")))
    refused = leases.try_acquire("k", 10_000, rate="1/s")
    assert isinstance(refused, Busy) and refused.ttl_left <= 1_000
    wait_for(lambda: isinstance(leases.try_acquire("k", 10_000, rate="1/s"), Lease), timeout=5, what="the grant")


def test_over_its_rate_a_key_calls_no_parked_waiter_forward(redis_client: redis.Redis) -> None:
    """While its rate allows no grant, a key with nobody holding it is full: the line's calls and a release
    leave its parked waiters parked (promoted, they would only be refused again, and again), and the rate's
    answer says when to come back."""
    leases = Leases(redis_client, prefix="t")
    first = leases.try_acquire("k", 10_000, rate="1/m")
    assert isinstance(first, Lease)
    parked = leases.line.join("k", 10_000, waiter="w1", rates=parse_rates("1/m"))
    assert isinstance(parked, Busy) and 50_000 < parked.ttl_left <= 60_000
    assert leases.release(first)  # the key is free of holders, and over its rate for a minute
    assert leases.line.hold("k", ["w1"], "channel") == ["p"]  # not promoted
    again = leases.line.join("k", 10_000, waiter="w1", rates=parse_rates("1/m"))
    assert isinstance(again, Busy) and 50_000 < again.ttl_left <= 60_000 and again.place == 0
    assert leases.line.hold("k", ["w1"], "channel") == ["p"]


def test_show_tells_where_a_key_stands_against_its_rates(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis
) -> None:
    """``show KEY``: each rate's starts in its last window and when the next may start, also once its lease is
    gone (a key over its rate, with nobody holding it, is what an operator asks about)."""
    leases = Leases(redis.Redis.from_url(redis_server.url(0)))
    for _ in range(2):
        got = leases.try_acquire("vendor:acme", 10_000, rate=["3/m", "100/d"])
        assert isinstance(got, Lease) and leases.release(got)
    assert main(["--redis-url", redis_server.url(0), "show", "vendor:acme"]) == 0
    out = capsys.readouterr().out
    assert "rate 3/60000 ms: 2 start(s) in the last window; next start now" in out, out
    assert "rate 100/86400000 ms: 2 start(s) in the last window; next start now" in out, out
    assert isinstance(leases.try_acquire("vendor:acme", 10_000, rate=["3/m", "100/d"]), Lease)
    assert main(["--redis-url", redis_server.url(0), "show", "vendor:acme", "--json"]) == 0
    rates = json.loads(capsys.readouterr().out)["rates"]
    assert [(r["count"], r["window_ms"], r["starts"]) for r in rates] == [(100, 86_400_000, 3), (3, 60_000, 3)]
    assert rates[0]["next_start_in_ms"] == 0 and 55_000 < rates[1]["next_start_in_ms"] <= 60_000


class _Moves(Middleware):
    """Each enqueue of a message, when (this machine's ms): a parked copy (its delay and eta) or a copy sent to its
    queue (no delay: the send, or a parked copy leaving its delay queue)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[float, str, int | None, Any]] = []

    def before_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        # Before: a copy can run, and the test look, before the sender's after-hooks.
        with self.lock:
            self.items.append((time.time() * 1000, message.message_id, delay, message.options.get("eta")))

    def told(self) -> str:
        """The enqueues, for a failure's message: ms since the first, message id, delay, eta (ms since the first)."""
        with self.lock:
            t0 = self.items[0][0] if self.items else 0.0
            return "; ".join(
                f"{at - t0:.0f} {mid[:8]} delay={delay} eta={eta - t0 if eta else None}"
                for at, mid, delay, eta in self.items
            )


def test_the_head_parked_until_the_rate_allows_is_sent_on_then_whatever_the_worker_timeout(
    make_broker_stack: MakeStack,
) -> None:
    """The head of a key's line parked until the rate allows one more start (no place to wait in place) is asked
    back by no one: no release or grant calls it forward while the key is over its rate. Its copy is sent to its
    queue within 250 ms of that instant, not at the next look of Dramatiq's delay-queue consumer, which backs off
    to ``worker_timeout`` when idle (1 s here, Dramatiq's default); and it starts once the rate allows, not before.
    On each broker."""
    stack = make_broker_stack()
    moves = _Moves()
    stack.broker.add_middleware(moves)
    runs = Runs()

    @stack.actor(lock_key="vendor:{tenant}", lock_rate="1/2s", max_retries=0)
    def call_vendor(tenant: str, n: int) -> None:
        lease = current_lease()
        assert lease is not None
        runs.add(kind="run", n=n, fence=lease.fence)

    @stack.actor(lock_key="other:{n}", max_retries=0)
    def other(n: int) -> None:
        runs.add(kind="other", n=n)

    # Two threads: the one place to wait in place (a process's half) is taken by a waiter of another key, held
    # here, so the vendor's head finds none and parks.
    stack.broker.emit_after("process_boot")
    stack.worker = Worker(stack.broker, worker_threads=2, worker_timeout=1_000)
    stack.worker.start()
    held = stack.leases.try_acquire("other:1", 20_000)
    assert isinstance(held, Lease)
    other.send(1)
    wait_for(lambda: stack.leases_mw.waiting.in_place == 1, what="a waiter of the other key in place")
    first = call_vendor.send("acme", 0)
    assert stack.recorder.wait_settled(first.message_id) == "acked"  # ran; the key is over its rate for 2 s
    wait_for(lambda: not stack.leases.holders("vendor:acme"), what="its lease to be released")
    head = call_vendor.send("acme", 1)
    wait_for(lambda: runs.count(kind="run") == 2, timeout=30, what="the head to run")
    granted = sorted(int(r["fence"]) for r in runs.where(kind="run"))
    assert granted[1] - granted[0] >= 2_000_000, granted
    parks = [(at, eta) for at, mid, delay, eta in moves.items if mid == head.message_id and delay]
    assert parks and parks[0][1] - parks[0][0] < 2_100, moves.told()  # parked until the rate allows
    parked_at, eta = parks[0]
    back = [at for at, mid, delay, _ in moves.items if mid == head.message_id and delay is None and at > parked_at]
    assert back and back[0] - eta <= 250, moves.told()  # sent to its queue within 250 ms of that instant
    assert [mid for _, mid, _, _ in moves.items].count(head.message_id) == 3, moves.told()  # sent, parked, back
    assert stack.leases.release(held)
    wait_for(lambda: runs.count(kind="other") == 1, what="the other key's waiter to run")
    assert stack.recorder.wait_settled(head.message_id) == "acked"
