"""A stand-in for a pager and a ticket queue in docker-compose.yml: logs each Alertmanager notification.

Alertmanager (deploy/alertmanager/alertmanager.yml) posts critical alerts to
``/critical`` and warnings to ``/warning``; this prints one line per alert, so
``docker compose logs webhook`` shows what would have paged whom.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, HTTPServer


class Notifications(BaseHTTPRequestHandler):
    """Accepts Alertmanager's webhook payloads and prints their alerts."""

    def do_POST(self) -> None:
        """Print one line per alert of the notification, then answer 200."""
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        for alert in body.get("alerts", []):
            labels = alert.get("labels", {})
            print(
                f"{self.path.strip('/')}: {alert.get('status')} {labels.get('alertname')} "
                f"{ {k: v for k, v in labels.items() if k != 'alertname'} } "
                f"{alert.get('annotations', {}).get('summary', '')}",
                flush=True,
            )
        self.send_response(200)
        self.end_headers()


if __name__ == "__main__":
    HTTPServer(("0.0.0.0", 5001), Notifications).serve_forever()
