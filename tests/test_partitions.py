"""Network partitions between worker hosts and Redis (issue 13, item 4).

Two worker "hosts", ``a`` and ``b``, each a network namespace linked to the root namespace by a veth pair
with a /30 subnet of its own (tests/support/netns.py), run real ``dramatiq`` workers of
tests/apps/partition_app.py. Redis (broker and leases, one server) runs in the root namespace, bound to
the root side of both pairs, so a host reaches it only through its own link. A partition makes every
packet on one link vanish, both ways: clients there see timeouts, as in a real partition.

A partitioned host cannot report to Redis, so the app records its events (``start``, ``done``,
``error``, with ``time.time()``) in files of a shared directory; every host runs on this machine's one
clock, which is also the Redis server's.

* The holder is cut off: its actor gets ``LeaseLost`` at its local deadline, before the lease's TTL runs
  out in Redis, hence before another host can be granted the key (a message sent for the key at once to
  the other host waits for it in the key's line); the broker redelivers the interrupted message to the
  other host, where it runs once to completion. Healed, the holder does not run it again, takes new jobs,
  and no lease is left behind.
* A host waiting in place for a busy key is cut off: its message is not lost, it runs once after the heal.
  Partitions of 4 s, of 13 s (past the read timeout of the waiter's blocking connection) and of 22 s
  (past the send-back to the unreachable broker too: the worker keeps the delivery until it can).
* Namespaces and links are removed whatever happens, and those a crashed run left behind by the next run.

Skipped where network namespaces cannot be made (not root, no iproute2, no ``blackhole`` qdisc).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

from dramatiq_leases import Leases
from dramatiq_leases.core.client import MAX_BLOCK_S
from dramatiq_leases.core.info import LeaseInfo
from dramatiq_leases.embedded import EmbeddedRedis

from .support.netns import NetnsUnavailableError, Network, leftovers, sweep
from .support.processes import Processes, clean_env, wait_until
from .support.waiting import wait_for

pytestmark = pytest.mark.system

APP = "tests.apps.partition_app"
SHARED_QUEUE = "part"
TTL_MS, RENEW_MS = 3_000, 1_000
#: The broker's heartbeat_timeout: a worker silent this long is dead, its messages go back to their queue.
HEARTBEAT_TIMEOUT_MS = 3_000
#: How late a LeaseLost may land after the local deadline: the actor naps 50 ms, and the machine is busy.
LOST_LATENESS_S = 0.25
#: Longest a healed worker may take to be back: TCP retransmission backoff, Dramatiq's consumer restart (3 s).
RECOVERY_S = 30.0


@dataclass
class Site:
    """Redis in the root namespace, a worker in each host, and what the workers recorded."""

    net: Network
    server: EmbeddedRedis
    procs: Processes
    events_dir: Path
    broker: RedisBroker
    client: redis.Redis
    leases: Leases

    def start_workers(self) -> None:
        for label, host in self.net.hosts.items():
            url = f"redis://{host.host_ip}:{self.server.port}"
            env = clean_env(
                PART_BROKER_URL=f"{url}/0",
                PART_LEASES_URL=f"{url}/1",
                PART_EVENTS=str(self.events_dir),
                PART_HOST=label,
                PART_TTL_MS=str(TTL_MS),
                PART_RENEW_MS=str(RENEW_MS),
                PART_HEARTBEAT_TIMEOUT_MS=str(HEARTBEAT_TIMEOUT_MS),
            )
            argv = [
                sys.executable,
                "-m",
                "dramatiq",
                APP,
                "--processes",
                "1",
                "--threads",
                "2",
                "--queues",
                SHARED_QUEUE,
                f"part-{label}",
                "--worker-shutdown-timeout",
                "2000",
            ]
            self.procs.start(f"worker-{label}", host.argv(argv), env=env)
        for label in self.net.hosts:
            self.wait_event(f"host {label}'s worker to boot", 60, event="ready", host=label)

    def send(self, actor: str, queue: str, key: str, seconds: float) -> str:
        message: Message[Any] = Message(queue_name=queue, actor_name=actor, args=(key, seconds), kwargs={}, options={})
        return self.broker.enqueue(message).message_id

    def finish(self, message_id: str) -> None:
        """Let the run of ``message_id`` return (its actor looks for this file every 50 ms)."""
        (self.events_dir / f"finish-{message_id}").touch()

    def events(self, **match: Any) -> list[dict[str, Any]]:
        """What the hosts recorded, oldest first, restricted to those with the fields of ``match``."""
        found = []
        for path in self.events_dir.glob("*.jsonl"):
            complete = path.read_text().split("\n")[:-1]  # not a line still being written
            found += [json.loads(line) for line in complete]
        return sorted((e for e in found if match.items() <= e.items()), key=lambda e: e["at"])

    def wait_event(self, what: str, timeout: float, **match: Any) -> dict[str, Any]:
        return wait_until(
            lambda: next(iter(self.events(**match)), None), timeout=timeout, what=what, procs=self.procs, interval=0.05
        )

    def dead_letters(self, queue: str) -> list[str]:
        """Ids of the messages in the dead-letter queue of ``queue``."""
        stored = self.client.hvals(f"dramatiq:{queue}.XQ.msgs")
        return [Message.decode(_text(data).encode()).message_id for data in stored]

    def cli_list(self) -> list[dict[str, Any]]:
        """``dramatiq-leases list --json``: every lease in the store."""
        script = Path(sys.executable).with_name("dramatiq-leases")
        proc = subprocess.run(
            [str(script), "--redis-url", self.server.url(1), "list", "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return list(json.loads(proc.stdout))

    def report(self) -> str:
        acks = {
            _text(name): sorted(map(_text, self.client.smembers(name)))
            for name in self.client.scan_iter("dramatiq:__acks__.*")
        }
        return f"events: {json.dumps(self.events(), indent=1)}\nunacknowledged: {acks}\n{self.procs.report()}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    try:
        net = Network(("a", "b"))
    except NetnsUnavailableError as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    server = None
    try:
        ips = [host.host_ip for host in net.hosts.values()]
        server = EmbeddedRedis(extra_args=("--bind", "127.0.0.1", *ips, "--protected-mode", "no")).start()
        events_dir = tmp_path / "events"
        events_dir.mkdir()
        client = redis.Redis.from_url(server.url(0), socket_timeout=5)
        broker = RedisBroker(url=server.url(0))  # type: ignore[no-untyped-call]
        leases = Leases.from_url(server.url(1))
        with Processes(tmp_path / "logs") as procs:
            try:
                yield Site(net, server, procs, events_dir, broker, client, leases)
            finally:
                net.heal_all()  # so that the workers can shut down cleanly
                # SIGTERM to every worker at once (each takes seconds); Processes then kills what is left.
                running = [proc for proc in procs.procs.values() if proc.poll() is None]
                for proc in running:
                    proc.terminate()
                for proc in running:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(10)
        broker.close()
        client.close()
    finally:
        net.close()
        if server is not None:
            server.close()
    assert not [name for name in leftovers() if name.startswith(tuple(h.netns for h in net.hosts.values()))]


def _lease_of(site: Site, key: str, fence: int) -> LeaseInfo | None:
    info = site.leases.inspect(key)
    return info if info is not None and info.fence == fence else None


def test_a_cut_off_holder_stops_before_its_lease_can_be_granted_elsewhere(site: Site) -> None:
    """a holds the key and is cut off: LeaseLost at its deadline, b granted only after the TTL, a healed runs no copy."""
    site.start_workers()
    key = "partition:holder"
    # Whichever host takes the message is the holder, "a" below; the other is "b".
    original = site.send("hold", SHARED_QUEUE, key, 60)
    started = site.wait_event("the job to start", 15, event="start", message_id=original)
    a, b = site.net[started["host"]], next(h for h in site.net.hosts.values() if h.label != started["host"])
    fence_a = started["fence"]
    # Cut it off once it has renewed its lease at least once: the renewals are what fails.
    wait_until(
        lambda: (i := _lease_of(site, key, fence_a)) is not None and i.renewed_ms > i.acquired_ms,
        timeout=5,
        what="a first renewal",
        procs=site.procs,
        interval=0.05,
    )
    cut_at = a.partition()
    # Another message for the key, to b at once: it waits in the key's line until the key can be granted.
    contender = site.send("hold_here", f"part-{b.label}", key, 0.3)

    # Until b runs the contender, watch the holder's lease in Redis: nothing can change it any more.
    last: list[LeaseInfo] = []

    def contender_started() -> dict[str, Any] | None:
        info = _lease_of(site, key, fence_a)
        if info is not None:
            last[:] = [info]
        return next(iter(site.events(event="start", message_id=contender)), None)

    wait_until(contender_started, timeout=20, what="b to run the contender", procs=site.procs, interval=0.02)
    assert last, "the holder's lease was gone before it could be read"
    holder = last[0]
    expires_at = (holder.renewed_ms + holder.ttl) / 1000  # the instant the key expires in Redis

    # The broker redelivers the interrupted message to b (a's heartbeat stopped): it runs there to completion.
    b_original = site.wait_event(
        "b to run the redelivered message", 20, event="start", message_id=original, host=b.label
    )
    site.finish(original)
    site.wait_event("b to finish the redelivered message", 10, event="done", message_id=original, host=b.label)
    site.wait_event("b to finish the contender", 10, event="done", message_id=contender)
    a_end = site.wait_event("a's actor to end", 5, message_id=original, host=a.label, event="error")
    b_first = site.events(event="start", key=key, host=b.label)[0]  # the contender, normally
    healed_at = a.heal()
    wait_until(
        lambda: a.settled(site.server.port),
        timeout=RECOVERY_S,
        procs=site.procs,
        what="what a sent during the partition to reach Redis",
    )
    settled_at = time.time()

    # a is back: it takes a new job for the same key (free again), on its own queue.
    probe = site.send("hold_here", f"part-{a.label}", key, 0.1)
    a_probe = site.wait_event("a to run a new job after the heal", RECOVERY_S, event="done", message_id=probe)
    # Nothing of the interrupted message is left in the broker: nobody can run it again.
    wait_until(
        lambda: (
            site.client.hlen(f"dramatiq:{SHARED_QUEUE}.msgs") == 0 and site.client.llen(f"dramatiq:{SHARED_QUEUE}") == 0
        ),
        timeout=RECOVERY_S,
        what="the shared queue to be empty",
        procs=site.procs,
    )

    timings = {
        "renewed (server) -> cut": cut_at - holder.renewed_ms / 1000,
        "cut -> a's LeaseLost": a_end["at"] - cut_at,
        "a's deadline (last renewal on the server + 90% TTL) -> a's LeaseLost": a_end["at"]
        - (holder.renewed_ms / 1000 + 0.9 * TTL_MS / 1000),
        "a's LeaseLost -> TTL expiry in Redis": expires_at - a_end["at"],
        "TTL expiry -> b's first run of the key starts": b_first["at"] - expires_at,
        "cut -> b starts the redelivered message": b_original["at"] - cut_at,
        "heal -> all a sent during the cut has reached Redis": settled_at - healed_at,
        "heal -> a runs a new job": a_probe["at"] - healed_at,
    }
    print("\n".join(f"{name}: {value:+.3f} s" for name, value in timings.items()))
    context = f"timings: {json.dumps(timings, indent=1)}\n{site.report()}"

    # a stopped, told by LeaseLost at its local deadline (Redis unreachable), before the TTL ran out ...
    assert (a_end["error"], a_end["reason"]) == ("LeaseLost", "unreachable"), context
    assert a_end["at"] <= holder.renewed_ms / 1000 + 0.9 * TTL_MS / 1000 + LOST_LATENESS_S, context
    assert a_end["at"] < expires_at, context
    # ... so before b could be granted the key: b started after a had ended, and after the expiry.
    assert a_end["at"] < b_first["at"], context
    assert b_first["at"] >= expires_at - 0.002, context  # Redis TIME and time.time() are the same clock (ms)
    # Each message ran once to completion, the interrupted one in b; a never ran it again.
    assert [(e["host"], e["event"]) for e in site.events(message_id=original)] == [
        (a.label, "start"),
        (a.label, "error"),
        (b.label, "start"),
        (b.label, "done"),
    ], context
    assert [e["event"] for e in site.events(message_id=contender)] == ["start", "done"], context
    assert [e["event"] for e in site.events(message_id=probe)] == ["start", "done"], context
    # Fences grew with every grant: a, then b's two runs (in either order), then a's new job.
    b_fences = {e["fence"] for e in site.events(host=b.label, event="start")}
    assert fence_a < min(b_fences) and max(b_fences) < a_probe["fence"] and len(b_fences) == 2, context
    # No lease is stuck: the key is free (the last release is sent off the worker thread), and the CLI lists
    # nothing.
    wait_for(lambda: site.leases.inspect(key) is None, what=f"the key to be free ({context})")
    assert site.cli_list() == [], context


#: A partition longer than this outlasts the read timeout of a waiter's blocking connection (12 s).
BLOCKING_READ_TIMEOUT_S = MAX_BLOCK_S + 2
#: ... and longer than this, also the acquire asked next (2 s) and the send-back to the broker (5 s).
SEND_BACK_FAILS_S = BLOCKING_READ_TIMEOUT_S + 2 + 5


@pytest.mark.parametrize(
    "cut_s",
    [
        pytest.param(4.0, id="short"),
        # Catches a failed wait in place whose Redis error escapes before_process_message: Dramatiq then calls the
        # actor, whose guard fails the message for want of a lease (dead-lettered here, max_retries=0).
        pytest.param(BLOCKING_READ_TIMEOUT_S + 1.0, id="longer-than-the-blocking-read-timeout"),
        # The send-back fails too (one Redis for the broker and the leases): the worker keeps the delivery and sends
        # it back once Redis answers (middleware/outages.py), instead of dead-lettering it.
        pytest.param(SEND_BACK_FAILS_S + 3.0, id="longer-than-the-send-back"),
    ],
)
def test_a_waiter_cut_off_keeps_its_message(site: Site, cut_s: float) -> None:
    """b waits in place for a key a holds; b is cut off, a releases the key meanwhile; b's message still runs."""
    site.start_workers()
    b = site.net["b"]
    key = "partition:waiter"
    holding = site.send("hold_here", "part-a", key, 60)
    site.wait_event("a to hold the key", 15, event="start", message_id=holding)
    waiting = site.send("hold_here", "part-b", key, 0.2)
    wait_until(
        lambda: site.leases.inspect_line(key).states.get("in_place") == 1,
        timeout=15,
        what="b to wait in place for the key",
        procs=site.procs,
        interval=0.05,
    )
    cut_at = b.partition()
    # The key is released while b is away: its wake-up is lost in the partition.
    site.finish(holding)
    site.wait_event("a to finish", 10, event="done", message_id=holding)
    wait_until(
        lambda: time.time() >= cut_at + cut_s,
        timeout=cut_s + 5,
        what="the partition's end",
        procs=site.procs,
        interval=0.1,
    )
    healed_at = b.heal()

    def ran() -> dict[str, Any] | None:
        if waiting in site.dead_letters("part-b"):
            pytest.fail(f"b's waiting message was dead-lettered\n{site.report()}", pytrace=False)
        return next(iter(site.events(event="done", message_id=waiting)), None)

    done = wait_until(ran, timeout=RECOVERY_S, what="b to run its waiting message", procs=site.procs)
    print(f"partition of {cut_s:.0f} s: heal -> b's waiting message done: {done['at'] - healed_at:+.3f} s")
    assert [e["event"] for e in site.events(message_id=waiting)] == ["start", "done"], site.report()
    wait_until(
        lambda: site.leases.inspect(key) is None and site.leases.inspect_line(key).length == 0,
        timeout=15,
        what="the key and its line to be free",
        procs=site.procs,
    )
    assert site.cli_list() == []


def test_sweep_removes_what_a_crashed_run_left(tmp_path: Path) -> None:
    """A run killed before its finalizers leaves namespaces, links and processes inside: the next run removes them."""
    code = (
        "import os, subprocess, sys\n"
        "from tests.support.netns import Network\n"
        "net = Network(('a',))\n"
        "inside = subprocess.Popen(net['a'].argv(['sleep', '120']), start_new_session=True)\n"
        "print(net['a'].netns, inside.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    crashed = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parents[1],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert crashed.stdout is not None
        line = crashed.stdout.readline().split()
        if not line:
            pytest.skip(f"cannot make network namespaces here: {crashed.stderr.read() if crashed.stderr else ''}")
        netns, inside = line[0], int(line[1])
    finally:
        crashed.kill()  # no finalizer runs
        crashed.wait(10)
    assert any(name.startswith(netns) for name in leftovers())
    removed = sweep()
    assert netns in removed
    assert not any(name.startswith(netns) for name in leftovers())
    wait_until(
        lambda: not os.path.exists(f"/proc/{inside}") or _zombie(inside),
        timeout=10,
        what="the process left inside to end",
    )


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True
