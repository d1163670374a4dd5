"""A scheduler-like process for tests/test_leader.py: stands by for a leader key and, while it leads, ticks.

``python -m tests.apps.leader_app URL KEY EVENTS [--ttl MS] [--on-lost raise|exit|callback] [--tick S]
[--trust-raise] [--app-sigurg] [--child] [--keep-children] [--victim] [--stuck-log]``

Every event is a JSON line appended to the file ``EVENTS`` with ``time.time()`` (one clock for every process
of a test, and the test's own): ``standby``, ``leader`` (with the fence), ``tick`` (with the fence and the
lease's local deadline as a wall-clock time), ``lost`` (the reason, and how it was told). A lost leader goes
back to standby, as the README's recipe does; with ``--on-lost exit`` the process ends with Leader's code.

``--trust-raise``: the loop ticks without looking at ``leader.lease``, relying on LeaderLost alone (as a
scheduler's blocking ``start()`` does). ``--app-sigurg``: once leading, the app installs a SIGURG handler of
its own (``app_sigurg`` events), as some libraries do. ``--child``: once leading, it starts a child process
that ticks (``child_tick``) with the fence until killed; ``--keep-children`` gives ``kill_children=False``.
``--victim``: once leading, it starts a ``sleep`` child (``victim`` event) and a thread that reaps it as soon
as it ends, as ``subprocess.run`` on a thread would (tests/apps/pid_reuse_harness.py). ``--stuck-log``:
once leading, a thread takes the log handler's lock for good, as one stuck writing to a full pipe would.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from dramatiq_leases import Leader, LeaderLost, Leases
from dramatiq_leases.core.lease import Lease, LostReason

#: The child of ``--child``: ticks with its parent's fence, as a worker the leader started would work on.
_CHILD = """
import json, os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
while True:
    line = {"event": "child_tick", "t": time.time(), "pid": os.getpid(), "fence": int(sys.argv[2])}
    os.write(fd, (json.dumps(line) + "\\n").encode())
    time.sleep(float(sys.argv[3]))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("key")
    parser.add_argument("events")
    parser.add_argument("--ttl", type=int, default=1_000)
    parser.add_argument("--on-lost", choices=["raise", "exit", "callback"], default="raise")
    parser.add_argument("--tick", type=float, default=0.05)
    parser.add_argument("--trust-raise", action="store_true")
    parser.add_argument("--app-sigurg", action="store_true")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--keep-children", action="store_true")
    parser.add_argument("--victim", action="store_true")
    parser.add_argument("--stuck-log", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A short socket timeout: a renewal into a partition gives up well before the deadline (the watchdog
    # declares the loss at the deadline either way).
    leases = Leases.from_url(args.url, socket_timeout=0.5)
    fd = os.open(args.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
        os.write(fd, line.encode())  # one write of an O_APPEND file: whole lines, in order

    told = threading.Event()

    def on_lost(lease: Lease, reason: LostReason) -> None:
        note("lost", fence=lease.fence, reason=reason.value, how="callback")
        told.set()

    leader = Leader(
        leases,
        args.key,
        ttl=args.ttl,
        on_lost=on_lost if args.on_lost == "callback" else args.on_lost,
        kill_children=not args.keep_children,
    )
    while True:
        note("standby")
        told.clear()
        try:
            with leader:
                note("leader", fence=leader.fence)
                if args.app_sigurg:
                    signal.signal(signal.SIGURG, lambda signum, frame: note("app_sigurg"))
                if args.child:
                    child = [sys.executable, "-c", _CHILD, args.events, str(leader.fence), str(args.tick)]
                    note("child", child_pid=subprocess.Popen(child).pid)
                if args.stuck_log:
                    taken = threading.Event()

                    def stuck(taken: threading.Event) -> None:
                        logging.getLogger().handlers[0].acquire()  # and never released
                        taken.set()

                    threading.Thread(target=stuck, args=(taken,), daemon=True).start()
                    taken.wait()
                    note("stuck_log")
                if args.victim:
                    victim = subprocess.Popen(["sleep", "600"])
                    threading.Thread(target=victim.wait, daemon=True).start()
                    note("victim", victim_pid=victim.pid)
                while not told.is_set():
                    lease = leader.lease
                    if lease is None and not args.trust_raise:
                        break
                    # The work a scheduler does while it leads: here, a record of when it did it.
                    deadline = time.time() + lease.remaining() if lease else None
                    note("tick", fence=leader.fence, deadline=deadline, is_leader=leader.is_leader)
                    time.sleep(args.tick)
        except LeaderLost as lost:
            note("lost", fence=lost.fence, reason=lost.reason.value if lost.reason else "", how="raise")
        else:
            reason = leader.lost_reason
            if reason is not None and not told.is_set():  # seen by the loop before the exception could land
                note("lost", fence=leader.fence, reason=reason.value, how="seen")


if __name__ == "__main__":
    main()
