"""End every process descended from this one: for a deposed leader's ``on_lost="exit"``.

Descendants are found in ``/proc`` (Linux) by their parent ids. Each is stopped (``SIGSTOP``) as it is found
and the tree is read again until no new one appears, so none can fork away while the walk goes on; then all
are killed (``SIGKILL``). A stopped parent does not reap, so no pid found can be reused before the kill.
Out of reach: a process that left the tree before the loss (a daemon that double-forked, reparented to
init or a subreaper), and any system without ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

#: How many times the tree is read again for processes forked while it was walked (each round stops more).
_ROUNDS = 20


def kill_descendants() -> int:
    """SIGKILL every descendant of this process; return how many were found (0 where ``/proc`` is absent)."""
    me = os.getpid()
    found: set[int] = set()
    for _ in range(_ROUNDS):
        new = _descendants(me) - found
        if not new:
            break
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        found |= new
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(found)


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            parent = _parent(entry)
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _parent(entry: Path) -> int | None:
    """The parent pid from ``/proc/PID/stat`` (read after the last ``)``: a command name may hold any byte)."""
    try:
        stat = (entry / "stat").read_bytes()
    except OSError:  # ended meanwhile
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None
