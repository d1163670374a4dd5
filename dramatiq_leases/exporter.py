"""The fleet-wide view: an observer that reads leases from Redis and serves metrics.

A dead worker cannot report its own leaked lease, so these figures come from
Redis itself. Run one exporter per fleet (``dramatiq-leases exporter``). A
scan costs ``O(leases)``: ``SCAN`` over lease keys (never ``KEYS``) and one
script call per batch of keys, per hash slot on a cluster.

Metrics (labels ``actor_name``, ``queue_name`` unless noted):

* ``dramatiq_lease_present``: leases in Redis now.
* ``dramatiq_lease_heartbeat_overdue``: leases whose heartbeat is late (no
  renewal for ``2 x interval + 0.5 s``) but whose holder may still be running
  under them until its own deadline (the last renewal plus the TTL, less the
  holder's safety margin). A warning, not a leak: such a lease must not be
  released by hand, and ends by its TTL soon after that deadline.
* ``dramatiq_lease_leaked`` (+ ``reason`` = holder_dead | past_max_hold |
  no_ttl): leases that no holder can still believe it holds (its deadline has
  passed, or the key has no TTL and no deadline ahead), yet still in Redis:
  exactly the states :attr:`State.leaked` names, which ``dramatiq-leases
  release --if-dead`` may end. A heartbeat-renewed key outlives its holder's
  deadline by only the safety margin (a tenth of the TTL), so ``holder_dead``
  and ``past_max_hold`` are brief unless someone extended the key's TTL;
  ``no_ttl`` lasts until someone acts.
* ``dramatiq_lease_expired_total``: grants that ended by TTL instead of release.
* ``dramatiq_lease_oldest_acquired_timestamp_seconds``: when the oldest
  present lease was granted.
* ``dramatiq_lease_exporter_last_scan_timestamp_seconds``,
  ``dramatiq_lease_exporter_scan_duration_seconds`` (no labels).
* ``dramatiq_lease_redis_errors_total{operation="scan"}``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .core import LeaseInfo, Leases, State
from .core.errors import LeaseUnavailableError

logger = logging.getLogger(__name__)

#: Default port of the exporter's endpoint.
DEFAULT_PORT = 9808

#: The ``reason`` values of ``dramatiq_lease_leaked``: the states :attr:`State.leaked` calls leaked.
LEAK_REASONS = tuple(state for state in State if state.leaked)

Labels = tuple[str, str]


@dataclass
class Snapshot:
    """What one scan saw."""

    at: float = 0.0
    duration: float = 0.0
    present: Tally[Labels] = field(default_factory=Tally)
    overdue: Tally[Labels] = field(default_factory=Tally)
    leaked: Tally[tuple[str, str, str]] = field(default_factory=Tally)
    oldest: dict[Labels, float] = field(default_factory=dict)
    waiting: Tally[str] = field(default_factory=Tally)
    leases: list[LeaseInfo] = field(default_factory=list)


def ended_by_ttl(fence: int, state: dict[str, int]) -> bool:
    """Whether grant ``fence`` of a key ended by TTL, judged from the key's fence counter.

    ``released`` is the highest fence released by its owner, ``expired`` the
    last fence a later acquirer found unreleased, ``fence`` the last granted.
    """
    released = state.get("released", 0)
    if released == fence:
        return False
    # When later grants overwrote the record, say no rather than raise a false alarm.
    return state.get("expired", 0) == fence or released < fence


class LeaseObserver(Collector):
    """Scans the leases of one store and exposes what it saw as Prometheus metrics.

    Parameters:
      leases: the store to observe.
      match: a glob limiting which lease keys are observed.
    """

    def __init__(self, leases: Leases, *, match: str = "*") -> None:
        self.leases = leases
        self.match = match
        self.snapshot = Snapshot()
        self.expired: Tally[Labels] = Tally()
        self.scan_errors = 0
        self._labels_seen: set[Labels] = set()
        self._actors_waiting: set[str] = set()
        self._previous: dict[str, LeaseInfo] = {}
        self._lock = threading.Lock()

    def scan(self) -> Snapshot:
        """Scan Redis once, update the figures and return them. Raises :class:`LeaseUnavailableError`."""
        started = time.monotonic()
        try:
            infos = list(self.leases.scan(self.match))
            ended = self._ended_grants(infos)
            lines = list(self.leases.scan_lines())
        except LeaseUnavailableError:
            with self._lock:
                self.scan_errors += 1
            raise
        snap = Snapshot(at=time.time(), leases=infos)
        for info in infos:
            labels = (info.meta.get("actor", ""), info.meta.get("queue", ""))
            snap.present[labels] += 1
            state = info.state
            if state.leaked:
                snap.leaked[(labels[0], labels[1], state.value)] += 1
            elif state is State.HEARTBEAT_OVERDUE:
                snap.overdue[labels] += 1
            acquired = info.acquired_ms / 1000
            if labels not in snap.oldest or acquired < snap.oldest[labels]:
                snap.oldest[labels] = acquired
        for line in lines:
            for actor, count in line.actors.items():
                snap.waiting[actor] += count
        snap.duration = time.monotonic() - started
        with self._lock:
            for info in ended:
                labels = (info.meta.get("actor", ""), info.meta.get("queue", ""))
                self.expired[labels] += 1
                logger.warning("Lease %r (fence %d) of %s ended by TTL, not released.", info.key, info.fence, labels[0])
            self._labels_seen.update(snap.present)
            self._actors_waiting.update(snap.waiting)
            self.snapshot = snap
            self._previous = {info.redis_key: info for info in infos}
        return snap

    def _ended_grants(self, infos: list[LeaseInfo]) -> list[LeaseInfo]:
        """Grants seen last scan that have ended since and ended by TTL."""
        now = {info.redis_key: info.fence for info in infos}
        gone = [old for name, old in self._previous.items() if now.get(name) != old.fence]
        if not gone:
            return []
        states = self.leases.fence_states([old.key for old in gone])
        return [old for old, state in zip(gone, states) if ended_by_ttl(old.fence, state)]

    def collect(self) -> Iterator[Any]:
        """Prometheus collector protocol: the last scan's figures."""
        with self._lock:
            snap, expired, scan_errors = self.snapshot, Tally(self.expired), self.scan_errors
            labels_seen = set(self._labels_seen)
            actors_waiting = sorted(self._actors_waiting)
        names = ["actor_name", "queue_name"]
        present = GaugeMetricFamily("dramatiq_lease_present", "Leases present in Redis now.", labels=names)
        overdue = GaugeMetricFamily(
            "dramatiq_lease_heartbeat_overdue",
            "Leases whose heartbeat is late but whose holder may still be running until its deadline (not leaked).",
            labels=names,
        )
        leaked = GaugeMetricFamily(
            "dramatiq_lease_leaked", "Leases in Redis that no holder can still believe it holds (leaked).",
            labels=[*names, "reason"],
        )
        oldest = GaugeMetricFamily(
            "dramatiq_lease_oldest_acquired_timestamp_seconds",
            "Unix time at which the oldest lease present was acquired.", labels=names,
        )
        ended = CounterMetricFamily(
            "dramatiq_lease_expired", "Leases that ended by TTL instead of being released.", labels=names,
        )
        # Keep every label set ever seen, at zero, so increase() sees the first event and gauges fall to 0.
        for labels in sorted(labels_seen | set(expired)):
            present.add_metric(list(labels), snap.present.get(labels, 0))
            overdue.add_metric(list(labels), snap.overdue.get(labels, 0))
            for reason in LEAK_REASONS:
                leaked.add_metric([*labels, reason.value], snap.leaked.get((labels[0], labels[1], reason.value), 0))
            ended.add_metric(list(labels), expired.get(labels, 0))
            if labels in snap.oldest:
                oldest.add_metric(list(labels), snap.oldest[labels])
        waiting = GaugeMetricFamily(
            "dramatiq_lease_waiting", "Messages waiting in the line of a busy key, by actor.", labels=["actor_name"],
        )
        for actor in actors_waiting:
            waiting.add_metric([actor], snap.waiting.get(actor, 0))
        yield from (present, overdue, leaked, oldest, ended, waiting)
        last = GaugeMetricFamily(
            "dramatiq_lease_exporter_last_scan_timestamp_seconds", "Unix time of the last successful scan."
        )
        if snap.at:
            last.add_metric([], snap.at)
        yield last
        yield GaugeMetricFamily(
            "dramatiq_lease_exporter_scan_duration_seconds",
            "Duration of the last successful scan.",
            value=snap.duration,
        )
        errors = CounterMetricFamily(
            "dramatiq_lease_redis_errors", "Redis errors by operation (acquire, renew, release, scan).",
            labels=["operation"],
        )
        errors.add_metric(["scan"], scan_errors)
        yield errors


def serve(
    leases: Leases,
    *,
    host: str = "0.0.0.0",
    port: int = DEFAULT_PORT,
    interval: float = 5.0,
    match: str = "*",
    stop: threading.Event | None = None,
) -> None:
    """Scan every ``interval`` seconds and serve the figures on ``host:port`` until ``stop`` is set or SIGTERM."""
    observer = LeaseObserver(leases, match=match)
    registry = CollectorRegistry()
    registry.register(observer)
    server, thread = start_http_server(port, addr=host, registry=registry)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    logger.info("Serving lease metrics on http://%s:%d/metrics, scanning every %.1fs.", host, port, interval)
    try:
        while not stop.is_set():
            try:
                snap = observer.scan()
                logger.debug("Scanned %d lease(s) in %.3fs.", len(snap.leases), snap.duration)
            except LeaseUnavailableError as e:
                logger.error("Scan failed: %s", e)
            stop.wait(interval)
    finally:
        server.shutdown()
        thread.join(5)
