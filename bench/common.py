"""Shared helpers: statistics, command and round-trip counting, tables, machine facts.

Counting method (see ``docs/benchmarks.md``):

* **Server commands** come from ``INFO commandstats`` diffs. Redis counts the
  commands a Lua script runs (``redis.call``) as well as the ``EVALSHA`` that
  started it, so this is the server's real work. ``INFO`` itself is excluded.
* **Wire commands** and **round trips** are counted client-side by wrapping
  redis-py's connection: every ``send_command`` is one command put on the wire,
  every ``pack_commands`` (a pipeline) as many as it packs;
  a round trip starts whenever a connection sends after it last read (or for
  the first time). A pipeline of N commands is one send followed by N reads:
  one round trip. Counting is off while latency is timed, so the wrappers cost
  nothing there.
* **Server time** is the sum of ``SLOWLOG`` durations (threshold 0) of the
  commands clients sent: a script's entry covers everything it ran, and the
  entries Redis adds for commands inside a script (client ``?:0``) are left
  out so nothing counts twice. It measures command execution only, not the
  network or the event loop.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import redis
import redis.connection

#: Packages whose versions go into the report.
VERSIONED = ("dramatiq-leases", "redis", "dramatiq", "python-redis-lock", "pottery", "matplotlib")


# Statistics ---------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by the nearest-rank method: a value that was actually measured."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else math.nan


# Counting ---------------------------------------------------------------------------


class WireCounter:
    """Counts round trips and commands sent by every redis-py connection of this process.

    Thread-safe: pottery sends from executor threads. Use :meth:`counting` to
    switch the wrappers on for a block of code.
    """

    def __init__(self) -> None:
        self.round_trips = 0
        self.commands = 0
        self._lock = threading.Lock()
        self._sending: dict[int, bool] = {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[WireCounter]:
        """Install the wrappers for the duration of the block; counts start at zero."""
        cls = redis.connection.AbstractConnection
        orig_send, orig_read = cls.send_packed_command, cls.read_response
        orig_one, orig_many = cls.send_command, cls.pack_commands
        counter = self
        self.round_trips = self.commands = 0
        self._sending.clear()

        def send_packed_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            with counter._lock:
                # A send that follows a read (or comes first) opens a new round trip;
                # further sends before any read (a pipeline in chunks) belong to it.
                if not counter._sending.get(id(conn), False):
                    counter.round_trips += 1
                counter._sending[id(conn)] = True
            return orig_send(conn, *args, **kwargs)

        def read_response(conn: Any, *args: Any, **kwargs: Any) -> Any:
            with counter._lock:
                counter._sending[id(conn)] = False
            return orig_read(conn, *args, **kwargs)

        def send_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            with counter._lock:
                counter.commands += 1
            return orig_one(conn, *args, **kwargs)

        def pack_commands(conn: Any, commands: Any) -> Any:
            commands = list(commands)
            with counter._lock:
                counter.commands += len(commands)
            return orig_many(conn, commands)

        cls.send_packed_command = send_packed_command  # type: ignore[method-assign]
        cls.read_response = read_response  # type: ignore[method-assign]
        cls.send_command = send_command  # type: ignore[method-assign]
        cls.pack_commands = pack_commands  # type: ignore[method-assign]
        try:
            yield self
        finally:
            cls.send_packed_command = orig_send  # type: ignore[method-assign]
            cls.read_response = orig_read  # type: ignore[method-assign]
            cls.send_command = orig_one  # type: ignore[method-assign]
            cls.pack_commands = orig_many  # type: ignore[method-assign]


def command_stats(client: redis.Redis) -> Counter[str]:
    """Calls per command so far, from ``INFO commandstats`` (``INFO`` itself left out)."""
    raw: Mapping[str, Any] = client.info("commandstats")
    out: Counter[str] = Counter()
    for name, stats in raw.items():
        cmd = name.removeprefix("cmdstat_")
        if cmd != "info":
            out[cmd] = int(stats["calls"])
    return out


@dataclass
class Counts:
    """What one measured block cost: round trips and wire commands (client side), server commands by name."""

    round_trips: int
    wire_commands: int
    server: Counter[str]
    server_us: float = 0.0
    repeats: int = 1

    @property
    def server_total(self) -> int:
        return sum(self.server.values())

    def per(self, n: int) -> Counts:
        """The same counts attributed to ``n`` repeats (for per-cycle figures)."""
        return Counts(self.round_trips, self.wire_commands, self.server, self.server_us, repeats=n)

    @property
    def rtt_each(self) -> float:
        return self.round_trips / self.repeats

    @property
    def wire_each(self) -> float:
        return self.wire_commands / self.repeats

    @property
    def server_each(self) -> float:
        return self.server_total / self.repeats

    @property
    def server_us_each(self) -> float:
        return self.server_us / self.repeats

    def breakdown(self, limit: int = 8) -> str:
        """Server commands per repeat by name, largest first: ``"evalsha 2, hset 2, ..."``."""
        parts = [f"{name} {calls / self.repeats:g}" for name, calls in self.server.most_common(limit)]
        return ", ".join(parts)


@contextlib.contextmanager
def measure_commands(admin: redis.Redis, wire: WireCounter) -> Iterator[list[Counts]]:
    """Count round trips, wire commands and server commands of the block; the result is appended to the list.

    ``admin`` reads ``INFO`` outside the wire counter, so its own commands never count.
    """
    out: list[Counts] = []
    saved = admin.config_get("slowlog-*")
    admin.config_set("slowlog-max-len", SLOWLOG_LEN)
    admin.config_set("slowlog-log-slower-than", 0)
    admin.slowlog_reset()
    before = command_stats(admin)
    try:
        with wire.counting():
            yield out
            rtt, cmds = wire.round_trips, wire.commands
        after = command_stats(admin)
        entries = admin.slowlog_get(SLOWLOG_LEN)
    finally:
        admin.config_set("slowlog-log-slower-than", saved["slowlog-log-slower-than"])
        admin.config_set("slowlog-max-len", saved["slowlog-max-len"])
    if len(entries) >= SLOWLOG_LEN:
        raise RuntimeError(f"more than {SLOWLOG_LEN} commands in one measured block: server time would be cut short")
    server_us = sum(
        int(e["duration"])
        for e in entries
        if e["client_address"] != b"?:0" and e["command"].split(b" ", 1)[0].upper() not in _ADMIN_COMMANDS
    )
    out.append(Counts(rtt, cmds, after - before, float(server_us)))


#: Entries kept by SLOWLOG while a block is measured; a block must issue fewer commands.
SLOWLOG_LEN = 200_000

#: The admin connection's own commands, left out of server time.
_ADMIN_COMMANDS = {b"SLOWLOG", b"CONFIG", b"INFO"}


# Tables -------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table, which also reads well in a terminal."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=False)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + " |")
    return "\n".join(lines)


def fmt(value: Any) -> str:
    """Numbers with sensible precision; everything else as ``str``."""
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def verdict(ok: bool) -> str:
    """The word used in tables and the doc for a goal."""
    return "MET" if ok else "MISSED"


# Machine -------------------------------------------------------------------------------


def machine_info(admin: redis.Redis) -> dict[str, str]:
    """nproc, CPU model, OS, Python, Redis and library versions."""
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, str] = {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "redis-server": str(admin.info("server")["redis_version"]),
    }
    for pkg in VERSIONED:
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = "not installed"
    info["dramatiq-leases source"] = package_revision()
    return info


def package_revision() -> str:
    """The commit the package was measured at, flagged when ``dramatiq_leases/`` had uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "dramatiq_leases"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"{head}" + (" + uncommitted changes in dramatiq_leases/" if dirty else "")


def cpu_ticks() -> tuple[int, int, int]:
    """Machine-wide CPU ticks so far from ``/proc/stat``: (total, idle, steal); zeros where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0, 0
    steal = fields[7] if len(fields) > 7 else 0
    return sum(fields[:8]), fields[3] + (fields[4] if len(fields) > 4 else 0), steal


def cpu_share(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[float, float]:
    """Between two :func:`cpu_ticks`: the busy share of all CPUs and the share the VM's host stole, in %."""
    total = after[0] - before[0]
    if total <= 0:
        return math.nan, math.nan
    return 100 * (total - (after[1] - before[1])) / total, 100 * (after[2] - before[2]) / total


def load_average() -> str:
    """The 1-minute load average, to show whether other work shared the machine."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


# Results -----------------------------------------------------------------------------------


@dataclass
class Goal:
    """One goal from the issue, with what this run measured."""

    figure: str
    goal: str
    measured: str
    met: bool


@dataclass
class FigureResult:
    """What a figure module hands to the report: Markdown tables, goals, notes, raw data for the chart."""

    key: str
    title: str
    method: str
    tables: list[str]
    goals: list[Goal]
    notes: list[str]
    data: dict[str, Any]
    seconds: float = 0.0
    #: Provenance, filled in by ``__main__``: the package commit, when it ran (UTC), and the 1-minute
    #: load average before and after, so a figure re-run alone (``--merge``) says so in the doc.
    revision: str = ""
    measured_at: str = ""
    load: tuple[str, str] = ("", "")
    #: Busy and stolen shares of all CPUs while it ran (%): a high steal means the VM's host was busy.
    cpu: tuple[float, float] = (math.nan, math.nan)
    merged: bool = False


@dataclass
class Context:
    """What every figure gets: the private Redis, the mode, and the shared counters."""

    url: str
    quick: bool
    admin: redis.Redis
    wire: WireCounter

    def client(self, **kwargs: Any) -> redis.Redis:
        """A fresh client of the benchmark Redis (database 0)."""
        return redis.Redis.from_url(self.url, socket_timeout=10, **kwargs)
