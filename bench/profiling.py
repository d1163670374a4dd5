"""Where the time goes: server time per script, a cProfile of one cycle, a py-spy sample of real workers.

* ``SLOWLOG`` at threshold 0 gives each script call's execution time in
  Redis (ACQUIRE_PLAIN, RELEASE_PLAIN, RENEW_MANY per lease) next to the raw baseline's.
* cProfile of 3 000 in-process acquire+release cycles: self time per
  function, ours and redis-py's.
* ``py-spy record --gil`` on the workers of a leases-mode drain (figure 3's
  setting): the share of GIL-holding samples under each function, i.e.
  where the workers' Python CPU goes. Skipped without py-spy (or without
  the ptrace permission it needs).
"""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from dramatiq_leases import Leases
from dramatiq_leases.core import scripts

from .common import Context, FigureResult, table
from .names import THROUGHPUT_QUEUE
from .peers import RAW_RELEASE, TTL_MS, cleanup
from .workers import WorkerGroup, producer, reset_broker, send

#: Metadata of the size LeaseMiddleware stores with every lease.
MIDDLEWARE_META = {
    "actor": "noop",
    "queue": "default",
    "message_id": "6f1c0d9e-8a57-4c1e-9f38-0f4b1d6c2a11",
    "host": "worker-1",
    "pid": "12345",
}


def _script_times(ctx: Context) -> list[list[Any]]:
    """Median execution time in Redis of each script call, from SLOWLOG."""
    client = ctx.client()
    cleanup(client)
    leases = Leases(client)
    raw_release = client.register_script(RAW_RELEASE)
    names = {
        client.register_script(scripts.ACQUIRE).sha: "ACQUIRE",  # the sha of the text the store loads
        client.register_script(scripts.RELEASE).sha: "RELEASE",
        client.register_script(scripts.ACQUIRE_PLAIN).sha: "ACQUIRE_PLAIN",  # a plain lease's, tried first
        client.register_script(scripts.RELEASE_PLAIN).sha: "RELEASE_PLAIN",
        client.register_script(scripts.RENEW_MANY).sha: "RENEW_MANY",
        raw_release.sha: "raw compare-and-delete",
    }
    held = [leases.try_acquire(f"bench:prof:{i}", TTL_MS) for i in range(100)]
    durations: dict[str, list[int]] = collections.defaultdict(list)
    saved = ctx.admin.config_get("slowlog-*")
    ctx.admin.config_set("slowlog-max-len", 100_000)
    for label, meta in (("no metadata", None), ("middleware metadata", MIDDLEWARE_META)):
        ctx.admin.config_set("slowlog-log-slower-than", 0)
        ctx.admin.slowlog_reset()
        for _ in range(500):
            lease = leases.try_acquire("bench:prof", TTL_MS, meta=meta)
            leases.release(lease)  # type: ignore[arg-type]
            if meta is None:
                token = "t"
                client.set("bench:prof:raw", token, nx=True, px=TTL_MS)
                raw_release(keys=["bench:prof:raw"], args=[token])
        for _ in range(20 if meta is None else 0):
            leases.renew_many(held)  # type: ignore[arg-type]
        for entry in ctx.admin.slowlog_get(100_000):
            parts = entry["command"].split(b" ")
            if entry["client_address"] == b"?:0":
                continue
            if parts[0] == b"EVALSHA":
                name = names.get(parts[1].decode(), "?")
                if name == "RENEW_MANY":
                    durations["RENEW_MANY per lease (100 per call)"].append(int(entry["duration"]) / 100)
                elif name != "raw compare-and-delete" or meta is None:
                    durations[f"{name} ({label})" if name.startswith(("ACQUIRE", "RELEASE")) else name].append(
                        int(entry["duration"])
                    )
            elif parts[0] == b"SET" and meta is None:
                durations["raw SET NX PX"].append(int(entry["duration"]))
    ctx.admin.config_set("slowlog-log-slower-than", saved["slowlog-log-slower-than"])
    ctx.admin.config_set("slowlog-max-len", saved["slowlog-max-len"])
    cleanup(client)
    client.close()
    return [[name, statistics.median(v), len(v)] for name, v in sorted(durations.items())]


def _cprofile(ctx: Context) -> str:
    """Top self-time functions of 3 000 in-process acquire+release cycles."""
    client = ctx.client()
    leases = Leases(client)
    for _ in range(100):
        leases.release(leases.try_acquire("bench:cprof", TTL_MS, meta=MIDDLEWARE_META))  # type: ignore[arg-type]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3_000):
        leases.release(leases.try_acquire("bench:cprof", TTL_MS, meta=MIDDLEWARE_META))  # type: ignore[arg-type]
    prof.disable()
    cleanup(client)
    client.close()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(14)
    text = out.getvalue()
    # Keep the table, drop pstats' preamble and the long site-packages prefixes.
    text = text[text.index("   ncalls") :] if "   ncalls" in text else text
    return re.sub(r"\S*/site-packages/", "", re.sub(r"\S*/work/main/", "", text)).rstrip()


def _spy(ctx: Context, seconds: float) -> list[list[Any]] | str:
    """py-spy --gil over workers draining no-op jobs with the middleware: GIL share under each function."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "py-spy is not installed (pip install py-spy): worker profile skipped."
    client = ctx.client()
    reset_broker(client)
    cleanup(client)
    broker = producer(ctx.url)
    for i in range(int(seconds * 4000)):  # more than the workers can drain while sampled
        send(broker, THROUGHPUT_QUEUE, "noop", i)
    broker.close()
    out = Path(tempfile.gettempdir()) / "dramatiq-leases-bench-pyspy.txt"
    with WorkerGroup(ctx.url, {"BENCH_MODE": "leases"}, name="profile") as group:
        time.sleep(1.5)  # past boot
        assert group.proc is not None
        proc = subprocess.run(
            [
                spy,
                "record",
                "--pid",
                str(group.proc.pid),
                "--subprocesses",
                "--gil",
                "--nonblocking",
                "-r",
                "250",
                "-d",
                str(int(seconds)),
                "--format",
                "raw",
                "-o",
                str(out),
            ],
            capture_output=True,
            text=True,
        )
    reset_broker(client)
    cleanup(client)
    client.close()
    if proc.returncode != 0 or not out.exists():
        return f"py-spy failed ({proc.returncode}): {proc.stderr.strip()[-300:]}"
    return summarize_collapsed(out.read_text())


#: Functions worth a row in the worker profile: ours, and the Dramatiq/redis-py work they stand beside.
_SPY_ROWS = (
    "WorkerThread.process_message",
    "LeaseMiddleware.before_process_message",
    "Leases.try_acquire",
    "LeaseMiddleware._end",
    "Leases.release",
    "Heartbeat.track",
    "Condition.notify_all",
    "Heartbeat._renew_loop",
    "Heartbeat._watch_loop",
    "LeaseMiddleware._options",
    "KeyTemplate.render",
    "PrometheusMetrics.",
    "ConsumerThread.post_process_message",
    "Redis._execute_command",
    "PythonRespSerializer.pack",
)


def summarize_collapsed(text: str) -> list[list[Any]]:
    """Inclusive share of samples per function from py-spy's collapsed ("raw") output."""
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        seen = set()
        for frame in stack.split(";"):
            name = frame.split(" (", 1)[0]
            for row in _SPY_ROWS:
                # "PrometheusMetrics." sums every metrics method into one row.
                label = row if row.endswith(".") and name.startswith(row) else name if name == row else None
                if label and label not in seen:
                    inclusive[label] += n
                    seen.add(label)
    return [
        [("PrometheusMetrics.* (all metrics calls)" if k.endswith(".") else k), v / max(1, total) * 100]
        for k, v in sorted(inclusive.items(), key=lambda kv: -kv[1])
    ] + [["(GIL samples)", float(total)]]


def run(ctx: Context) -> FigureResult:
    """Collect the three profiles; ``--quick`` keeps the py-spy sample short."""
    scripts = table(["script call", "median µs in Redis", "calls"], _script_times(ctx))
    spy = _spy(ctx, 3 if ctx.quick else 6)
    spy_table = spy if isinstance(spy, str) else table(["function (inclusive)", "% of GIL samples"], spy)
    prof = _cprofile(ctx)
    return FigureResult(
        key="profile",
        title="Profile",
        method=__doc__ or "",
        tables=[scripts, spy_table, "```\n" + prof + "\n```"],
        goals=[],
        notes=[],
        data={"spy": spy if not isinstance(spy, str) else None},
    )
