"""K ``hold`` jobs on one key, sent at once to real workers (2 x 8), and what their log says (figures 4 and 6)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .common import Context
from .enqueues import enqueue_counts
from .names import HOLD_QUEUE
from .peers import cleanup
from .workers import WorkerGroup, producer, reset_broker, send, wait_log_length, wait_ready


@dataclass
class HoldRun:
    """One run: ``sent`` (message ids, in send order) at ``t0``; ``done``, the jobs that ended, by start."""

    k: int
    job_ms: int
    t0: float
    sent: list[str]
    done: list[dict[str, Any]]
    #: Enqueues per message id (empty unless counted).
    enqueues: dict[str, int]

    @property
    def completed(self) -> int:
        """How many of the sent messages ran to the end (each counted once)."""
        return len({r["message_id"] for r in self.done} & set(self.sent))

    @property
    def extra_runs(self) -> int:
        """Runs beyond one per message (a message that ran twice)."""
        return len(self.done) - self.completed

    @property
    def makespan(self) -> float:
        """From the first send to the last job's end (s)."""
        return max(r["end"] for r in self.done) - self.t0 if self.done else float("nan")

    @property
    def ideal(self) -> float:
        """K jobs one after the other, without a gap (s)."""
        return self.k * self.job_ms / 1000

    @property
    def first_start(self) -> float:
        """From the first send to the first job's start (s)."""
        return self.done[0]["start"] - self.t0 if self.done else float("nan")

    @property
    def gaps_ms(self) -> list[float]:
        """Handoffs: from each job's end to the next job's start (ms; negative if they overlap)."""
        return [(b["start"] - a["end"]) * 1000 for a, b in itertools.pairwise(self.done)]

    @property
    def overlaps(self) -> int:
        """Jobs that started before an earlier job ended: two holders at once."""
        count, latest_end = 0, float("-inf")
        for r in self.done:
            count += r["start"] < latest_end
            latest_end = max(latest_end, r["end"])
        return count

    @property
    def inversions(self) -> int:
        """Pairs of jobs that started in the opposite order to their sends."""
        order = {message_id: i for i, message_id in enumerate(self.sent)}
        return inversions([order[r["message_id"]] for r in self.done if r.get("message_id") in order])

    @property
    def enqueues_per_message(self) -> list[int]:
        """Enqueues of each sent message (the send included when counted)."""
        return [self.enqueues.get(message_id, 0) for message_id in self.sent]


def inversions(values: Sequence[int]) -> int:
    """Pairs ``i < j`` with ``values[i] > values[j]`` (merge sort, so K = 1 000 stays instant)."""

    def count(xs: list[int]) -> tuple[list[int], int]:
        if len(xs) < 2:
            return xs, 0
        left, a = count(xs[: len(xs) // 2])
        right, b = count(xs[len(xs) // 2 :])
        merged, n, i, j = [], a + b, 0, 0
        while i < len(left) and j < len(right):
            if left[i] <= right[j]:
                merged.append(left[i])
                i += 1
            else:
                merged.append(right[j])
                n += len(left) - i
                j += 1
        return merged + left[i:] + right[j:], n

    return count(list(values))[1]


def run_holds(
    ctx: Context,
    env: Mapping[str, str],
    k: int,
    job_ms: int,
    timeout: float,
    *,
    name: str,
    key: str = "handoff",
    count_enqueues: bool = False,
) -> HoldRun:
    """Start 2 x 8 workers with ``env``, send K ``hold(key, job_ms)`` at once once both poll, wait for them all.

    Waits at most ``timeout`` seconds after the sends; the run then holds the jobs that ended by then.
    With ``count_enqueues``, every enqueue is counted, the producer's send included (read once the
    workers have stopped, so nothing is still on its way).
    """
    client = ctx.client()
    reset_broker(client)
    cleanup(client)
    if count_enqueues:
        env = {**env, "BENCH_COUNT_ENQUEUES": "1"}
    with WorkerGroup(ctx.url, env, processes=2, threads=8, name=name) as group:
        wait_ready(client, 2, group=group)
        broker = producer(ctx.url, count_enqueues=count_enqueues)
        t0 = time.time()
        sent = [send(broker, HOLD_QUEUE, "hold", key, job_ms) for _ in range(k)]
        records = wait_log_length(client, 2 * k, timeout)  # each job logs its start, then its end
        broker.close()
    enqueues = enqueue_counts(client) if count_enqueues else {}
    cleanup(client)
    client.close()
    done = sorted((r for r in records if r["end"]), key=lambda r: r["start"])
    return HoldRun(k=k, job_ms=job_ms, t0=t0, sent=sent, done=done, enqueues=enqueues)
