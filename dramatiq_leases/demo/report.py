"""What the demo reports along the way and at the end: the status line, and the summary with its checks."""

from __future__ import annotations

from ..core import LeaseInfo, State
from .chaos import Kill
from .console import Console
from .events import Jobs
from .stack import Stack


def max_overlap(intervals: list[tuple[int, int]]) -> int:
    """The largest number of ``(start, end)`` intervals open at one instant; touching ends do not overlap."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = current = 0
    for _, step in points:  # at equal times -1 sorts first: one ending as the next starts is not overlap
        current += step
        best = max(best, current)
    return best


def status(console: Console, jobs: Jobs, leases_seen: dict[str, LeaseInfo], busy_retries: int) -> None:
    """Say how many jobs are done, how many messages were parked in a line, and which leases are held."""
    held = (
        " ".join(
            f"{k}#{i.fence}" + ("" if i.state is State.ALIVE else f"({i.state.value})")
            for k, i in sorted(leases_seen.items())
        )
        or "-"
    )
    console.say(
        f"status: {len(jobs.done_ids() & jobs.messages.keys())}/{len(jobs.messages)} done, "
        f"busy retries {busy_retries}, held: {held}"
    )


def summary(console: Console, jobs: Jobs, kill: Kill, stack: Stack, *, metrics_url: str, took: float) -> list[str]:
    """Check the run and write its summary; returns the checks that failed (none if the story held)."""
    failures: list[str] = []
    done = [a for a in jobs.attempts if a.outcome == "done"]
    once = len({a.message_id for a in done})
    total = len(jobs.messages)
    twice = len(done) - once
    if once != total:
        failures.append(f"only {once} of {total} jobs completed")
    concurrency, fences = _runs_per_key(jobs, kill, stack)
    if concurrency != 1:
        failures.append(f"max concurrency per key was {concurrency}")
    if any(f != sorted(set(f)) for f in fences.values()):
        failures.append("fencing tokens did not rise strictly per key")
    failures += _orphan_failures(kill)
    killed = jobs.killed_messages(kill.pid)
    redone = {a.message_id: a for a in done if a.message_id in killed and a.start_ms > kill.kill_ms}
    if not killed:
        failures.append("the killed process was running no job")
    if killed - redone.keys():
        failures.append("a killed job's message never completed")

    console.line()
    console.line("summary")
    note = "each message exactly once" if not twice else f"{twice} redelivered and completed twice"
    console.line(f"  jobs completed          {once}/{total} ({note})")
    console.line(
        f"  busy retries            {stack.busy_retries()} (messages parked in their invoice's line until their turn)"
    )
    console.line(f"  max concurrent per key  {concurrency}")
    console.line(
        f"  killed                  pid {kill.pid} (SIGKILL) while it held "
        + ", ".join(f"{o.key} fence {o.fence}" for o in kill.orphans)
    )
    for o in kill.orphans:
        overdue, deadline, expired = o.timeline(kill.kill_ms)
        steps = f"heartbeat overdue {overdue:.1f}s, "
        if deadline is not None:
            steps += f"holder's deadline {deadline:.1f}s, "
        fate = "released by someone" if o.released else f"expired {expired:.1f}s after the kill (never released)"
        console.line(f"  orphaned lease          {o.key} fence {o.fence}: {steps}{fate}")
    for a in sorted(redone.values(), key=lambda a: a.key):
        console.line(
            f"  killed job              {a.key} job {a.job + 1}: redelivered and completed with fence {a.fence}"
        )
    console.line(
        "  fences per key          " + "  ".join(f"{k} {','.join(map(str, f))}" for k, f in sorted(fences.items()))
    )
    console.line(f"  metrics                 {metrics_url} (served until the demo exits)")
    console.line(f"  took                    {took:.1f}s")
    return failures


def _runs_per_key(jobs: Jobs, kill: Kill, stack: Stack) -> tuple[int, dict[str, list[int]]]:
    """The most runs of one key at once, and each key's fences in the order its runs started."""
    intervals: dict[str, list[tuple[int, int]]] = {}
    fences: dict[str, list[int]] = {}
    for a in sorted(jobs.attempts, key=lambda a: a.start_ms):
        if a.end_ms is not None:
            end = a.end_ms
        elif a.pid == kill.pid:
            end = kill.kill_ms  # a killed job ran until the kill
        else:
            end = stack.server_ms()  # unknown: assume it still runs, the strict reading
        intervals.setdefault(a.key, []).append((a.start_ms, end))
        fences.setdefault(a.key, []).append(a.fence)
    return max((max_overlap(v) for v in intervals.values()), default=0), fences


def _orphan_failures(kill: Kill) -> list[str]:
    """What went wrong with the leases the kill orphaned: each must expire, seen overdue then dead."""
    failures = []
    if any(o.released for o in kill.orphans):
        failures.append("an orphaned lease was released by someone instead of expiring")
    order = [State.HEARTBEAT_OVERDUE, State.HOLDER_DEAD]
    if any(o.seen != [s for s in order if s in o.seen] for o in kill.orphans):
        failures.append(
            "an orphaned lease was seen in an unexpected state or order: "
            + "; ".join(f"{o.key} {[s.value for s in o.seen]}" for o in kill.orphans)
        )
    return failures
