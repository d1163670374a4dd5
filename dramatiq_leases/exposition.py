"""Where a worker process's lease metrics are exposed, in the manner of Dramatiq's ``Prometheus`` middleware.

On Dramatiq's own endpoint (9191) when its ``Prometheus`` middleware is there,
whatever the order of the two; else on an endpoint of ours, served by a
process of its own (a middleware "fork") from a shared multiprocess directory.
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

#: Where worker processes share metric values when this package serves its own endpoint.
METRICS_DIR = os.environ.get(
    "DRAMATIQ_LEASES_METRICS_DIR", os.path.join(tempfile.gettempdir(), "dramatiq-leases-prometheus")
)
#: Address of that endpoint (environment variables, as the endpoint runs in a process of its own).
METRICS_HOST = os.environ.get("DRAMATIQ_LEASES_METRICS_HOST", "0.0.0.0")
METRICS_PORT = int(os.environ.get("DRAMATIQ_LEASES_METRICS_PORT", "9192"))


def use_multiprocess_dir(path: str) -> None:
    """Make this process write metric values to ``path`` unless a multiprocess directory is already set."""
    os.makedirs(path, exist_ok=True)
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", path)


def forget_dead_processes(path: str) -> None:
    """Drop the live-gauge files of processes that died without saying so (SIGKILL, OOM).

    A killed worker never marks itself dead, so its last ``dramatiq_lease_held``
    would be summed in for good; every booting worker sweeps them.
    """
    from prometheus_client import multiprocess

    for name in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        try:
            pid = int(name.rsplit("_", 1)[1].removesuffix(".db"))
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
        except PermissionError:
            continue  # alive, someone else's


def serve_worker_metrics() -> int:
    """Serve the metrics of every worker process on ``METRICS_HOST:METRICS_PORT`` until terminated.

    Dramatiq runs this in a process of its own (a middleware "fork") when its
    own Prometheus middleware is absent.
    """
    use_multiprocess_dir(METRICS_DIR)
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])  # type: ignore[no-untyped-call]
    try:
        _, thread = start_http_server(METRICS_PORT, addr=METRICS_HOST, registry=registry)
    except OSError as e:
        # Another worker command on this host serves the same directory already, or the port is taken.
        logging.getLogger(__name__).error(
            "Lease metrics endpoint not started on %s:%d: %s (set DRAMATIQ_LEASES_METRICS_PORT).",
            METRICS_HOST,
            METRICS_PORT,
            e,
        )
        return 1
    thread.join()
    return 0


class WorkerExposition:
    """The exposition of one worker process's lease metrics.

    Parameters:
      own_endpoint: serve the metrics ourselves when Dramatiq's ``Prometheus``
        middleware is absent (``LeaseMiddleware(metrics_endpoint=...)``).
    """

    def __init__(self, own_endpoint: bool) -> None:
        self.own_endpoint = own_endpoint
        self.serving = False

    @property
    def forks(self) -> list[Callable[[], int]]:
        """The endpoint process, when this worker serves its own."""
        return [serve_worker_metrics] if self.serving else []

    def boot(self, middleware: list[Any]) -> None:
        """Decide where metric values go, before any is created (call at process boot)."""
        from dramatiq.middleware.prometheus import DB_PATH, Prometheus

        if any(isinstance(m, Prometheus) for m in middleware):
            # Dramatiq's hook sets the variable outright, whatever it was; so must this one, which may
            # run first: values created from now on must land where its endpoint reads.
            os.makedirs(DB_PATH, exist_ok=True)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = DB_PATH
        elif self.own_endpoint:
            use_multiprocess_dir(METRICS_DIR)
            self.serving = True
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            forget_dead_processes(os.environ["PROMETHEUS_MULTIPROC_DIR"])

    def shutdown(self) -> None:
        """Mark this process dead in the shared directory, so its live gauges stop counting."""
        if self.serving:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid(), os.environ["PROMETHEUS_MULTIPROC_DIR"])  # type: ignore[no-untyped-call]
