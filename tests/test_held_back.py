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
from typing import Any

import pytest
import redis

from dramatiq_leases import RateLimited, current_lease
from dramatiq_leases.cli import main
from dramatiq_leases.core import Busy, Lease, LeaseConfigError, Leases
from dramatiq_leases.core.protocol import Turn
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.middleware import held_back

from .support.runs import Runs
from .support.stack import MakeStack, Stack
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


def server_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


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


@pytest.mark.parametrize("limit", [1, 2])
def test_rate_limited_holds_the_key_back_and_runs_again_first_without_a_retry(
    make_broker_stack: MakeStack, limit: int
) -> None:
    """The vendor said 429: no message of the key starts during the hold (none of its slots), the message that
    raised runs again first once it ends, acknowledged, its retry untouched (``max_retries=0``)."""
    stack = make_broker_stack()
    runs = Runs()
    raised = threading.Event()

    @stack.actor(lock_key="vendor:{tenant}", lock_limit=limit, max_retries=0)
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
    # The others are sent once the hold is on: sent between the raise and the release, one could take the
    # second slot before the hold, as it may.
    wait_for(
        lambda: any(e.event == "rate_limited" for e in stack.leases.history("vendor:acme")), timeout=20, what="the hold"
    )
    others = [call_vendor.send("acme", n) for n in range(1, 4)]
    for message in [first, *others]:
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    [held] = [e for e in stack.leases.history("vendor:acme") if e.event == "rate_limited"]
    assert held.reason == "hold 800 ms" and held.waiter == f"{first.message_id}:0"
    starts = runs.where(kind="start")
    again = [r for r in starts if r["n"] == 0][1]
    later = [r for r in starts if r["n"] != 0]
    assert len(later) == 3
    # Nothing started during the hold (server µs). With one slot the held-back message started first after it;
    # with two, its place at the head keeps one slot for it while the next in line take turns in the other.
    assert all(int(r["fence"]) // 1000 >= held.time_ms + 800 for r in [again, *later])
    if limit == 1:
        assert all(int(r["fence"]) > int(again["fence"]) for r in later)
    assert stack.not_run("call_vendor", "rate_limited") == 1
    assert not stack.recorder.nacked
    assert all(opts.get("retries", 0) == 0 for _, _, opts in stack.recorder.enqueues)


def test_rate_limited_with_a_rate_waits_for_both(make_broker_stack: MakeStack) -> None:
    """With ``lock_rate`` the hold adds to the rate: each start waits for both, and the rate still holds."""
    stack = make_broker_stack()
    runs = Runs()
    raised = threading.Event()

    @stack.actor(lock_key="vendor:{tenant}", lock_rate="2/s", max_retries=0)
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


def test_rate_limited_in_an_async_actor(make_broker_stack: MakeStack) -> None:
    """An async actor raises it through Dramatiq's event loop: the same hold, the same second run."""
    stack = make_broker_stack()
    from dramatiq.middleware import AsyncIO

    stack.broker.add_middleware(AsyncIO())
    runs = Runs()

    @stack.actor(lock_key="vendor:{tenant}", max_retries=0)
    async def call_vendor(tenant: str) -> None:
        runs.add(kind="start")
        if runs.count(kind="start") == 1:
            raise RateLimited(retry_after=300)

    stack.start()
    message = call_vendor.send("acme")
    wait_for(lambda: runs.count(kind="start") == 2, timeout=30, what="the second run")
    assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    assert [e.event for e in stack.leases.history("vendor:acme")].count("rate_limited") == 1


@pytest.mark.parametrize("on_busy", ["skip", "fail"])
def test_a_held_back_message_of_a_skip_or_fail_actor_runs_again_even_if_its_copy_comes_back_early(
    make_broker_stack: MakeStack, monkeypatch: pytest.MonkeyPatch, on_busy: str
) -> None:
    """A hold longer than a park (a ``Retry-After: 600`` against the 300 s park; shortened here to 1.5 s against
    400 ms), or a worker clock ahead of the server's, brings the copy back while its key is still held: it waits
    for the hold's end in the line whatever its ``lock_on_busy`` says, then runs, neither skipped nor failed."""
    monkeypatch.setattr(held_back, "DEFAULT_PARK_MS", 400)
    stack = make_broker_stack()
    runs = Runs()

    @stack.actor(lock_key="vendor:{tenant}", lock_on_busy=on_busy, max_retries=0)
    def call_vendor(tenant: str) -> None:
        runs.add(fence=current_lease().fence)
        if runs.count() == 1:
            raise RateLimited(retry_after=1_500)

    stack.start()
    message = call_vendor.send("acme")
    wait_for(lambda: runs.count() >= 1, timeout=20, what="the first run")
    wait_for(lambda: runs.count() == 2, timeout=20, what="the run after the hold")
    skipped = stack.not_run("call_vendor", "skipped")
    failed = stack.not_run("call_vendor", "failed")
    assert (skipped, failed, stack.recorder.nacked) == (0, 0, []), (
        f"the held-back message was not run again: skipped={skipped} failed={failed} nacked={stack.recorder.nacked}"
    )
    assert runs.count() == 2
    assert stack.recorder.wait_settled(message.message_id, timeout=10) == "acked"


def test_a_held_back_message_runs_again_even_when_the_hold_outlasts_its_wait_budget(
    make_broker_stack: MakeStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hold longer than the wait budget (a ``Retry-After: 7200`` against an hour; shortened here to 2.5 s
    against 1 s, parks of 400 ms) does not give the message up: its budget starts when the hold ends."""
    monkeypatch.setattr(held_back, "DEFAULT_PARK_MS", 400)
    stack = make_broker_stack()
    runs = Runs()

    @stack.actor(lock_key="vendor:{tenant}", lock_max_wait=1_000, max_retries=0)
    def call_vendor(tenant: str) -> None:
        runs.add(fence=current_lease().fence)
        if runs.count() == 1:
            raise RateLimited(retry_after=2_500)

    stack.start()
    message = call_vendor.send("acme")
    wait_for(lambda: runs.count() >= 1, timeout=20, what="the first run")
    wait_for(lambda: runs.count() == 2, timeout=20, what="the run after the hold")
    gave_up = stack.not_run("call_vendor", "gave_up")
    assert gave_up == 0 and not stack.recorder.nacked, "the held-back message was given up and dead-lettered"
    assert runs.count() == 2
    assert stack.recorder.wait_settled(message.message_id, timeout=10) == "acked"


def test_a_lost_lease_holds_nothing_back_but_the_message_still_comes_back_after_retry_after(
    make_broker_stack: MakeStack,
) -> None:
    """A lease lost before the raise (an operator released it) holds nothing back, but the message still comes
    back only after ``retry_after``: not at once, against the downstream that just answered 429."""
    stack = make_broker_stack()
    runs = Runs()
    raised_at: list[int] = []

    @stack.actor(lock_key="vendor:{tenant}", max_retries=0)
    def call_vendor(tenant: str) -> None:
        lease = current_lease()
        runs.add(fence=lease.fence)
        if runs.count() == 1:
            assert stack.leases.release_token(lease.key, lease.token, by="ops@host")
            raised_at.append(server_ms(stack.leases.client))
            raise RateLimited(retry_after=3_000)

    stack.start()
    message = call_vendor.send("acme")
    wait_for(lambda: runs.count() == 2, timeout=20, what="the second run")
    assert stack.recorder.wait_settled(message.message_id, timeout=10) == "acked"
    again_ms = int(runs.items[1]["fence"]) // 1000
    assert again_ms >= raised_at[0] + 3_000, f"ran again {again_ms - raised_at[0]} ms after a 429 of 3000 ms"


def test_a_hold_with_latest_runs_the_newer_message_and_supersedes_the_held_back_one(
    make_broker_stack: MakeStack,
) -> None:
    """``lock_on_busy="latest"`` with RateLimited. A newer revision sent during the hold waits for it (no
    start before the hold ends), then runs; the held-back older revision, back at the hold's end, is superseded
    (the newest wins), never run after the newer one."""
    stack = make_broker_stack()
    runs = Runs()
    raised = threading.Event()

    @stack.actor(lock_key="doc:{doc}", lock_on_busy="latest", max_retries=0)
    def reindex(doc: int, revision: int) -> None:
        runs.add(revision=revision, fence=current_lease().fence)
        if revision == 0 and not raised.is_set():
            raised.set()
            raise RateLimited(retry_after=800)

    stack.start()
    first = reindex.send(1, 0)
    assert raised.wait(20)
    newer = reindex.send(1, 1)
    for message in (first, newer):
        assert stack.recorder.wait_settled(message.message_id, timeout=30) == "acked"
    [held] = [e for e in stack.leases.history("doc:1") if e.event == "rate_limited"]
    revisions = [r["revision"] for r in runs.items]
    assert revisions == [0, 1], revisions
    assert int(runs.items[1]["fence"]) // 1000 >= held.time_ms + 800
    assert stack.not_run("reindex", "superseded") == 1


def test_a_worker_stop_while_the_held_back_copy_is_parked_still_runs_it_once_after_the_hold(
    make_broker_stack: MakeStack, request: pytest.FixtureRequest, redis_server: EmbeddedRedis
) -> None:
    """The worker holding the held-back copy in its delay queue stops during the hold; another worker takes
    the copy over and runs the message once more, not before the hold ends, acknowledged, no retry spent."""
    from .support.stack import taking_over_broker

    rabbit = "rabbitmq" in request.node.callspec.id
    runs = Runs()

    def declare(stack: Stack) -> Any:
        @stack.actor(actor_name="call_vendor", lock_key="vendor:{tenant}", max_retries=0)
        def call_vendor(tenant: str) -> None:
            runs.add(fence=current_lease().fence)
            if runs.count() == 1:
                raise RateLimited(retry_after=2_000)

        return call_vendor

    first = make_broker_stack()
    call_vendor = declare(first)
    first.start()
    message = call_vendor.send("acme")
    wait_for(lambda: runs.count() == 1 and first.leases_mw.waiting.parked == 1, timeout=20, what="the parked copy")
    first.stop()
    broker = None if rabbit else taking_over_broker(redis_server.url(0))
    second = make_broker_stack(broker=broker) if broker is not None else make_broker_stack()
    declare(second)
    second.start()
    wait_for(lambda: runs.count() == 2, timeout=30, what="the held-back message's second run")
    time.sleep(1.0)
    assert runs.count() == 2
    [held] = [e for e in second.leases.history("vendor:acme") if e.event == "rate_limited"]
    assert int(runs.items[1]["fence"]) // 1000 >= held.time_ms + 2_000
    assert message.message_id not in first.recorder.nacked + second.recorder.nacked


@pytest.mark.parametrize("mode", ["until_done", "queued"])
def test_a_held_back_unique_message_keeps_its_record_until_it_runs_again(
    make_broker_stack: MakeStack, mode: str
) -> None:
    """RateLimited with ``lock_unique``: the delivery is skipped with its copy parked, so the unique record
    lives on (a second send is refused while the copy waits out the hold), and the message runs again once."""
    from dramatiq_leases import DuplicateMessage

    stack = make_broker_stack()
    runs = Runs()

    @stack.actor(lock_key="export:{rid}", lock_unique=mode, max_retries=0)
    def export(rid: int) -> None:
        runs.add(fence=current_lease().fence)
        if runs.count() == 1:
            raise RateLimited(retry_after=1_500)

    stack.start()
    message = export.send(1)
    wait_for(lambda: runs.count() == 1, timeout=20, what="the first run")
    time.sleep(0.3)
    with pytest.raises(DuplicateMessage):
        export.send(1)
    wait_for(lambda: runs.count() == 2, timeout=30, what="the second run")
    assert stack.recorder.wait_settled(message.message_id, timeout=10) == "acked"

    def sent() -> bool:
        try:
            export.send(1)
        except DuplicateMessage:
            return False  # the record ends just after the message's ack
        return True

    wait_for(sent, timeout=10, what="the record to end with the message")
