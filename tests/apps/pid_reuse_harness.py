"""Process 1 of a private pid namespace, for tests/test_leader.py: does an exiting leader's ``kill_children``
SIGKILL a process that is not its descendant, one that took over a descendant's pid?

``unshare -Urpf --mount-proc python -m tests.apps.pid_reuse_harness URL EVENTS``

It starts ``--idle`` sleeping processes of its own (a busy ``/proc``: every walk of it takes a while), then
tests/apps/leader_app.py with ``--on-lost exit --victim``: once leading, the leader starts a child, the
victim, and a thread that reaps it as soon as it ends (as ``subprocess.run`` on a thread does). When the
leader's walk of its tree stops the victim, this harness SIGKILLs it (an OOM kill, a timeout of its own:
any end between the walk and the leader's exit), the leader's thread reaps it, and the harness forks with
``ns_last_pid`` set until one of its own children has the victim's pid: a process outside the leader's tree.
The harness records (``harness`` events, in EVENTS) whether that process was forked while the leader still
ran and whether it survived the leader's exit. Its namespace ends with it: nothing outlives the test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("events")
    parser.add_argument("--idle", type=int, default=600)
    args = parser.parse_args()
    fd = os.open(args.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(**fields: Any) -> None:
        os.write(fd, (json.dumps({"event": "harness", "t": time.time(), **fields}) + "\n").encode())

    idle = [subprocess.Popen(["sleep", "600"]) for _ in range(args.idle)]
    app = [sys.executable, "-m", "tests.apps.leader_app", args.url, "scheduler", args.events, "--ttl", "1000"]
    leader = subprocess.Popen([*app, "--on-lost", "exit", "--victim"])
    note(step="started", idle=len(idle), leader=leader.pid)
    victim = 0
    while not victim:
        for line in Path(args.events).read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "victim":
                victim = event["victim_pid"]
        time.sleep(0.01)
    stat = Path(f"/proc/{victim}/stat")
    while stat.read_bytes().rsplit(b")", 1)[1].split()[0] != b"T":  # until the leader's walk stops it
        pass
    os.kill(victim, signal.SIGKILL)
    grabbed = 0
    for _ in range(5_000):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(victim - 1))
        pid = os.fork()
        if pid == 0:
            if os.getpid() == victim:
                os.execvp("sleep", ["sleep", "600"])
            os._exit(0)
        if pid == victim:
            grabbed = pid
            break
        os.waitpid(pid, 0)
    leader_ran = leader.poll() is None
    code = leader.wait(30)
    time.sleep(0.1)
    survived = False
    if grabbed:
        done, status = os.waitpid(grabbed, os.WNOHANG)
        survived = done == 0
        if not survived:
            note(step="grabbed-ended", signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
    note(step="done", victim=victim, grabbed=grabbed, while_leader_ran=leader_ran, survived=survived, code=code)


if __name__ == "__main__":
    main()
