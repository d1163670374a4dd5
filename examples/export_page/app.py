"""The export page's Flask app: the page at ``/``, and the routes of ``examples.flask_app`` it calls.

The page (``page.html``: inline CSS and vanilla JavaScript, no build step)
posts to ``POST /exports/<user>`` and shows each answer: 202 queued (with the
fence and the message id), 423 an export is running (counting down from
``Retry-After``), 503 Redis is unreachable (with a retry button). After a
423 or a 202 it polls ``GET /exports/<user>/status``
(:func:`dramatiq_leases.web.status`): the button comes back when the lock is
free, early if the export ends early, late if its heartbeat renewed it, and
the page tells an export that finished from one whose worker died.
"""

from __future__ import annotations

from pathlib import Path

from flask import Flask, Response

from examples.flask_app import api

PAGE = Path(__file__).with_name("page.html")

app = Flask(__name__)
app.register_blueprint(api)


@app.get("/")
def page() -> Response:
    """The export page."""
    return Response(PAGE.read_text(encoding="utf-8"), mimetype="text/html")
