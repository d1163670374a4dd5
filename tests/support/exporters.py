"""An in-process :class:`Exporter` read over HTTP as Prometheus and a browser read it, and the clock of the Redis
its leases live on."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from dramatiq_leases.core import Leases
from dramatiq_leases.exporter import Exporter


def get(exporter: Exporter, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of a GET on the exporter (errors included)."""
    request = urllib.request.Request(f"http://127.0.0.1:{exporter.port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def scrape(exporter: Exporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of ``/metrics``, by name and labels."""
    status, _, body = get(exporter, "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def server_ms(leases: Leases) -> int:
    seconds, micros = leases.client.time()
    return int(seconds) * 1000 + int(micros) // 1000
