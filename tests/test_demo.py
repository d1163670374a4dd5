"""``dramatiq-leases demo`` run as the README says: it passes its checks and leaves nothing behind."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from .support.waiting import wait_for

pytestmark = pytest.mark.system


def _started_by(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``marker``: every process the demo started inherits it."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DEMO_TEST_MARKER") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue  # gone meanwhile, or not ours to read
    return found


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


ROOT = Path(__file__).parents[1]


def test_demo_runs_its_story_passes_its_checks_and_cleans_up() -> None:
    marker = uuid.uuid4().hex
    env = {**os.environ, "DEMO_TEST_MARKER": marker}
    env.pop("REDIS_URL", None)  # the README's first command runs on a machine with no Redis configured
    # Exactly the README's command, with the virtualenv this suite runs in.
    done = subprocess.run(
        ["make", "-s", "demo", f"VENV={sys.prefix}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    took = re.search(r"^  took +([\d.]+)s$", out, re.M)
    assert took is not None, out  # how long it took is a figure of the demo's, not a promise of this test

    summary = out[out.index("\nsummary\n") :]
    assert re.search(r"^  jobs completed +12/12 \(each message exactly once\)$", summary, re.M), summary
    assert re.search(r"^  max concurrent per key +1$", summary, re.M), summary
    assert re.search(r"^  busy retries +[1-9]\d*", summary, re.M), summary
    timelines = re.findall(
        r"^  orphaned lease +(invoice:\d) fence (\d+): heartbeat overdue ([\d.]+)s, holder's "
        r"deadline ([\d.]+)s, expired ([\d.]+)s after the kill \(never released\)$",
        summary,
        re.M,
    )
    assert timelines, summary
    orphans = [(key, fence, expired) for key, fence, _, _, expired in timelines]
    assert all(0 < float(seconds) <= 3.1 for _, _, seconds in orphans), "an orphan outlived its 3 s TTL"
    for _, _, overdue, deadline, expired in timelines:
        # With a 3 s TTL renewed every second: overdue 2.5 s after the last renewal, the holder's own deadline
        # at 2.7 s (TTL less its 10% margin), the key gone at 3 s. Dead means past that deadline, not overdue.
        assert 0 < float(overdue) < float(deadline) < float(expired), summary
    killed_jobs = re.findall(
        r"^  killed job +(invoice:\d) job \d: redelivered and completed with fence (\d+)$", summary, re.M
    )
    assert sorted(k for k, _ in killed_jobs) == sorted(k for k, _, _ in orphans)
    for key, fence in killed_jobs:
        orphan_fence = next(int(f) for k, f, _ in orphans if k == key)
        assert int(fence) > orphan_fence, "the redelivered job must run under a newer fencing token"
    fences = re.search(r"^  fences per key +(.*)$", summary, re.M)
    assert fences is not None
    for per_key in re.findall(r"invoice:\d ([\d,]+)", fences.group(1)):
        values = [int(v) for v in per_key.split(",")]
        assert values == sorted(set(values)), "each grant of a key gets a higher fence"
    assert summary.rstrip().endswith("demo OK")

    # The live part of the story was shown as it happened.
    assert re.search(r"KILL -9 worker \d \(pid \d+\)", out)
    assert re.search(
        r"invoice:\d  fence \d+  ahead, from the kill: heartbeat_overdue at \+[\d.]+s, holder_dead at "
        r"\+[\d.]+s \(its holder's deadline\), expired by its TTL at \+[\d.]+s",
        out,
    )
    # Seen by polling, so either may be missed, but never in the wrong order nor with a wrong meaning.
    overdue = re.search(
        r"heartbeat_overdue: no renewal for [\d.]+s, but its holder may still be running until its "
        r"deadline in [\d.]+s, and stopping until its TTL runs out in [\d.]+s: nobody may release it before",
        out,
    )
    dead = re.search(r"holder_dead: its holder's deadline passed [\d.]+s ago", out)
    if overdue and dead:
        assert overdue.start() < dead.start()
    assert re.search(r"EXPIRED by its TTL", out)
    assert re.search(r"<- a killed job, redelivered", out)
    assert re.search(r"^  metrics   http://127\.0\.0\.1:\d+/metrics$", out, re.M)

    # Nothing it started survives it: workers (by inherited environment) and its Redis (by port;
    # redis-server overwrites its environment with its process title).
    wait_for(lambda: not _started_by(marker), timeout=5, what="the demo's processes to be gone")
    port = re.search(r"^  redis     redis://127\.0\.0\.1:(\d+)/0", out, re.M)
    assert port is not None
    assert not _listening(int(port.group(1))), "the demo's private Redis is still running"
    metrics_port = re.search(r"^  metrics   http://127\.0\.0\.1:(\d+)/", out, re.M)
    assert metrics_port is not None and not _listening(int(metrics_port.group(1)))
