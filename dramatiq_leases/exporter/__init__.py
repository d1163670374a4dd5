"""The fleet-wide view: an observer that reads leases from Redis and serves metrics.

A dead worker cannot report its own leaked lease, so these figures come from
Redis itself. Run one exporter per fleet (``dramatiq-leases exporter``). A
scan costs ``O(leases + waiters)``: ``SCAN`` over lease keys and lines (never
``KEYS``), one script call per batch of lease keys, per hash slot on a
cluster, and one pipeline per batch of lines. Metrics and the Busy page are
served from the last scan's snapshot: a request never calls Redis.

Metrics (labels ``actor_name``, ``queue_name`` unless noted). The gauges of
leases and lines are served only while the last scan is fresh (at most
``max(3 x interval, 30 s)`` old): a stuck exporter's figures go stale in
Prometheus instead of keeping a resolved leak paging, and
``DramatiqLeaseExporterStale`` says it is blind.

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
* ``dramatiq_lease_leaked_waiting`` (+ ``reason``): messages waiting in the
  lines of the keys of those leaked leases: users are waiting on the leak.
* ``dramatiq_lease_expired_total``: grants that ended by TTL instead of release,
  as the key's fence counter says when the next scan finds the grant gone
  (:func:`.observer.grant_ending`).
* ``dramatiq_lease_ended_unknown_total``: grants that ended while their fence
  counter no longer said how: it was gone (a ``fence_retention`` shorter than
  the scan interval expires a released key's counter before the scan reads
  it), or later grants had rewritten its record. Never counted as expired, so
  the safety SLO is not fed false expiries; a steady rate says the retention is
  too short for the exporter to see expiries.
* ``dramatiq_lease_oldest_acquired_timestamp_seconds``: when the oldest
  present lease was granted.
* ``dramatiq_lease_waiting`` (label ``actor_name`` only): messages waiting in
  the line of a busy key.
* ``dramatiq_lease_waiting_for`` (labels ``actor_name`` and ``reason`` only):
  the same messages by what they wait for (:data:`WAIT_REASONS`): ``rate``,
  their key is over its ``lock_rate`` (or held back by its last holder) until
  a time ahead, and starts nobody before, whoever holds it; ``holder``,
  anything else (a holder's release, or, between holders, the grant to the
  head of the line). Read from two fields of the key's fence counter
  (``rate_until``, ``hold_until``) in the pipeline that reads its line: one
  command per key with waiters, none for the others.
* ``dramatiq_lease_keys_full``: keys whose holders have reached their limit
  (``lock_limit``: as many holders as the highest limit they were granted
  under; a key of one holder while it is held), counted for each actor and
  queue among their holders. Never a per-key label: keys are unbounded.
* ``dramatiq_lease_key_saturation``: the highest holders / limit ratio among
  the actor's keys held now (0.5: its fullest key has half its holders; 1: a
  key is full).
* ``dramatiq_lease_exporter_last_scan_timestamp_seconds`` (no labels): when
  the last scan completed; until the first one does, when the exporter
  started. It is there from the first scrape, so ``time() - it > 120`` fires
  two minutes after a start with no successful scan, as it does two minutes
  after the last one.
* ``dramatiq_lease_exporter_scan_duration_seconds`` (no labels; 0 until a scan completes).
* ``dramatiq_lease_exporter_unreachable_nodes`` (no labels): Redis Cluster
  masters that did not answer the last scan. Each master is scanned on its own
  connection, so one that hangs costs its socket timeout and hides only what
  it holds: the lease figures are those of the masters that answered, the
  grants seen on the silent one are not judged ended until it answers, and
  each master that stops or starts answering is logged by name (and listed on
  ``/leases``). A single server, or every master, not answering fails the
  scan instead (``dramatiq_lease_redis_errors_total{operation="scan"}``).
* ``dramatiq_lease_exporter_unreadable_keys`` (label ``kind`` = lease | line |
  waiters | fence only): keys the last scan found of another type than their
  name says (a string at ``{prefix}:line:{...}``, written by hand or by other
  code), each logged once with its name. The scan goes on past them: one such
  key never hides the others. A line, waiters hash or fence counter of the
  wrong type is left out (a fence counter is read only when a grant the
  exporter saw has ended: that grant's end is then unknown; and for a key
  with waiters: its line is then said to wait for a holder); a lease key that
  is not a hash still counts as a lease without holder, since it blocks its
  key as one (leaked ``no_ttl`` if it has no TTL: ``release --if-dead`` ends
  it). A waiter's wake list whose name the lines' ``SCAN`` pattern matches (a
  waiter id ending with ``}``) is recognised by its name and skipped.
* ``dramatiq_lease_redis_errors_total{operation="scan"}``: failed scans.

The Busy page, ``GET /leases`` on the same port
-----------------------------------------------

Which job holds what right now, for Grafana (the Infinity data source, type
JSON, root selector ``leases`` or ``hot_keys``). Lease keys appear here, never
in metric labels; they may carry user ids, so the page is safe by default
(:mod:`.server` has the rules): without a token it is served on a loopback
bind only, and answers 403 on any other unless ``--busy-view open``;
``--busy-token-file FILE`` serves it only to requests sending ``Authorization:
Bearer <token>``, on any bind; ``--mask-keys`` (``--busy-keys hashed``) shows keys as
``sha256:<16 hex digits>`` with a null ``inspect_command``; ``/metrics`` is
served to all who reach the port (127.0.0.1 by default), unless
``--web.config.file`` asks for basic auth or client certificates. Served
from the last scan (no Redis call per request); ages are as of
``scanned_at``. Each table holds at most ``--top`` rows (default
50; ``--top 0`` turns the page off, 404); ``?limit=N`` asks for fewer
(capped by ``--top``; anything but a non-negative integer is a 400). The
field names are an API::

  {
    "scanned_at": 1767225600.25,          # Unix time of the scan; null before the first one completes
    "scan_duration_seconds": 0.004,
    "limit": 50,                          # rows per table at most, in this answer
    "leases_total": 3,                    # leases the scan saw (rows may be fewer)
    "hot_keys_total": 1,                  # keys with waiters the scan saw
    "leases": [                           # one per holder, most worrying first: leaked, overdue, then oldest
      {"key": "invoice:42", "actor": "send_invoice", "queue": "default",
       "message_id": "5f0c...", "host": "worker-1", "pid": 4242,   # pid: null if unknown
       "fence": 17, "state": "no_ttl", "leaked": true,
       "age_seconds": 93.1,               # since the grant; null for a hash without one (debris)
       "heartbeat_age_seconds": 1.2,      # since the last renewal; null likewise
       "ttl_left_seconds": null,          # null: the key has no TTL
       "line_length": 2,                  # waiters in the key's line
       "inspect_command": "dramatiq-leases show 'invoice:42'",
       "slot": 0,                         # the holder's slot (a key several hold at once: lock_limit)
       "holders": 1, "limit": 1}          # how many hold its key now, of how many may
    ],
    "hot_keys": [                         # longest line first, then longest wait
      {"key": "invoice:42", "line_length": 2, "oldest_wait_seconds": 12.5,
       "waiting_in_place": 1, "parked": 1, "promoted": 0,
       "actor": "send_invoice",           # the actor with the most waiters in the line
       "held": true, "state": "no_ttl",   # its worst holder's state; "free" between holders
       "inspect_command": "dramatiq-leases show 'invoice:42'",
       "holders": 1, "limit": 1,          # how many hold it now, of how many may
       "waiting_for": "holder",           # "rate": the key is over its lock_rate; "holder": anything else
       "next_start_ms": null}             # waiting for rate: ms until the rate allows the next start; else null
    ],
    "unreachable_nodes": [                # Cluster masters that did not answer that scan: their leases are missing
      {"node": "10.0.0.7:6379", "error": "TimeoutError: Timeout reading from socket"}
    ],
    "unreadable_keys": {"lease": 0, "line": 1, "waiters": 0, "fence": 0},  # as the gauge; names in the log
    "history_path": "/leases/history?key="   # + a row's key (its digest, keys masked), URL-encoded: its history
  }

``GET /leases/history?key=KEY``, under the same rules, reads the key's history
from Redis at each request (kept by workers with ``LeaseMiddleware(history=N)``;
see ``dramatiq-leases show KEY --history``), oldest event first::

  {"key": "invoice:42", "events": [
     {"event": "granted", "time_ms": 1767225600250, "fence": 17, "message_id": "5f0c...",
      "actor": "send_invoice", "holder": "worker-1:4242", "reason": "", "by": "", "slot": null,
      "waiter": "", "waited_ms": 0}, ...]}

A missing or invalid ``key`` is a 400; Redis not answering, a 503.

``state`` is one of ``alive``, ``heartbeat_overdue``, ``holder_dead``,
``past_max_hold``, ``no_ttl`` (``leaked`` is true for the last three).
``inspect_command`` adds the exporter's ``--redis-url`` (password shown as
``***``) and ``--prefix`` when they are not the defaults; it is null when no
key maps back to the Redis key. A free key whose lease key has braces is
stored under a digest and shown by it (``h:<sha1>``), which ``show`` accepts.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from ..core import Leases
from ..core.errors import LeaseUnavailableError
from ._http import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT
from .busy_page import DEFAULT_TOP, BusyPage, HotKeyRow, LeaseRow, inspect_command
from .observer import LEAK_REASONS, WAIT_REASONS, LeaseObserver, Snapshot, ended_by_ttl
from .server import LEASES_PATH, BusyAccess, ExporterApp, start_server
from .webconfig import WebConfig

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_PORT",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_TOP",
    "LEAK_REASONS",
    "LEASES_PATH",
    "WAIT_REASONS",
    "BusyAccess",
    "BusyPage",
    "Exporter",
    "ExporterApp",
    "HotKeyRow",
    "LeaseObserver",
    "LeaseRow",
    "Snapshot",
    "WebConfig",
    "ended_by_ttl",
    "inspect_command",
    "serve",
]

logger = logging.getLogger(__name__)

#: Default port of the exporter's endpoint.
DEFAULT_PORT = 9808


class Exporter:
    """An observer of ``leases`` and its endpoint, serving from construction on (``port`` 0: any free port).

    Parameters are those of :func:`serve`. Call :meth:`run` to scan until a
    stop event, :meth:`close` to stop serving.
    """

    def __init__(  # noqa: PLR0913 (keyword-only: the exporter command's documented flags)
        self,
        leases: Leases,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        match: str = "*",
        top: int = DEFAULT_TOP,
        cli_options: Sequence[str] = (),
        interval: float = 5.0,
        busy_access: BusyAccess | None = None,
        web_config: WebConfig | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
    ) -> None:
        self.observer = LeaseObserver(
            leases,
            match=match,
            top=top,
            cli_options=cli_options,
            stale_after=max(3 * interval, 30.0),
            hash_keys=busy_access is not None and busy_access.hash_keys,
        )
        self.interval = interval
        self.registry = CollectorRegistry()
        self.registry.register(self.observer)
        app = ExporterApp(
            self.registry,
            self.observer.busy_json if top > 0 else None,
            busy_access,
            history_json=self.observer.history_json if top > 0 else None,
        )
        self.server, self._thread = start_server(
            app, host, port, web_config, max_connections=max_connections, read_timeout=read_timeout
        )

    @property
    def port(self) -> int:
        """The port the endpoint listens on."""
        return int(self.server.server_address[1])

    def run(self, stop: threading.Event, interval: float | None = None) -> None:
        """Scan now and every ``interval`` seconds (default: the exporter's) until ``stop`` is set.

        A failed scan is logged and counted.
        """
        interval = self.interval if interval is None else interval
        while not stop.is_set():
            try:
                snap = self.observer.scan()
                logger.debug("Scanned %d lease(s) in %.3fs.", len(snap.leases), snap.duration)
            except LeaseUnavailableError as e:
                logger.error("Scan failed: %s", self.observer.mask(str(e)))  # masked: no key in the log
            stop.wait(interval)

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def serve(  # noqa: PLR0913 (keyword-only: the exporter command's documented flags)
    leases: Leases,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    interval: float = 5.0,
    match: str = "*",
    top: int = DEFAULT_TOP,
    cli_options: Sequence[str] = (),
    stop: threading.Event | None = None,
    busy_access: BusyAccess | None = None,
    web_config: WebConfig | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
) -> None:
    """Scan every ``interval`` seconds and serve the figures on ``host:port`` until ``stop`` is set or SIGTERM.

    ``top``: rows per table of ``/leases`` (0 turns it off); ``cli_options``:
    global ``dramatiq-leases`` arguments for its ``show`` commands; ``busy_access``: who may read
    ``/leases`` (default :class:`BusyAccess()`: a loopback bind only); ``web_config``: TLS and basic auth
    on every path (``--web.config.file``, :func:`.webconfig.load_web_config`). ``host`` is the loopback
    by default: pass ``"0.0.0.0"`` (or ``"::"``) for Prometheus on another host to reach it.
    ``max_connections`` (``--web.max-connections``): connections served at once (half at most per client
    address; the excess refused at once); ``read_timeout`` (``--web.read-timeout``): seconds each has, in
    all, for its TLS handshake and request head.
    """
    exporter = Exporter(
        leases,
        host=host,
        port=port,
        match=match,
        top=top,
        cli_options=cli_options,
        interval=interval,
        busy_access=busy_access,
        web_config=web_config,
        max_connections=max_connections,
        read_timeout=read_timeout,
    )
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    logger.info(
        "Serving lease metrics on %s://%s:%d/metrics%s, scanning every %.1fs.",
        "https" if web_config is not None and web_config.ssl_context is not None else "http",
        host,
        exporter.port,
        f" and the Busy page on {LEASES_PATH}" if top > 0 else "",
        interval,
    )
    try:
        exporter.run(stop)
    finally:
        exporter.close()
