"""End every process descended from this one: for a deposed leader's ``on_lost="exit"``.

Descendants are found in ``/proc`` (Linux) by their parent ids, top down, and each is stopped (``SIGSTOP``) as
it is found; the tree is read again until no new one appears, so none can fork away while the walk goes on;
then all are killed (``SIGKILL``).

A pid names a process only while it lives: one that ends during the walk (a job finishing, an OOM kill) is
reaped by its parent, and its pid can go to a process that is no descendant. So a descendant is signalled
through a pidfd (``pidfd_open``, Linux 5.3), which names that one process, never a later holder of its pid;
it is taken only once ``/proc`` shows, after the pidfd was opened, the same process (its start time) with the
same parent, and that parent is this process or a descendant already held and still alive. Without pidfds,
the start time is checked again just before each signal (a window of one system call for a pid to be reused).

Out of reach: a process that left the tree before the loss (a daemon that double-forked, reparented to init
or a subreaper), one started by another thread of this process after the walk's last round, one that runs
as another user (``EPERM``), and any system without ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from pathlib import Path

#: How many times the tree is read again for processes forked while it was walked (each round stops more).
_ROUNDS = 20

_PIDFDS = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


class _Held:
    """A descendant found, checked and stopped: signalled through its pidfd (or its pid and start time)."""

    __slots__ = ("fd", "pid", "start")

    def __init__(self, pid: int, start: int, fd: int | None) -> None:
        self.pid, self.start, self.fd = pid, start, fd

    def send(self, signum: int) -> None:
        with contextlib.suppress(OSError):  # ended meanwhile (ESRCH), or another user's (EPERM)
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, signum)
            elif not self.ended():
                os.kill(self.pid, signum)

    def ended(self) -> bool:
        """Whether the process has ended (a pidfd is readable then); its pid may be another's already."""
        if self.fd is None:
            stat = _stat(self.pid)
            return stat is None or stat[1] != self.start
        readable, _, _ = select.select([self.fd], [], [], 0)
        return bool(readable)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)


def kill_descendants() -> int:
    """SIGKILL every descendant of this process; return how many were found (0 where ``/proc`` is absent)."""
    me = os.getpid()
    held: dict[int, _Held] = {}
    try:
        for _ in range(_ROUNDS):
            if not _round(me, held):
                break
        for proc in held.values():
            proc.send(signal.SIGKILL)
        return len(held)
    finally:
        for proc in held.values():
            proc.close()


def _round(me: int, held: dict[int, _Held]) -> bool:
    """Read ``/proc`` once; take and stop each descendant not held yet, parents first. Whether any was new."""
    children: dict[int, list[tuple[int, int]]] = {}
    for pid, (parent, start) in _table().items():
        children.setdefault(parent, []).append((pid, start))
    new = False
    todo, seen = [me], {me}
    while todo:
        parent = todo.pop()
        for pid, start in children.get(parent, ()):
            if pid in seen:  # a table read while processes end and start need not be a tree
                continue
            seen.add(pid)
            if pid in held:
                todo.append(pid)  # stopped, it forks no more; but it may have forked before it was stopped
                continue
            proc = _take(pid, start, parent, me, held)
            if proc is None:
                continue
            proc.send(signal.SIGSTOP)
            held[pid] = proc
            new = True
            todo.append(pid)
    return new


def _take(pid: int, start: int, parent: int, me: int, held: dict[int, _Held]) -> _Held | None:
    """``pid`` as a held process, if it is still the one the table showed, still a child of ``parent``."""
    fd: int | None = None
    if _PIDFDS:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # ended (ESRCH), or pidfds unsupported by this kernel (ENOSYS): checked by start time
            if _stat(pid) is None:
                return None
    proc = _Held(pid, start, fd)
    # Read after the pidfd was opened: the same start time says the pidfd names the process of the table, and
    # the same parent that its parent was, at that instant, the pid ``parent``, which a held process that has
    # not ended still has (a pid is not reused before its process ends).
    stat = _stat(pid)
    if stat is None or stat != (parent, start) or (parent != me and held[parent].ended()):
        proc.close()
        return None
    return proc


def _table() -> dict[int, tuple[int, int]]:
    """Every process in ``/proc``: its parent pid and start time."""
    table: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                stat = _stat(int(entry.name))
                if stat is not None:
                    table[int(entry.name)] = stat
    return table


def _stat(pid: int) -> tuple[int, int] | None:
    """The parent pid and start time (clock ticks since boot) of ``pid`` from ``/proc/PID/stat``, or ``None``.

    Read after the last ``)``: a command name may hold any byte, spaces and parentheses too.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # ended meanwhile
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    # fields[0] is the state (field 3 of proc(5)); the parent is field 4, the start time field 22.
    if len(fields) < 20:
        return None
    try:
        return int(fields[1]), int(fields[19])
    except ValueError:
        return None
