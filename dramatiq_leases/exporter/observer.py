"""The exporter's observer: scans the leases and lines of one store, keeps the last scan, exposes its figures."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..core import LeaseInfo, Leases, State
from ..core.errors import LeaseUnavailableError
from ..core.info import UNREADABLE_KINDS, UnreadableKey
from ..core.keys import fence_name
from ..core.reading import LineInfo, ReadGaps
from . import busy_page
from ._endings import Ending, ended_by_ttl, grant_ending
from ._masking import hashed_key, scrub
from .busy_page import DEFAULT_TOP, BusyPage
from .routes import HISTORY_PATH

__all__ = ["LEAK_REASONS", "WAIT_REASONS", "Ending", "LeaseObserver", "Snapshot", "ended_by_ttl", "grant_ending"]

logger = logging.getLogger(__name__)

#: The ``reason`` values of ``dramatiq_lease_leaked``: the states :attr:`State.leaked` calls leaked.
LEAK_REASONS = tuple(state for state in State if state.leaked)

#: The ``reason`` values of ``dramatiq_lease_waiting_for``: what the waiters of a line wait for. ``rate``: the key
#: is over its rate (``lock_rate``, or a hold its last holder put on it) until a time ahead; ``holder``: anything
#: else, a holder to release (or, between holders, the grant to the head of the line).
WAIT_REASONS = ("rate", "holder")

Labels = tuple[str, str]


@dataclass
class Snapshot:
    """What one scan saw."""

    at: float = 0.0
    duration: float = 0.0
    present: Tally[Labels] = field(default_factory=Tally)
    overdue: Tally[Labels] = field(default_factory=Tally)
    leaked: Tally[tuple[str, str, str]] = field(default_factory=Tally)
    leaked_waiting: Tally[tuple[str, str, str]] = field(default_factory=Tally)
    oldest: dict[Labels, float] = field(default_factory=dict)
    waiting: Tally[str] = field(default_factory=Tally)
    #: The same waiters by actor and what they wait for (one of :data:`WAIT_REASONS`).
    waiting_for: Tally[tuple[str, str]] = field(default_factory=Tally)
    #: Keys whose holders have reached their limit (a key of one holder: while held), by their holders' labels.
    keys_full: Tally[Labels] = field(default_factory=Tally)
    #: The highest holders / limit among the keys held, by their holders' labels.
    saturation: dict[Labels, float] = field(default_factory=dict)
    leases: list[LeaseInfo] = field(default_factory=list)
    page: BusyPage = field(default_factory=BusyPage)
    #: Cluster masters that did not answer this scan (``host:port`` -> error): what they hold is not counted.
    unreachable: dict[str, str] = field(default_factory=dict)
    #: Keys this scan found of the wrong type and left out, by name.
    unreadable: dict[str, UnreadableKey] = field(default_factory=dict)


def _count_saturation(snap: Snapshot, keys: Iterable[list[LeaseInfo]]) -> None:
    """How full the keys held are, per actor and queue (never per key: keys are unbounded): each key counts
    for every actor and queue among its holders."""
    for holders in keys:
        limit = busy_page.key_limit(holders)
        ratio = len(holders) / limit
        for labels in {(info.meta.get("actor", ""), info.meta.get("queue", "")) for info in holders}:
            if len(holders) >= limit:
                snap.keys_full[labels] += 1
            snap.saturation[labels] = max(snap.saturation.get(labels, 0.0), ratio)


#: Unreadable keys named in the log per scan at most; the rest are counted.
_LOGGED_PER_SCAN = 20


class LeaseObserver(Collector):
    """Scans the leases of one store and exposes what it saw as Prometheus metrics.

    Parameters:
      leases: the store to observe.
      match: a glob limiting which lease keys are observed.
      top: how many rows each table of the Busy page keeps (:mod:`.busy_page`).
      cli_options: global ``dramatiq-leases`` arguments for the Busy page's
        ``show`` commands (the exporter's non-default ``--redis-url``, ``--prefix``).
      stale_after: seconds after which the last scan no longer describes Redis.
      hash_keys: name keys in the log by their pseudonym (``--mask-keys``), as the Busy view shows them:
        a log shipped to storage must not carry the personal data the page masks.
    """

    def __init__(
        self,
        leases: Leases,
        *,
        match: str = "*",
        top: int = DEFAULT_TOP,
        cli_options: Sequence[str] = (),
        stale_after: float | None = None,
        hash_keys: bool = False,
    ) -> None:
        self.leases = leases
        self.hash_keys = hash_keys
        #: Seconds after which the last scan no longer describes Redis: its lease gauges are then not served
        #: (they go stale in Prometheus) rather than keep a resolved leak paging, or hide a new one.
        self.stale_after = stale_after
        self.match = match
        self.top = top
        self.cli_options = tuple(cli_options)
        #: When this observer started: the last-scan gauge's value until a scan completes.
        self.started_at = time.time()
        self.snapshot = Snapshot()
        self.expired: Tally[Labels] = Tally()
        #: Grants seen that ended while their fence counter could not tell how (:attr:`Ending.UNKNOWN`).
        self.ended_unknown: Tally[Labels] = Tally()
        self.scan_errors = 0
        self._told_unknown = False
        self._unreadable_logged: set[str] = set()
        self._unreachable_logged: set[str] = set()
        self._labels_seen: set[Labels] = set()
        self._actors_waiting: set[str] = set()
        self._previous: dict[str, LeaseInfo] = {}
        self._lock = threading.Lock()

    def scan(self) -> Snapshot:
        """Scan Redis once, update the figures and return them. Raises :class:`LeaseUnavailableError`."""
        started = time.monotonic()
        # One master that does not answer, or one key of the wrong type, must not hide the others: the scan
        # goes on past them and says so (it fails only if no master answered).
        gaps = ReadGaps()
        try:
            infos = list(self.leases.scan(self.match, gaps=gaps))
            endings, unseen = self._ended_grants(infos, gaps)
            lines = list(self.leases.scan_lines(gaps=gaps))
        except LeaseUnavailableError:
            with self._lock:
                self.scan_errors += 1
            raise
        snap = Snapshot(at=time.time(), leases=infos, unreachable=dict(gaps.nodes), unreadable=dict(gaps.keys))
        snap.page = busy_page.build(
            infos, lines, prefix=self.leases.prefix, top=self.top, cli_options=self.cli_options, match=self.match
        )
        self._count(snap, infos, lines)
        snap.duration = time.monotonic() - started
        self._tell_gaps(gaps, {info.key for info in infos})
        with self._lock:
            for info, ending in endings:
                labels = (info.meta.get("actor", ""), info.meta.get("queue", ""))
                if ending is Ending.EXPIRED:
                    self.expired[labels] += 1
                    logger.warning(
                        "Lease %s (fence %d) of %s ended by TTL, not released.",
                        self._named(info.key),
                        info.fence,
                        labels[0],
                    )
                elif ending is Ending.UNKNOWN:
                    self.ended_unknown[labels] += 1
            self._labels_seen.update(snap.present)
            self._actors_waiting.update(snap.waiting)
            self.snapshot = snap
            # Leases on a master that did not answer are judged when it answers again.
            self._previous = {**{old.redis_key: old for old in unseen}, **{info.redis_key: info for info in infos}}
        unknown = next((info for info, ending in endings if ending is Ending.UNKNOWN), None)
        if unknown is not None and not self._told_unknown:
            self._told_unknown = True  # every release may be one, with a short retention: said once
            logger.warning(
                "Lease %s (fence %d) ended, but its fence counter no longer says whether by release or by TTL "
                "(gone: a fence_retention shorter than the scan interval?, or rewritten by later grants): counted "
                "in dramatiq_lease_ended_unknown_total, not as an expiry. Said once.",
                self._named(unknown.key),
                unknown.fence,
            )
        return snap

    def _count(self, snap: Snapshot, infos: list[LeaseInfo], lines: list[LineInfo]) -> None:
        """Fill ``snap``'s figures per actor and queue: present, leaked, overdue, oldest, waiting."""
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
            reason = "rate" if line.waiting_for_rate else "holder"
            for actor, count in line.actors.items():
                snap.waiting[actor] += count
                snap.waiting_for[(actor, reason)] += count
        # What waits on each leaked key: a leak with a line is one users are waiting on.
        waiting_on = {
            tag: line.length
            for line in lines
            if (tag := busy_page.hash_tag_of(line.name, self.leases.prefix, "line")) is not None
        }
        holders_of: dict[str, list[LeaseInfo]] = {}
        for info in infos:
            tag = busy_page.hash_tag_of(info.redis_key, self.leases.prefix, "lease")
            if tag is not None:
                holders_of.setdefault(tag, []).append(info)
            state = info.state
            if state.leaked:
                snap.leaked_waiting[(info.meta.get("actor", ""), info.meta.get("queue", ""), state.value)] += (
                    waiting_on.get(tag or "", 0)
                )
        _count_saturation(snap, holders_of.values())

    def _ended_grants(
        self, infos: list[LeaseInfo], gaps: ReadGaps
    ) -> tuple[list[tuple[LeaseInfo, Ending]], list[LeaseInfo]]:
        """How each grant seen last scan that has ended since ended; and the grants not seen this scan because
        their master did not answer (not known to have ended)."""
        now = {info.redis_key: info.fence for info in infos}
        gone = [old for name, old in self._previous.items() if now.get(name) != old.fence]
        node_name = self.leases.reader.node_name
        unseen = [old for old in gone if old.redis_key not in now and node_name(old.redis_key) in gaps.nodes]
        blind = {old.redis_key for old in unseen}
        # A key that was no grant (debris, fence 0) has nothing to judge.
        gone = [old for old in gone if old.fence and old.redis_key not in blind]
        if not gone:
            return [], unseen
        try:
            states = self.leases.fence_states([old.key for old in gone], gaps=gaps)
        except LeaseUnavailableError:
            if not gaps.nodes:  # a single server failing fails the scan
                raise
            return [], unseen + gone  # the masters of these grants did not answer: judged when they do
        endings = []
        for old, state in zip(gone, states):
            if self.leases.reader.node_name(old.redis_key) in gaps.nodes:  # its master failed meanwhile
                unseen.append(old)
            elif fence_name(self.leases.prefix, old.key) in gaps.keys:  # not a counter: it says nothing
                endings.append((old, Ending.UNKNOWN))
            else:
                endings.append((old, grant_ending(old.fence, state, old.slot if old.per_slot else None)))
        return endings, unseen

    def _tell_gaps(self, gaps: ReadGaps, keys: set[str]) -> None:
        """Log each master that stops (or starts again) answering, and each key of the wrong type, once."""
        for node in sorted(gaps.nodes.keys() - self._unreachable_logged):
            logger.warning(
                "Redis master %s did not answer the scan (%s): what it holds is not counted until it "
                "does (dramatiq_lease_exporter_unreachable_nodes).",
                node,
                self.mask(gaps.nodes[node], keys),
            )
        for node in sorted(self._unreachable_logged - gaps.nodes.keys()):
            logger.info("Redis master %s answers the scan again.", node)
        self._unreachable_logged = set(gaps.nodes)
        new = sorted(gaps.keys.keys() - self._unreadable_logged)
        for name in new[:_LOGGED_PER_SCAN]:
            bad = gaps.keys[name]
            # A lease key of another type still blocks its key as a lease does: it stays in the lease figures.
            what = (
                "counted as a lease without holder (it blocks its key as one)"
                if bad.kind == "lease"
                else "left out of the scan"
            )
            logger.warning(
                "Key %s is %s: %s (dramatiq_lease_exporter_unreadable_keys); no dramatiq-leases code wrote it.",
                self._named(name),
                bad.problem,
                what,
            )
        if len(new) > _LOGGED_PER_SCAN:
            logger.warning("%d more keys of the wrong type left out of the scan.", len(new) - _LOGGED_PER_SCAN)
        # Only the keys still there are remembered: the memory is bounded by the keys, and one that comes back
        # after a fix is told again.
        self._unreadable_logged = set(gaps.keys)

    def mask(self, text: str, also: Iterable[str] = ()) -> str:
        """``text`` (an error's message, which may quote keys and name their Redis keys) as this exporter may
        show or log it: with keys masked, every key it knows (the last scan's, and ``also``) as its digest."""
        if not self.hash_keys:
            return text
        with self._lock:
            snap, previous = self.snapshot, list(self._previous.values())
        known = {info.key for info in (*snap.leases, *previous)} | {row["key"] for row in snap.page.hot_keys}
        return scrub(text, known | set(also))

    def _named(self, key: str) -> str:
        """``key`` as the log names it: quoted, or its pseudonym when keys are masked."""
        return hashed_key(key) if self.hash_keys else repr(key)

    def busy_json(self, limit: int | None = None) -> dict[str, Any]:
        """The Busy page of the last scan as the JSON document of ``GET /leases`` (no Redis call)."""
        with self._lock:
            snap = self.snapshot
        doc = busy_page.as_json(
            snap.page, scanned_at=snap.at or None, scan_duration=snap.duration, top=self.top, limit=limit
        )
        # The blind spots of that scan: what the tables cannot show. Counts only for the keys, whose names the
        # log has: the page may be served with its keys hashed.
        doc["unreachable_nodes"] = [
            {"node": node, "error": self.mask(error)} for node, error in sorted(snap.unreachable.items())
        ]
        kinds = Tally(bad.kind for bad in snap.unreadable.values())
        doc["unreadable_keys"] = {kind: kinds.get(kind, 0) for kind in UNREADABLE_KINDS}
        doc["history_path"] = HISTORY_PATH + "?key="
        return doc

    def history_json(self, key: str) -> dict[str, Any]:
        """The document of ``GET /leases/history?key=KEY``: the key's history, oldest first (one Redis call).

        Raises:
          LeaseError: an invalid key (LeaseKeyError), a history not a list, or Redis not answering.
        """
        return {"key": key, "events": [event.as_dict() for event in self.leases.history(key)]}

    def collect(self) -> Iterator[Any]:
        """Prometheus collector protocol: the last scan's figures."""
        with self._lock:
            snap, expired, scan_errors = self.snapshot, Tally(self.expired), self.scan_errors
            unknown = Tally(self.ended_unknown)
            started_at = self.started_at
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
            "dramatiq_lease_leaked",
            "Leases in Redis that no holder can still believe it holds (leaked).",
            labels=[*names, "reason"],
        )
        leaked_waiting = GaugeMetricFamily(
            "dramatiq_lease_leaked_waiting",
            "Messages waiting in the lines of leaked leases' keys.",
            labels=[*names, "reason"],
        )
        oldest = GaugeMetricFamily(
            "dramatiq_lease_oldest_acquired_timestamp_seconds",
            "Unix time at which the oldest lease present was acquired.",
            labels=names,
        )
        ended = CounterMetricFamily(
            "dramatiq_lease_expired",
            "Leases that ended by TTL instead of being released.",
            labels=names,
        )
        ended_unknown = CounterMetricFamily(
            "dramatiq_lease_ended_unknown",
            "Leases that ended while their fence counter no longer said how (gone, or rewritten by later grants): "
            "not counted as expired.",
            labels=names,
        )
        keys_full = GaugeMetricFamily(
            "dramatiq_lease_keys_full",
            "Keys whose holders have reached their limit (lock_limit; a key of one holder while held), by the "
            "actor and queue of their holders.",
            labels=names,
        )
        saturation = GaugeMetricFamily(
            "dramatiq_lease_key_saturation",
            "The highest holders / limit ratio among the keys held now (1: at least one key is full).",
            labels=names,
        )
        # Keep every label set ever seen, at zero, so increase() sees the first event and gauges fall to 0.
        for labels in sorted(labels_seen | set(expired) | set(unknown)):
            present.add_metric(list(labels), snap.present.get(labels, 0))
            keys_full.add_metric(list(labels), snap.keys_full.get(labels, 0))
            saturation.add_metric(list(labels), snap.saturation.get(labels, 0.0))
            overdue.add_metric(list(labels), snap.overdue.get(labels, 0))
            for reason in LEAK_REASONS:
                by = (labels[0], labels[1], reason.value)
                leaked.add_metric([*labels, reason.value], snap.leaked.get(by, 0))
                leaked_waiting.add_metric([*labels, reason.value], snap.leaked_waiting.get(by, 0))
            ended.add_metric(list(labels), expired.get(labels, 0))
            ended_unknown.add_metric(list(labels), unknown.get(labels, 0))
            if labels in snap.oldest:
                oldest.add_metric(list(labels), snap.oldest[labels])
        waiting = GaugeMetricFamily(
            "dramatiq_lease_waiting",
            "Messages waiting in the line of a busy key, by actor.",
            labels=["actor_name"],
        )
        waiting_for = GaugeMetricFamily(
            "dramatiq_lease_waiting_for",
            "Messages waiting in the line of a busy key, by actor and what they wait for: the key's rate (rate), or "
            "a holder (holder).",
            labels=["actor_name", "reason"],
        )
        for actor in actors_waiting:
            waiting.add_metric([actor], snap.waiting.get(actor, 0))
            for waited in WAIT_REASONS:
                waiting_for.add_metric([actor, waited], snap.waiting_for.get((actor, waited), 0))
        unreachable = GaugeMetricFamily(
            "dramatiq_lease_exporter_unreachable_nodes",
            "Redis Cluster masters that did not answer the last scan: what they hold is not in the lease figures.",
            value=len(snap.unreachable),
        )
        unreadable = GaugeMetricFamily(
            "dramatiq_lease_exporter_unreadable_keys",
            "Keys the last scan found of the wrong type for their name and left out, by the kind the name says.",
            labels=["kind"],
        )
        kinds = Tally(bad.kind for bad in snap.unreadable.values())
        for kind in UNREADABLE_KINDS:
            unreadable.add_metric([kind], kinds.get(kind, 0))
        yield ended
        yield ended_unknown
        if self.stale_after is None or not snap.at or time.time() - snap.at <= self.stale_after:
            yield from (present, overdue, leaked, leaked_waiting, oldest, waiting, waiting_for, keys_full, saturation)
            yield from (unreachable, unreadable)
        # Served from the start, not from the first success: an exporter that never completes a scan must
        # still age this gauge, or `time() - it > 120` has nothing to fire on.
        yield GaugeMetricFamily(
            "dramatiq_lease_exporter_last_scan_timestamp_seconds",
            "Unix time of the last successful scan; the exporter's start time until its first one completes.",
            value=snap.at or started_at,
        )
        yield GaugeMetricFamily(
            "dramatiq_lease_exporter_scan_duration_seconds",
            "Duration of the last successful scan.",
            value=snap.duration,
        )
        errors = CounterMetricFamily(
            "dramatiq_lease_redis_errors",
            "Redis errors by operation (acquire, renew, release, scan).",
            labels=["operation"],
        )
        errors.add_metric(["scan"], scan_errors)
        yield errors
