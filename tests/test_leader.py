"""Leader: a process-level lease for singleton processes (issue 22, item 3).

In-process: the arguments, standby and takeover at a release, renewals past the TTL, and each way a loss is
told (a callback, LeaderLost in a worker thread, LeaderLost interrupting a blocked main thread); and what a
demanding user would try: a nested ``with``, a body that raises, renewals hung on a socket that never answers
(tests/support/blackhole.py), a Redis restart, a release racing the loss, exit mode beside other threads. Across real
processes (tests/apps/leader_app.py, a scheduler-like loop that records its ticks with ``time.time()``, this
machine's one clock): a SIGKILLed leader is replaced within TTL + 1 s; a leader cut off from Redis by a
partition (tests/support/blackhole.py) is told no later than its local deadline, raising or exiting with
code 75, and its ticks never overlap the next leader's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from dramatiq_leases import Leader, LeaderLost, LeaseConfigError, LeaseKeyError, Leases, LeaseStateError
from dramatiq_leases.core import Lease
from dramatiq_leases.core.keys import lease_name
from dramatiq_leases.core.lease import LostReason
from dramatiq_leases.embedded import EmbeddedRedis
from dramatiq_leases.leader import EXIT_CODE

from .support.blackhole import Blackhole
from .support.processes import Processes, clean_env, wait_until
from .support.waiting import wait_for

KEY = "scheduler"
#: How late, past its local deadline, a leader may learn of the loss on this loaded machine: well under the
#: margin (a tenth of the TTL) the key still lives on the server after that deadline.
LATENESS_S = 0.25


def test_bad_arguments_are_refused_naming_the_option_and_value(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client)
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        (
            {"ttl": 99},
            LeaseConfigError,
            r"Leader 'scheduler': ttl must be a whole number of milliseconds from 100 .* got 99",
        ),
        ({"ttl": 1500.5}, LeaseConfigError, r"ttl .* got 1500\.5"),
        ({"ttl": "15s"}, LeaseConfigError, r"ttl .* got '15s'"),
        ({"ttl": 1_000, "poll": 0}, LeaseConfigError, r"poll must be a whole number .* got 0"),
        (
            {"ttl": 1_000, "on_lost": "log"},
            LeaseConfigError,
            r"on_lost must be 'raise', 'exit' or a function, got 'log'",
        ),
        ({"ttl": 1_000, "exit_code": 0}, LeaseConfigError, r"exit_code must be .* from 1 to 255, got 0"),
        ({"ttl": 1_000, "meta": {"pid": 1}}, LeaseConfigError, r"metadata must map strings to strings"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            Leader(leases, KEY, **kwargs)
    with pytest.raises(LeaseKeyError, match="Leader key must be a non-empty string, got ''"):
        Leader(leases, "", ttl=1_000)
    with pytest.raises(LeaseConfigError, match="leases must be a dramatiq_leases.Leases, got Redis"):
        Leader(redis_client, KEY, ttl=1_000)  # type: ignore[arg-type]
    assert redis_client.keys("*") == []  # refused before Redis was asked


def test_a_standby_waits_and_takes_over_at_the_leaders_release_with_a_larger_fence(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client)
    first = Leader(leases, KEY, ttl=300)
    second = Leader(leases, KEY, ttl=300, poll=100)
    with pytest.raises(LeaseStateError, match="has not been granted its key"):
        _ = second.fence
    with first as leader:
        assert leader is first and first.is_leader
        fence = first.fence
        info = leases.inspect(KEY)
        assert info is not None and info.meta["pid"] == str(os.getpid()) and info.meta["host"]
        # Held for more than three TTLs: only its heartbeat can keep it (one grant: the fence stays).
        assert not second.wait(timeout=1.2)
        assert not second.is_leader and second.lease is None
        info = leases.inspect(KEY)
        assert info is not None and info.fence == fence and info.renewed_ms - info.acquired_ms > 600
        took: list[float] = []
        standby = threading.Thread(target=lambda: took.append(time.monotonic()) if second.wait(10) else None)
        standby.start()
        time.sleep(0.15)  # let it ask and be refused at least once
        released_at = time.monotonic()
    assert not first.is_leader and first.fence == fence  # the last grant's fence stays readable
    standby.join(10)
    assert took and took[0] - released_at < 0.1 + 0.2  # one poll (100 ms) and a loaded machine
    assert second.is_leader and second.fence > fence
    second.release()
    second.release()  # idempotent
    assert leases.inspect(KEY) is None and leases.fence_state(KEY)["released"] == second.fence


def test_a_lost_key_calls_the_callback_on_the_heartbeats_thread(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client)
    calls: list[tuple[Lease, LostReason, str]] = []

    def on_lost(lease: Lease, reason: LostReason) -> None:
        calls.append((lease, reason, threading.current_thread().name))

    leader = Leader(leases, KEY, ttl=600, on_lost=on_lost)
    with leader:
        fence = leader.fence
        redis_client.delete(leases.lease_name(KEY))  # an operator's DEL, or an eviction
        wait_for(lambda: calls, timeout=5, what="the callback")
        assert not leader.is_leader and leader.lease is None and leader.lost_reason is LostReason.GONE
    [(lease, reason, thread)] = calls
    assert (lease.fence, reason) == (fence, LostReason.GONE)
    assert thread.startswith("dramatiq-leases-") and thread != threading.current_thread().name


def test_a_stolen_key_raises_leaderlost_in_the_thread_that_entered(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client)
    leader = Leader(leases, KEY, ttl=600)
    raised: list[LeaderLost] = []
    leading = threading.Event()

    def scheduler() -> None:
        try:
            with leader:
                leading.set()
                while True:  # a scheduler loop whose `except Exception` cannot swallow the loss
                    try:
                        time.sleep(0.01)
                    except Exception:  # what a scheduler loop does with a failed job
                        continue
        except LeaderLost as lost:
            raised.append(lost)

    thread = threading.Thread(target=scheduler)
    thread.start()
    assert leading.wait(5)
    redis_client.hset(leases.lease_name(KEY), "token", "another-owner")
    stolen_at = time.monotonic()
    thread.join(5)
    assert not thread.is_alive()
    [lost] = raised
    assert (lost.key, lost.fence, lost.reason) == (KEY, leader.fence, LostReason.STOLEN)
    assert "stolen" in str(lost) and "'scheduler'" in str(lost)
    assert time.monotonic() - stolen_at < 0.2 + 1.0  # one renew interval, and a loaded machine


def test_a_leader_released_from_another_thread_stops_standing_by_and_tells_the_next_holder_only(
    redis_client: redis.Redis,
) -> None:
    """release() from another thread ends a standby; a Leader first held in the main thread and released
    elsewhere, then held by a worker thread, raises its LeaderLost in that worker thread, not the main one."""
    leases = Leases(redis_client)
    before = signal.getsignal(signal.SIGURG)
    other = Leader(leases, KEY, ttl=600)
    assert other.wait(1)
    leader = Leader(leases, KEY, ttl=600, poll=50)
    threading.Timer(0.2, leader.release).start()
    started = time.monotonic()
    assert not leader.wait(10) and time.monotonic() - started < 2
    other.release()
    assert leader.wait(1)  # in the main thread: its SIGURG handler is installed
    releaser = threading.Thread(target=leader.release)
    releaser.start()
    releaser.join(5)
    raised: list[LeaderLost] = []

    def worker() -> None:
        try:
            with leader:
                while True:
                    time.sleep(0.01)
        except LeaderLost as lost:
            raised.append(lost)

    thread = threading.Thread(target=worker)
    thread.start()
    wait_for(lambda: leader.is_leader, timeout=5, what="the worker thread to lead")
    redis_client.hset(leases.lease_name(KEY), "token", "another-owner")
    thread.join(5)
    assert [lost.reason for lost in raised] == [LostReason.STOLEN]
    time.sleep(0.1)  # a LeaderLost wrongly sent to this thread would land here
    # Released from another thread, the handler could not be put back there: the main thread's next Leader
    # done with it does.
    with Leader(leases, "another-key", ttl=600):
        pass
    assert signal.getsignal(signal.SIGURG) == before


def test_in_the_main_thread_leaderlost_interrupts_a_blocking_sleep(redis_client: redis.Redis) -> None:
    assert threading.current_thread() is threading.main_thread()
    leases = Leases(redis_client)
    before = signal.getsignal(signal.SIGURG)
    timer = threading.Timer(0.2, lambda: redis_client.delete(leases.lease_name(KEY)))
    started = time.monotonic()
    with pytest.raises(LeaderLost) as lost, Leader(leases, KEY, ttl=600):
        timer.start()
        time.sleep(30)  # a C call: an asynchronous exception would wait for its end
    assert time.monotonic() - started < 3
    assert lost.value.reason is LostReason.GONE
    assert signal.getsignal(signal.SIGURG) == before  # put back


def test_leaderlost_reaches_a_blocked_main_thread_whose_app_replaced_the_sigurg_handler(
    redis_client: redis.Redis,
) -> None:
    """An app (or a library) that installs a SIGURG handler of its own while leading does not swallow the
    loss: LeaderLost still interrupts the main thread's blocking sleep (issue 27, item 1)."""
    assert threading.current_thread() is threading.main_thread()
    leases = Leases(redis_client)
    before = signal.getsignal(signal.SIGURG)
    app_signals: list[int] = []
    timer = threading.Timer(0.2, lambda: redis_client.delete(leases.lease_name(KEY)))
    started = time.monotonic()
    try:
        with pytest.raises(LeaderLost) as lost, Leader(leases, KEY, ttl=600):
            signal.signal(signal.SIGURG, lambda signum, frame: app_signals.append(signum))
            timer.start()
            time.sleep(30)
        assert time.monotonic() - started < 3
        assert lost.value.reason is LostReason.GONE
    finally:
        signal.signal(signal.SIGURG, before)


def test_leaderlost_reaches_a_main_thread_that_blocks_sigurg(redis_client: redis.Redis) -> None:
    """A main thread with SIGURG blocked (a library's pthread_sigmask) never runs the handler: after a short
    grace the loss is raised as an asynchronous exception instead, once, not twice when the signal is let in."""
    assert threading.current_thread() is threading.main_thread()
    leases = Leases(redis_client)
    timer = threading.Timer(0.2, lambda: redis_client.delete(leases.lease_name(KEY)))
    started = time.monotonic()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGURG})
    try:
        with pytest.raises(LeaderLost) as lost, Leader(leases, KEY, ttl=600):
            timer.start()
            while time.monotonic() - started < 30:
                time.sleep(0.01)  # Python instructions between the sleeps: where the exception lands
        assert time.monotonic() - started < 3
        assert lost.value.reason is LostReason.GONE
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGURG})  # the pending signal, let in: no second raise
    time.sleep(0.1)


@pytest.mark.parametrize("how", ["SIG_IGN", "SIG_DFL", "blocked"])
def test_with_sigurg_ignored_or_blocked_leaderlost_waits_for_a_blocking_call_to_return(
    redis_client: redis.Redis, how: str
) -> None:
    """The limit of the SIGURG path (docs/guarantees.md): an app that sets SIGURG to SIG_IGN or SIG_DFL, or
    blocks it, while it leads cannot be interrupted by it; LeaderLost is then an asynchronous exception, as in
    a thread that is not the main one, and lands once the blocking call returns."""
    assert threading.current_thread() is threading.main_thread()
    leases = Leases(redis_client)
    before = signal.getsignal(signal.SIGURG)
    timer = threading.Timer(0.2, lambda: redis_client.delete(leases.lease_name(KEY)))
    started = time.monotonic()
    try:
        with pytest.raises(LeaderLost) as lost, Leader(leases, KEY, ttl=600):
            if how == "blocked":
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGURG})
            else:
                signal.signal(signal.SIGURG, getattr(signal, how))
            timer.start()
            time.sleep(2)  # one blocking call, well past the lease's deadline
        assert time.monotonic() - started >= 1.9, "the blocking call was interrupted after all: fix the docs"
        assert lost.value.reason is LostReason.GONE
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGURG})
        signal.signal(signal.SIGURG, before)


def test_several_leaders_in_the_main_thread_give_the_apps_sigurg_handler_back_in_any_order(
    redis_client: redis.Redis,
) -> None:
    """Two Leaders held in the main thread at once (nested, or released out of order): whichever is lost or
    released first, the other still gets its LeaderLost, the app's own SIGURG handler is called for SIGURGs
    that are not theirs meanwhile, and it is the handler again once both are done."""
    assert threading.current_thread() is threading.main_thread()
    leases = Leases(redis_client)
    before = signal.getsignal(signal.SIGURG)
    app: list[int] = []
    signal.signal(signal.SIGURG, lambda signum, frame: app.append(signum))
    mine = signal.getsignal(signal.SIGURG)

    def foreign_sigurg() -> int:
        """Send a SIGURG that is no Leader's; how many the app's handler has seen."""
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGURG)
        time.sleep(0.05)
        return len(app)

    try:
        outer, inner = Leader(leases, "outer", ttl=600), Leader(leases, "inner", ttl=600)
        # The outer one lost first, while the inner one is held.
        timer = threading.Timer(0.2, lambda: redis_client.delete(leases.lease_name("outer")))
        with pytest.raises(LeaderLost) as lost, outer, inner:
            timer.start()
            time.sleep(30)
        assert lost.value.key == "outer"
        assert signal.getsignal(signal.SIGURG) == mine
        assert foreign_sigurg() == 1
        with outer:  # held again, once lost
            assert foreign_sigurg() == 2
        assert signal.getsignal(signal.SIGURG) == mine
        # Released out of order: the one left holding is still told, and passes foreign SIGURGs on.
        assert outer.wait(5) and inner.wait(5)
        outer.release()
        assert foreign_sigurg() == 3
        timer = threading.Timer(0.2, lambda: redis_client.delete(leases.lease_name("inner")))
        with pytest.raises(LeaderLost) as lost:
            timer.start()
            time.sleep(30)
        assert lost.value.key == "inner"
        inner.release()
        assert signal.getsignal(signal.SIGURG) == mine
        assert foreign_sigurg() == 4
    finally:
        signal.signal(signal.SIGURG, before)


def test_leaderlost_is_not_raised_in_a_new_thread_that_reuses_the_ident_of_the_granted_one(
    redis_client: redis.Redis,
) -> None:
    """A thread granted the key by ``wait()`` that ended meanwhile is gone: its loss is not raised in a later
    thread that happens to get the same ident (pthreads reuse them: a cached stack, the same pthread_t)."""
    leases = Leases(redis_client)
    leader = Leader(leases, KEY, ttl=600)
    granted = threading.Thread(target=leader.wait)
    granted.start()
    granted.join(10)
    assert leader.is_leader
    caught: list[BaseException] = []
    stop = threading.Event()

    def bystander() -> None:
        try:
            while not stop.is_set():
                time.sleep(0.01)
        except BaseException as e:  # whatever lands here is the failure
            caught.append(e)

    for _ in range(50):  # a new thread with the ended one's ident
        other = threading.Thread(target=bystander)
        other.start()
        if other.ident == granted.ident:
            break
        stop.set()
        other.join(5)
        stop.clear()
    else:
        pytest.skip("this platform did not reuse the thread's ident")
    try:
        redis_client.delete(leases.lease_name(KEY))
        wait_for(lambda: leader.lost_reason is not None, timeout=5, what="the loss")
        time.sleep(0.2)  # where an exception sent to the ident would land
    finally:
        stop.set()
        other.join(5)
        leader.release()
    assert caught == [], f"{caught!r} was raised in an unrelated thread"
    assert leader.lost_reason is LostReason.GONE and not leader.is_leader


# --- within the block: nesting, raising, a hung or restarted Redis, racing releases ---------------------------


def test_a_nested_with_of_one_leader_keeps_the_key_until_the_outer_with_ends(redis_client: redis.Redis) -> None:
    """Re-entering the same Leader (a helper that does `with leader:` called inside the scheduler's own block)
    must not release the key at the inner exit while the outer block still acts as leader: another process
    would be granted it and both would lead."""
    leases = Leases(redis_client)
    leader = Leader(leases, KEY, ttl=600)
    other = Leader(leases, KEY, ttl=600, poll=50)
    with leader:
        fence = leader.fence
        with leader:
            assert leader.fence == fence
        assert leader.is_leader, "the inner exit released the outer block's key"
        assert not other.wait(timeout=0.3), "another leader was granted the key inside the outer block"
    assert leases.inspect(KEY) is None and other.wait(timeout=2)
    other.release()


def test_a_body_that_raises_releases_the_key_and_a_lost_leader_leads_again_with_a_larger_fence(
    redis_client: redis.Redis,
) -> None:
    leases = Leases(redis_client)
    leader = Leader(leases, KEY, ttl=600)
    with pytest.raises(ZeroDivisionError), leader:
        _ = 1 / 0
    assert leases.inspect(KEY) is None and not leader.is_leader
    assert leases.fence_state(KEY)["released"] == leader.fence  # released, not left to expire
    # Lost inside the body (the key deleted), then the same Leader enters again, as the README's loop does.
    with pytest.raises(LeaderLost) as lost, leader:
        first = leader.fence
        redis_client.delete(leases.lease_name(KEY))
        time.sleep(30)  # interrupted by the loss (main thread)
    assert lost.value.reason is LostReason.GONE
    with leader:
        assert leader.fence > first and leader.is_leader
    assert leases.inspect(KEY) is None


def test_a_leader_whose_renewals_hang_is_told_by_its_deadline_before_the_key_can_go_to_another(
    redis_server: EmbeddedRedis,
) -> None:
    """A socket that never answers (no socket timeout at all): the watchdog, not the renewal, tells the loss,
    while the key still lives on the server; the standby is granted it only afterwards, with a larger fence;
    leaving the block then asks nothing of the hung Redis."""
    direct = redis.Redis.from_url(redis_server.url(0), socket_timeout=2)
    told: list[tuple[float, float, int]] = []
    with Blackhole(redis_server.port) as hole:
        hung = Leases(redis.Redis(port=hole.port))  # no socket_timeout: a renewal blocks for ever

        def on_lost(lease: Lease, reason: LostReason) -> None:
            told.append((time.monotonic(), lease.valid_until, int(direct.pttl(lease_name("dramatiq-leases", KEY)))))

        leader = Leader(hung, KEY, ttl=2_000, on_lost=on_lost)
        standby = Leader(Leases(direct), KEY, ttl=2_000, poll=20)
        assert leader.wait(timeout=5)
        fence = leader.fence
        hole.cut()
        got: list[float] = []

        def stand_by() -> None:
            if standby.wait(timeout=10):
                got.append(time.monotonic())

        thread = threading.Thread(target=stand_by)
        thread.start()
        wait_for(lambda: told, timeout=5, what="the hung leader to be told")
        told_at, deadline, pttl_then = told[0]
        assert told_at <= deadline + LATENESS_S, f"told {told_at - deadline:.3f} s past its deadline"
        assert pttl_then > 0, "the key was already gone on the server when the leader was told"
        thread.join(10)
        assert got and got[0] > told_at and standby.fence > fence
        started = time.monotonic()
        leader.release()  # the lease is lost: nothing is asked of the hung socket
        assert time.monotonic() - started < 0.5
        standby.release()


def test_wait_with_a_timeout_returns_within_one_socket_timeout_if_redis_never_answers(
    redis_server: EmbeddedRedis,
) -> None:
    """Promise (guide): wait(timeout) stands by at most the timeout plus the Redis call under way."""
    with Blackhole(redis_server.port) as hole:
        client = redis.Redis(port=hole.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        leader = Leader(Leases(client), KEY, ttl=1_000)
        hole.cut()
        done = threading.Event()

        def stand_by() -> None:
            leader.wait(timeout=0.3)
            done.set()

        threading.Thread(target=stand_by, daemon=True).start()
        try:
            assert done.wait(0.3 + 0.5 + 1.0), "wait(timeout=0.3) blocked past its timeout and one socket timeout"
        finally:
            hole.heal()  # the blocked ask fails and its thread ends
            done.wait(5)


def test_a_redis_restart_under_the_leader_is_told_and_the_next_grant_has_a_larger_fence(
    redis_server: EmbeddedRedis,
) -> None:
    """The key vanishes with a restart (no persistence): the leader is told (gone or unreachable) in time, and
    the fence of the grant after the restart is still larger (the counter was lost with the rest)."""
    leases = Leases.from_url(redis_server.url(0), socket_timeout=0.5)
    lost: list[LostReason] = []
    leader = Leader(leases, KEY, ttl=1_500, on_lost=lambda lease, reason: lost.append(reason))
    assert leader.wait(timeout=5)
    before = leader.fence
    redis_server.stop()
    redis_server.start()
    wait_for(lambda: lost, timeout=5, what="the leader to be told after the restart")
    assert lost[0] in (LostReason.GONE, LostReason.UNREACHABLE) and not leader.is_leader
    leader.release()
    assert leader.wait(timeout=5) and leader.fence > before
    leader.release()


def _race_once(leases: Leases, client: redis.Redis, in_main: bool, offset: float) -> list[str]:
    """Delete the key and release the Leader ``offset`` s later; returns where a LeaderLost landed, if anywhere
    but inside the block (or its exit)."""
    leader = Leader(leases, KEY, ttl=150)
    wrong: list[str] = []
    ready = threading.Event()

    def hold() -> None:
        try:
            with leader:
                ready.set()
                while leader.lease is not None or not leader._closing.is_set():
                    time.sleep(0.001)
        except LeaderLost:
            pass  # told inside the block or at its exit: that is allowed
        try:
            end = time.monotonic() + 0.05
            while time.monotonic() < end:
                time.sleep(0.001)
        except LeaderLost:
            wrong.append("after the block")

    if in_main:

        def later() -> None:
            if ready.wait(5):
                _delete_then_release(client, leader, offset)

        timer = threading.Thread(target=later)
        timer.start()
        hold()
        timer.join(5)
    else:
        worker = threading.Thread(target=hold)
        worker.start()
        assert ready.wait(5)
        _delete_then_release(client, leader, offset)
        worker.join(5)
    return wrong


def _delete_then_release(client: redis.Redis, leader: Leader, offset: float) -> None:
    client.delete(lease_name("dramatiq-leases", KEY))
    time.sleep(offset)
    leader.release()


@pytest.mark.parametrize("in_main", [True, False], ids=["main-thread", "worker-thread"])
def test_release_racing_the_heartbeats_loss_never_raises_after_the_block(
    redis_client: redis.Redis, in_main: bool
) -> None:
    leases = Leases(redis_client)
    rng = random.Random(22)
    for _ in range(12):
        assert _race_once(leases, redis_client, in_main, rng.uniform(0, 0.06)) == []


def test_exit_mode_ends_the_process_with_code_75_though_other_threads_run(redis_server: EmbeddedRedis) -> None:
    code = f"""
import threading, time, sys
from dramatiq_leases import Leader, Leases
def busy():
    while True:
        sum(range(1000))  # a non-daemon thread that never ends
threading.Thread(target=busy).start()
leader = Leader(Leases.from_url({redis_server.url(0)!r}), "scheduler", ttl=600, on_lost="exit")
with leader:
    print("leading", flush=True)
    while True:
        time.sleep(0.01)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "leading"
        redis.Redis.from_url(redis_server.url(0)).delete(lease_name("dramatiq-leases", KEY))
        assert proc.wait(5) == EXIT_CODE == 75
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- real processes --------------------------------------------------------------------------------------


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _first(path: Path, event: str, after: float = 0.0) -> dict[str, Any] | None:
    return next((e for e in _events(path) if e["event"] == event and e["t"] > after), None)


def _ticks(path: Path, fence: int) -> list[dict[str, Any]]:
    return [e for e in _events(path) if e["event"] == "tick" and e["fence"] == fence]


def _start(
    procs: Processes,
    name: str,
    url: str,
    events: Path,
    *,
    ttl: int,
    on_lost: str = "raise",
    flags: tuple[str, ...] = (),
) -> None:
    argv = [sys.executable, "-m", "tests.apps.leader_app", url, KEY, str(events), "--ttl", str(ttl)]
    procs.start(name, [*argv, "--on-lost", on_lost, *flags], env=clean_env())


@pytest.mark.system
def test_a_standby_process_takes_over_within_ttl_and_a_second_of_a_sigkill(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    ttl = 1_000
    a_events, b_events = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with Processes(tmp_path / "logs") as procs:
        _start(procs, "a", redis_server.url(0), a_events, ttl=ttl)
        a_lead = wait_until(lambda: _first(a_events, "leader"), timeout=30, what="a to lead", procs=procs)
        _start(procs, "b", redis_server.url(0), b_events, ttl=ttl)
        b_standby = wait_until(lambda: _first(b_events, "standby"), timeout=30, what="b to stand by", procs=procs)
        # Two TTLs of b standing by: a's renewals keep the key, b never leads beside it.
        wait_until(
            lambda: _first(a_events, "tick", after=b_standby["t"] + 2 * ttl / 1000),
            timeout=10,
            what="a to lead two TTLs past b's standby",
            procs=procs,
        )
        assert _first(b_events, "leader") is None
        procs.may_exit.add("a")
        killed_at = time.time()
        os.killpg(procs.procs["a"].pid, signal.SIGKILL)
        procs.procs["a"].wait(10)
        b_lead = wait_until(lambda: _first(b_events, "leader"), timeout=10, what="b to take over", procs=procs)
    assert b_lead["t"] - killed_at <= ttl / 1000 + 1.0
    assert b_lead["fence"] > a_lead["fence"]
    assert max(e["t"] for e in _ticks(a_events, a_lead["fence"])) < b_lead["t"]


@pytest.mark.system
@pytest.mark.parametrize(
    ("on_lost", "flags"),
    [
        ("raise", ()),
        ("exit", ()),
        # A loop that relies on LeaderLost alone, in an app that put a SIGURG handler of its own over ours.
        ("raise", ("--trust-raise", "--app-sigurg")),
    ],
    ids=["raise", "exit", "raise-app-sigurg-handler"],
)
def test_a_partitioned_leader_is_told_by_its_deadline_and_never_overlaps_the_next(
    redis_server: EmbeddedRedis, tmp_path: Path, on_lost: str, flags: tuple[str, ...]
) -> None:
    ttl = 3_000  # margin 300 ms: the time between the deposed leader's deadline and the key's end on the server
    a_events, b_events = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with Blackhole(redis_server.port) as hole, Processes(tmp_path / "logs") as procs:
        _start(procs, "a", f"redis://127.0.0.1:{hole.port}/0", a_events, ttl=ttl, on_lost=on_lost, flags=flags)
        a_lead = wait_until(lambda: _first(a_events, "leader"), timeout=30, what="a to lead", procs=procs)
        _start(procs, "b", redis_server.url(0), b_events, ttl=ttl)
        b_standby = wait_until(lambda: _first(b_events, "standby"), timeout=30, what="b to stand by", procs=procs)
        wait_until(
            lambda: _first(a_events, "tick", after=b_standby["t"] + 0.5), timeout=10, what="a's ticks", procs=procs
        )
        procs.may_exit.add("a")
        exited: list[float] = []
        if on_lost == "exit":
            proc = procs.procs["a"]

            def watch_exit() -> None:
                proc.wait()
                exited.append(time.time())

            threading.Thread(target=watch_exit, daemon=True).start()
        cut_at = hole.cut()
        if on_lost == "raise":
            a_lost = wait_until(lambda: _first(a_events, "lost"), timeout=ttl / 1000 + 5, what="a told", procs=procs)
            assert (a_lost["reason"], a_lost["how"], a_lost["fence"]) == ("unreachable", "raise", a_lead["fence"])
            told = a_lost["t"]
        else:
            told = wait_until(lambda: exited and exited[0], timeout=ttl / 1000 + 5, what="a to exit")
            assert procs.procs["a"].returncode == EXIT_CODE == 75
        b_lead = wait_until(lambda: _first(b_events, "leader"), timeout=ttl / 1000 + 5, what="b to lead", procs=procs)
        if on_lost == "raise":
            # Healed, the deposed leader stands by again: it asks, is refused, and never leads beside b.
            hole.heal()
            wait_until(lambda: "Redis answers again" in procs.log("a"), timeout=10, what="a to ask again", procs=procs)
            assert _first(a_events, "leader", after=told) is None
    ticks = _ticks(a_events, a_lead["fence"])
    deadline = max(e["deadline"] for e in ticks if e["deadline"])  # the local deadline, from the last renewal
    assert cut_at < deadline <= cut_at + (ttl - ttl // 10) / 1000 + 0.05
    assert told <= deadline + LATENESS_S, f"told {told - deadline:.3f} s after its deadline"
    assert max(e["t"] for e in ticks) <= told < b_lead["t"]
    assert b_lead["fence"] > a_lead["fence"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by init, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


@pytest.mark.system
@pytest.mark.parametrize("keep", [False, True], ids=["children-killed", "kill_children-false"])
def test_exit_mode_ends_the_leaders_children_before_the_next_leader_starts(
    redis_server: EmbeddedRedis, tmp_path: Path, keep: bool
) -> None:
    """``on_lost="exit"`` kills the processes the leader started (they may act on its fence) before it exits;
    ``kill_children=False`` leaves them running beside the next leader: the limit a user opts into."""
    ttl = 2_000
    a_events, b_events = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    flags = ("--child", "--keep-children") if keep else ("--child",)
    with Blackhole(redis_server.port) as hole, Processes(tmp_path / "logs") as procs:
        _start(procs, "a", f"redis://127.0.0.1:{hole.port}/0", a_events, ttl=ttl, on_lost="exit", flags=flags)
        child = wait_until(lambda: _first(a_events, "child"), timeout=30, what="a to start its child", procs=procs)
        wait_until(lambda: _first(a_events, "child_tick"), timeout=10, what="the child's ticks", procs=procs)
        _start(procs, "b", redis_server.url(0), b_events, ttl=ttl)
        wait_until(lambda: _first(b_events, "standby"), timeout=30, what="b to stand by", procs=procs)
        procs.may_exit.add("a")
        hole.cut()
        assert procs.procs["a"].wait(ttl / 1000 + 10) == EXIT_CODE
        b_lead = wait_until(lambda: _first(b_events, "leader"), timeout=10, what="b to lead", procs=procs)
        if keep:
            wait_until(
                lambda: _first(a_events, "child_tick", after=b_lead["t"]), timeout=10, what="the child to run on"
            )
            return
        wait_until(lambda: not _alive(child["child_pid"]), timeout=5, what="the child to end")
    child_ticks = [e["t"] for e in _events(a_events) if e["event"] == "child_tick"]
    assert max(child_ticks) < b_lead["t"], "the deposed leader's child worked beside the next leader"


@pytest.mark.system
def test_a_leader_paused_past_its_ttl_is_not_leader_when_it_resumes_and_is_told_within_a_second(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """The stated exception to "before another can lead" (docs/guarantees.md): a process paused past its
    deadline (SIGSTOP here; a VM freeze, a long stall) cannot be told while paused, so the next leader is
    granted the key meanwhile. On resuming, ``is_leader`` is already False at every tick, LeaderLost lands
    within a second, and the fence it worked with is smaller than the next leader's (a fence check refuses
    it)."""
    ttl = 1_000
    a_events, b_events = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with Processes(tmp_path / "logs") as procs:
        _start(procs, "a", redis_server.url(0), a_events, ttl=ttl, flags=("--trust-raise",))
        a_lead = wait_until(lambda: _first(a_events, "leader"), timeout=30, what="a to lead", procs=procs)
        _start(procs, "b", redis_server.url(0), b_events, ttl=ttl)
        wait_until(lambda: _first(b_events, "standby"), timeout=30, what="b to stand by", procs=procs)
        os.killpg(procs.procs["a"].pid, signal.SIGSTOP)
        try:
            b_lead = wait_until(lambda: _first(b_events, "leader"), timeout=10, what="b to lead", procs=procs)
        finally:
            resumed = time.time()
            os.killpg(procs.procs["a"].pid, signal.SIGCONT)
        a_lost = wait_until(lambda: _first(a_events, "lost", after=resumed), timeout=10, what="a told", procs=procs)
    assert b_lead["fence"] > a_lead["fence"] == a_lost["fence"]
    assert a_lost["t"] - resumed < 1.0, f"told {a_lost['t'] - resumed:.3f} s after it resumed"
    late = [e for e in _ticks(a_events, a_lead["fence"]) if e["t"] >= resumed]
    assert all(not e["is_leader"] for e in late), late


def _private_pid_namespace() -> list[str]:
    """The command prefix that runs a process as pid 1 of a pid namespace of its own (with its own /proc, and
    ``ns_last_pid`` writable), or a skip where this system allows none."""
    prefix = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    try:
        done = subprocess.run([*prefix, "sh", "-c", "echo 1 > /proc/sys/kernel/ns_last_pid"], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no unshare(1)")
    if done.returncode != 0:
        pytest.skip(f"no private pid namespace here: {done.stderr.decode(errors='replace').strip()}")
    return prefix


@pytest.mark.system
def test_exit_mode_never_kills_a_process_that_took_over_a_descendants_pid(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """The most harmful way kill_children could go wrong: a descendant found by the walk ends (and is reaped)
    before the leader's SIGKILL, its pid goes to a process outside the tree, and the SIGKILL meant for the
    descendant kills that one. Forced in a private pid namespace (tests/apps/pid_reuse_harness.py): the
    victim is killed the moment the walk has stopped it, and its pid handed to a process of the harness's."""
    prefix = _private_pid_namespace()
    client = redis.Redis.from_url(redis_server.url(0))

    def make_the_case(events: Path) -> dict[str, Any]:
        with Processes(events.with_suffix(".logs")) as procs:
            argv = [*prefix, sys.executable, "-m", "tests.apps.pid_reuse_harness", redis_server.url(0), str(events)]
            procs.start("harness", argv, env=clean_env())
            procs.may_exit.add("harness")
            wait_until(lambda: _first(events, "victim"), timeout=60, what="the leader's victim child", procs=procs)
            client.delete(f"{Leases(client).lease_name(KEY)}")
            done: dict[str, Any] = wait_until(
                lambda: next((e for e in _events(events) if e.get("step") == "done"), None),
                timeout=60,
                what="the harness's verdict",
            )
        client.delete(f"{Leases(client).lease_name(KEY)}")
        return done

    # The harness must grab the pid before the leader's exit ends; on a loaded machine the leader can win that
    # race, and then the case was not made: it is made again, up to 3 times.
    for attempt in range(3):
        events = tmp_path / f"events-{attempt}.jsonl"
        done = make_the_case(events)
        assert done["code"] == EXIT_CODE
        if done["grabbed"] == done["victim"] and done["while_leader_ran"]:
            break
    client.close()
    assert done["grabbed"] == done["victim"] and done["while_leader_ran"], f"the pid was not reused in time: {done}"
    assert done["survived"], f"the leader's exit SIGKILLed a process outside its tree: {_events(events)}"


@pytest.mark.system
def test_exit_mode_does_not_take_the_key_again_while_it_kills_its_children(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """With ``on_lost="exit"``, the loop that sees ``leader.lease`` go ``None`` (the README's recipe) goes back to
    standby while the exit path still walks the children: it must not be granted the key again (a new fence,
    new children started beside a dying process, the key left to a dead holder for a whole TTL)."""
    events = tmp_path / "a.jsonl"
    client = redis.Redis.from_url(redis_server.url(0))
    busy = [subprocess.Popen(["sleep", "120"]) for _ in range(400)]  # a busy /proc: each walk takes a while
    try:
        with Processes(tmp_path / "logs") as procs:
            _start(procs, "a", redis_server.url(0), events, ttl=1_000, on_lost="exit", flags=("--tick", "0.001"))
            wait_until(lambda: _first(events, "leader"), timeout=30, what="a to lead", procs=procs)
            procs.may_exit.add("a")
            client.delete(Leases(client).lease_name(KEY))
            assert procs.procs["a"].wait(10) == EXIT_CODE
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    fences = [e["fence"] for e in _events(events) if e["event"] == "leader"]
    assert len(fences) == 1, f"the exiting leader was granted the key again: fences {fences}"
    assert Leases(client).inspect(KEY) is None
    client.close()


@pytest.mark.system
def test_exit_mode_ends_the_process_even_if_its_log_handler_is_stuck(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """A log handler that blocks (a full stderr pipe, a log shipper that stopped reading) must not keep a lost
    leader alive: the watchdog acts on the loss before it logs, and the exit does not wait on the log."""
    events = tmp_path / "a.jsonl"
    client = redis.Redis.from_url(redis_server.url(0))
    with Processes(tmp_path / "logs") as procs:
        _start(procs, "a", redis_server.url(0), events, ttl=1_000, on_lost="exit", flags=("--stuck-log",))
        wait_until(lambda: _first(events, "stuck_log"), timeout=30, what="a to lead, its log stuck", procs=procs)
        procs.may_exit.add("a")
        deleted_at = time.time()
        client.delete(Leases(client).lease_name(KEY))
        try:
            code = procs.procs["a"].wait(5)
        except subprocess.TimeoutExpired:
            code = None
    client.close()
    late = [e for e in _ticks(events, 1) if e["t"] > deleted_at + 1.0]
    assert code == EXIT_CODE, f"the lost leader did not exit (it ticked {len(late)} times a second past the loss)"
