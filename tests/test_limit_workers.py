"""Keys held by several at once (``lock_limit``) across real worker processes, on the Redis and the RabbitMQ broker.

Each test sends its jobs from a separate process and reads what the workers recorded (tests/apps/limit_app.py):
when each job started and ended, under which fence and holder slot, its first attempt, and what the broker did
with each message. Capacity is checked from those records: at no instant more than the limit run at once,
counting a SIGKILLed holder as running until its lease's TTL ended (read from Redis right after the kill).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from .support.limit_workers import HOLDERS, TTL, LimitWorkers, call, most_at_once

pytestmark = pytest.mark.system


def lease_ends(w: LimitWorkers, key: str) -> dict[int, float]:
    """Each holder of ``key`` now, by fence: when its lease ends (Unix time, s) if it is not renewed again."""
    return {info.fence: (info.now_ms + info.ttl_left) / 1000 for info in w.leases.holders(key)}


def each_ran(w: LimitWorkers, ns: list[int], key: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Wait until each of ``ns`` has a finished run on ``key``; those runs, by start."""

    def finished() -> list[dict[str, Any]] | None:
        runs = [r for r in w.runs() if r["key"] == key and r["n"] in ns]
        return runs if {r["n"] for r in runs} == set(ns) else None

    runs = w.wait(finished, timeout=timeout, what=f"{len(ns)} jobs of {key!r} to run")
    return sorted(runs, key=lambda r: r["start"])


def test_a_killed_holder_frees_exactly_its_slot(workers: LimitWorkers) -> None:
    """Three holders of a key held by three at once; one is SIGKILLed: its slot, and only it, frees at its TTL."""
    holding = workers.hold("cap", HOLDERS, limit=3)
    workers.start(threads=4)
    workers.send([call("job", "cap", i, 0.1, lock_limit=3) for i in range(6)])
    workers.wait(lambda: workers.leases.inspect_line("cap").length == 6, timeout=30, what="6 waiters in the line")
    victim, survivors = holding[1], [holding[0], holding[2]]
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.time()
    ends = lease_ends(workers, "cap")  # the victim's no longer moves: nobody renews it
    assert victim["fence"] in ends, "the victim's lease ended before it was read"

    runs = each_ran(workers, list(range(6)), "cap")
    assert runs[0]["start"] - killed <= TTL + 1.0, "no waiter started within TTL + 1 s of the kill"
    assert {r["slot"] for r in runs} == {victim["slot"]}, "a waiter ran in a slot other than the freed one"
    assert len({r["message_id"] for r in runs}) == len(runs) == 6, "a job ran twice"
    # The survivors kept theirs: still running, still holding, under the fences they started with.
    assert [r for r in workers.runs() if r["n"] == -1] == []
    assert {f for f in lease_ends(workers, "cap")} >= {s["fence"] for s in survivors}
    workers.release("cap")
    ended = workers.wait_runs(2, where=lambda r: r["n"] == -1)
    spans = [(r["start"], r["end"]) for r in runs + ended] + [(victim["start"], ends[victim["fence"]])]
    assert most_at_once(spans) <= 3, f"more than 3 at once: {sorted(spans)}"


def test_workers_restarted_at_once_wait_for_the_old_leases(workers: LimitWorkers) -> None:
    """All workers SIGKILLed mid-run and started again with 16 idle threads, new jobs waiting for them: the old
    holders' slots stay taken until their leases expire, and at no instant do more than 2 run."""
    # A TTL long enough for the new workers to boot and ask while the old leases still hold; the first jobs long
    # enough that two still run when the kill comes, however late a loaded machine sends it.
    jobs = [call("job", "restart", i, 1.5 if i < 6 else 0.3, lock_limit=2, lock_ttl=5_000) for i in range(12)]
    first = workers.start(processes=2, threads=8)
    workers.send(jobs[:6])
    workers.wait_runs(2, "start")
    os.killpg(first.pid, signal.SIGKILL)
    killed = time.time()
    ends = lease_ends(workers, "restart")
    assert len(ends) == 2, f"the key was not held by 2 at the kill: {ends}"
    workers.start(processes=2, threads=8)
    workers.send(jobs[6:])  # in the broker at once, whatever it redelivers of the killed workers' and when

    runs = each_ran(workers, list(range(12)), "restart")
    expired = min(ends.values())
    new_ids = [s["message_id"] for s in workers.sent() if s["args"][1] >= 6]
    asked = [m for m, at in workers.delivered().items() if m in new_ids and at < expired]
    assert asked, "no restarted worker asked before the old leases expired: this test proved nothing"
    finished = {r["fence"] for r in runs}
    cut = [r for r in workers.runs("start") if r["fence"] not in finished]  # the runs the kill cut short
    assert {r["fence"] for r in cut} <= set(ends), f"a run cut short without a lease at the kill: {cut}"
    after = [r for r in runs if r["start"] > killed]
    early = [r for r in after if r["start"] < expired]
    assert early == [], f"{len(early)} jobs started before the old leases expired"
    assert min(r["start"] for r in after) - expired <= 1.0, "no restarted worker took a freed slot within 1 s"
    spans = [(r["start"], r["end"]) for r in runs] + [(r["start"], ends[r["fence"]]) for r in cut]
    assert most_at_once(spans) <= 2, f"more than 2 at once: {sorted(spans)}"


def test_jobs_of_one_key_run_three_at_a_time_in_first_attempt_order(workers: LimitWorkers) -> None:
    # Threads for the 3 running and for the front of the line to wait in place (half of each process's): with
    # fewer, a waiter called forward finds no thread, parks again, and costs two more enqueues.
    workers.start(processes=2, threads=6)
    workers.send([call("job", "fifo", i, 0.1, lock_limit=3) for i in range(30)])
    runs = each_ran(workers, list(range(30)), "fifo")
    assert len({r["message_id"] for r in runs}) == len(runs) == 30, "a job ran twice"
    assert most_at_once([(r["start"], r["end"]) for r in runs]) <= 3
    # Slots freed together go to the first waiters of the line together, and they start at their own pace: a
    # job may start before one that first tried just before it, but never while 3 such still wait.
    for order in ("fence", "start"):
        ranked = sorted(runs, key=lambda r: r[order])
        overtaken = {b["n"]: [a["n"] for a in ranked[i + 1 :] if a["first"] < b["first"]] for i, b in enumerate(ranked)}
        jumps = {n: earlier for n, earlier in overtaken.items() if len(earlier) >= 3}
        assert jumps == {}, f"by {order}, a job went before 3 or more that first tried before it: {jumps}"
    enqueues = workers.enqueues()
    assert sum(enqueues.values()) / 30 <= 3, f"enqueues per message: {sorted(enqueues.values())}"
    assert workers.leases.inspect_line("fifo").length == 0


def test_a_busy_key_does_not_delay_another(workers: LimitWorkers) -> None:
    """A thousand messages wait on key A; one message of key B, sent behind them on the same queue, starts at once."""
    workers.hold("A", 1)
    workers.start(threads=4)
    workers.send([call("job", "A", i, 0.0) for i in range(1_000)])
    workers.wait(lambda: workers.leases.inspect_line("A").length == 1_000, timeout=40, what="1000 waiters on A")
    workers.send([call("job", "B", 0, 0.0)])
    sent = workers.sent()[-1]["at"]
    (run,) = each_ran(workers, [0], "B", timeout=30)
    assert run["start"] - sent <= 1.0, f"B started {run['start'] - sent:.2f}s after it was sent"


def test_waiting_spends_no_retry_and_an_argument_by_name_or_position_is_one_key(workers: LimitWorkers) -> None:
    """``invoice`` has ``max_retries=0``: its messages wait their turn and all run. ``send(7)`` and
    ``send(invoice_id=7)`` render one key, so they never run at once."""
    workers.start(processes=2, threads=4)
    workers.send([call("invoice", 7) if i % 2 else call("invoice", kwargs={"invoice_id": 7}) for i in range(10)])
    runs = workers.wait_runs(10, timeout=60)
    assert {r["key"] for r in runs} == {"invoice:7"}
    assert len({r["message_id"] for r in runs}) == len(runs) == 10, "a message ran twice"
    spans = sorted((r["start"], r["end"]) for r in runs)
    assert most_at_once(spans) == 1, f"two runs of invoice 7 at once: {spans}"
    assert workers.nacks() == [] and workers.dead_letters() == [], "a waiting message was dead-lettered"
