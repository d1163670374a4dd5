"""The demo's crash: SIGKILL a worker holding a lease, and follow the leases it orphaned until they expire."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core import LeaseInfo, Leases, State, stale_after
from .console import Console
from .events import Jobs
from .stack import Stack

#: How far into a job the holder is killed, in seconds.
KILL_AFTER = 0.4

#: Seconds after the first job starts during which the demo waits for a worker holding a
#: single lease to kill (the clearest story); after that it kills any holder.
PREFER_SINGLE_FOR = 1.5


@dataclass
class Orphan:
    """A lease whose holder the demo killed."""

    key: str
    fence: int
    last_seen: LeaseInfo
    gone_at: float | None = None
    released: bool = False
    #: States seen while it lingered, in order (observed by polling: a short one may be missed).
    seen: list[State] = field(default_factory=list)

    def timeline(self, kill_ms: int) -> tuple[float, float | None, float]:
        """Seconds after the kill at which its heartbeat turned overdue, its holder's deadline passed, and
        its TTL ran out: the facts stored in the last snapshot of it, not when the demo happened to look."""
        info = self.last_seen
        overdue = (info.renewed_ms + stale_after(info.interval) - kill_ms) / 1000
        deadline = info.holder_deadline_ms
        expiry = (info.now_ms + info.ttl_left - kill_ms) / 1000
        return overdue, (deadline - kill_ms) / 1000 if deadline is not None else None, expiry


@dataclass
class Kill:
    """The worker process the demo killed, and the leases it left behind."""

    pid: int
    kill_ms: int
    killed_at: float
    orphans: list[Orphan]


def state_news(info: LeaseInfo) -> str:
    """One line on an orphan's new state, as ``dramatiq-leases show`` would explain it."""
    deadline = info.holder_deadline_ms
    until = (deadline - info.now_ms) / 1000 if deadline is not None else 0.0
    expires = info.ttl_left / 1000
    if info.state is State.HEARTBEAT_OVERDUE:
        return (
            f"heartbeat_overdue: no renewal for {info.heartbeat_age:.1f}s, but its holder may still be "
            f"running until its deadline in {until:.1f}s, and stopping until its TTL runs out in "
            f"{expires:.1f}s: nobody may release it before"
        )
    if info.state is State.HOLDER_DEAD:
        return (
            f"holder_dead: its holder's deadline passed {-until:.1f}s ago, no holder can still believe it "
            f"holds it; its TTL runs out in {expires:.1f}s"
        )
    return f"{info.state.value}: its TTL runs out in {expires:.1f}s"


class Chaos:
    """Watches the leases, kills one holder mid-job, and follows what it left behind."""

    def __init__(self, console: Console, stack: Stack, jobs: Jobs) -> None:
        self.console = console
        self.stack = stack
        self.jobs = jobs
        #: The leases seen at the last look, by key.
        self.leases_seen: dict[str, LeaseInfo] = {}
        self.kill: Kill | None = None

    def orphan(self, key: str, fence: int) -> Orphan | None:
        """The orphan that is the grant ``fence`` of ``key``, if the kill left one."""
        for orphan in self.kill.orphans if self.kill else []:
            if orphan.key == key and orphan.fence == fence:
                return orphan
        return None

    def watch_leases(self, leases: Leases) -> None:
        """Look at the leases again: tell each orphan's new state, and each grant that ended without a release."""
        now = {info.key: info for info in leases.scan()}
        for key, before in self.leases_seen.items():
            after = now.get(key)
            orphan = self.orphan(key, before.fence)
            if after is not None and after.fence == before.fence:
                if orphan is not None:
                    orphan.last_seen = after
                    if after.state is not State.ALIVE and after.state not in orphan.seen:
                        orphan.seen.append(after.state)
                        self.console.say(f"{key}  fence {after.fence}  {state_news(after)}")
                continue
            # The grant seen before has ended: released by its owner, or expired by its TTL.
            released = leases.fence_state(key).get("released", 0) >= before.fence
            if orphan is not None and self.kill is not None:
                orphan.gone_at, orphan.released = time.monotonic(), released
                if not released:
                    expired_ms = before.now_ms + before.ttl_left - self.kill.kill_ms
                    self.console.say(
                        f"{key}  fence {before.fence}  EXPIRED by its TTL {expired_ms / 1000:.1f}s "
                        "after its holder was killed: the orphaned lease is gone, "
                        "the invoice is free again"
                    )
            elif not released:
                self.console.say(f"{key}  fence {before.fence}  expired by its TTL (no release seen)")
        self.leases_seen = now

    def maybe_kill(self, leases: Leases) -> None:
        """SIGKILL a worker of this run that has been running a job under its lease for a while (once)."""
        if self.kill is not None:
            return
        now_ms = self.stack.server_ms()
        host = socket.gethostname()
        victim = self._victim(now_ms, host)
        if victim is not None:
            pid, started_ms = victim
            self._kill(leases, pid, host, into=(now_ms - started_ms) / 1000)

    def _victim(self, now_ms: int, host: str) -> tuple[int, int] | None:
        """The pid of a holder to kill and when its job started, or ``None`` if there is none yet."""
        per_pid: dict[str, int] = {}
        for info in self.leases_seen.values():
            per_pid[info.meta.get("pid", "")] = per_pid.get(info.meta.get("pid", ""), 0) + 1
        first_start = min((a.start_ms for a in self.jobs.attempts), default=now_ms)
        picky = now_ms - first_start < (KILL_AFTER + PREFER_SINGLE_FOR) * 1000
        for info in self.leases_seen.values():
            if picky and per_pid[info.meta.get("pid", "")] > 1:
                continue
            pid = int(info.meta.get("pid", "0") or 0)
            running = [
                a for a in self.jobs.attempts if a.key == info.key and a.fence == info.fence and a.end_ms is None
            ]
            if (
                info.state is not State.ALIVE
                or not running
                or info.meta.get("host") != host
                or pid <= 0
                or now_ms - running[0].start_ms < KILL_AFTER * 1000
            ):
                continue
            if Path("/proc").is_dir() and self.stack.instance_of(pid) is None:
                continue  # not one of our workers: never kill a stranger
            return pid, running[0].start_ms
        return None

    def _kill(self, leases: Leases, pid: int, host: str, into: float) -> None:
        """SIGKILL ``pid``, ``into`` seconds into its job, and take every lease it held as an orphan."""
        label = self.stack.label(pid)  # before the kill: it reads the process's parent
        os.kill(pid, signal.SIGKILL)
        kill = self.kill = Kill(pid, self.stack.server_ms(), time.monotonic(), [])
        with contextlib.suppress(Exception):
            from prometheus_client import multiprocess

            # Its "live" gauges no longer count.
            multiprocess.mark_process_dead(pid, str(self.stack.metrics_dir))  # type: ignore[no-untyped-call]
        # Every lease the process held is now an orphan, not only the one that picked it.
        self.leases_seen = {i.key: i for i in leases.scan()}
        kill.orphans = [
            Orphan(i.key, i.fence, i)
            for i in self.leases_seen.values()
            if i.meta.get("pid") == str(pid) and i.meta.get("host") == host
        ]
        held = ", ".join(f"{o.key} (fence {o.fence})" for o in kill.orphans)
        left = "that lease stays" if len(kill.orphans) == 1 else "those leases stay"
        self.console.say(
            f"KILL -9 {label}, {into:.1f}s into a job; it held {held}: {left} behind, and nobody will release it"
        )
        for o in kill.orphans:
            overdue, deadline, expiry = o.timeline(kill.kill_ms)
            dead = f", holder_dead at +{deadline:.1f}s (its holder's deadline)" if deadline is not None else ""
            self.console.say(
                f"{o.key}  fence {o.fence}  ahead, from the kill: heartbeat_overdue at +{overdue:.1f}s"
                f"{dead}, expired by its TTL at +{expiry:.1f}s"
            )
