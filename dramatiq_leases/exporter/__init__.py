"""The fleet-wide view: an observer that reads leases from Redis, and the endpoint that serves what it saw.

A dead worker cannot report its own leaked lease, so these figures come from Redis itself: run one
exporter per fleet (``dramatiq-leases exporter``). Each scan reads Redis with ``SCAN`` (:mod:`.observer`);
a request never calls Redis, but for a key's history. What it serves and who may read it: the metrics in
docs/reference.md ("Exporter metrics"), the lease views' documents there too ("The Busy view"), the
flags in "CLI: exporter", and the guide's "Observability", "The Busy view" and "Protecting the exporter".
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
from .routes import LEASES_PATH, ExporterApp
from .server import start_server
from .webconfig import WebConfig

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_PORT",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_TOP",
    "LEAK_REASONS",
    "LEASES_PATH",
    "WAIT_REASONS",
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
        web_config: WebConfig | None = None,
        open_lease_views: bool = False,
        mask_keys: bool = False,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
    ) -> None:
        self.observer = LeaseObserver(
            leases,
            match=match,
            top=top,
            cli_options=cli_options,
            stale_after=max(3 * interval, 30.0),
            hash_keys=mask_keys,
        )
        self.interval = interval
        self.registry = CollectorRegistry()
        self.registry.register(self.observer)
        app = ExporterApp(
            self.registry,
            self.observer.busy_json if top > 0 else None,
            history_json=self.observer.history_json if top > 0 else None,
            open_lease_views=open_lease_views,
            mask_keys=mask_keys,
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
    web_config: WebConfig | None = None,
    open_lease_views: bool = False,
    mask_keys: bool = False,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
) -> None:
    """Scan every ``interval`` seconds and serve the figures on ``host:port`` until ``stop`` is set or SIGTERM.

    ``top``: rows per table of ``/leases`` (0 turns it off); ``cli_options``:
    global ``dramatiq-leases`` arguments for its ``show`` commands; ``web_config``: TLS and basic auth or
    client certificates on every path (``--web.config.file``, :func:`.webconfig.load_web_config`);
    ``open_lease_views`` (``--open-lease-views``): serve the lease views unauthenticated on a bind that is not
    the loopback (:mod:`.access`); ``mask_keys`` (``--mask-keys``): show keys as digests. ``host`` is the loopback
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
        web_config=web_config,
        open_lease_views=open_lease_views,
        mask_keys=mask_keys,
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
        f" and the Busy view on {LEASES_PATH}" if top > 0 else "",
        interval,
    )
    try:
        exporter.run(stop)
    finally:
        exporter.close()
