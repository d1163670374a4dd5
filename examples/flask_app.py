"""Flask: ``POST /exports/<user_id>`` starts a report export unless one is running for that user.

Run with ``flask --app examples.flask_app run`` from the repository root,
next to a worker (``dramatiq examples.web_tasks``); see ``web_tasks`` for
the environment variables.

* ``202 Accepted`` with ``{"key", "fence", "message_id"}`` when the export
  was queued; the worker adopts the lease taken here, so no second export
  can start between this answer and the job.
* ``423 Locked`` with ``Retry-After`` and a ``Lease-Ticket`` header when an
  export for this user is still queued or running. A client that sends the
  ticket back (same header) takes a place in the key's line and keeps it by
  asking again within ``Retry-After``: its export starts when its turn
  comes, even while workers keep queueing jobs on the same key (see
  ``dramatiq_leases.web``).
* ``503 Service Unavailable`` when Redis cannot be reached.

``GET /exports/<user_id>/status`` answers :func:`dramatiq_leases.web.status`
for that user's key (free or held, until when, the holder's fence, how the
last export ended): what a page polls after a 423 to re-enable its button
(``examples/export_page``). The routes are the blueprint ``api``, which that
page's app registers too.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Flask, jsonify, request

from dramatiq_leases import LeaseUnavailableError, web
from examples.web_tasks import EXPORT_LOCK_TTL_MS, WEB_META, export_report, leases

#: The export routes (``POST /exports/<user_id>``, its status, ``/healthz``), for any Flask app to register.
api = Blueprint("exports", __name__)

UNAVAILABLE = {"error": "unavailable", "detail": "Cannot reach Redis; try again."}


def export_key(user_id: int) -> str:
    """The lease key of ``user_id``'s export (the actor's ``lock_key``, filled in)."""
    return f"export:report:{user_id}"


@api.post("/exports/<int:user_id>")
def start_export(user_id: int) -> Any:
    """Queue an export of ``user_id``'s report (``?seconds=`` sets how long it takes)."""
    seconds = request.args.get("seconds", default=2.0, type=float)
    try:
        # No interval: nobody renews this lease until a worker adopts it, so observers
        # (`dramatiq-leases list`, `release --if-dead`) judge it by its TTL alone.
        lease = web.try_acquire(
            leases,
            export_key(user_id),
            EXPORT_LOCK_TTL_MS,
            ticket=request.headers.get(web.TICKET_HEADER),
            meta=WEB_META,
        )
    except LeaseUnavailableError:
        return jsonify(UNAVAILABLE), 503
    if isinstance(lease, web.Locked):
        return jsonify(web.locked_body(lease)), web.HTTP_423_LOCKED, web.locked_response_headers(lease)
    try:
        message = export_report.send_with_options(args=(user_id, seconds), lease=lease)
    except BaseException:
        leases.release(lease)  # nothing was queued: free the user at once instead of at TTL
        raise
    return jsonify(web.accepted_body(lease, message.message_id)), web.HTTP_202_ACCEPTED


@api.get("/exports/<int:user_id>/status")
def export_status(user_id: int) -> Any:
    """Whether ``user_id``'s export key is free, and if not until when (:func:`dramatiq_leases.web.status`)."""
    try:
        return jsonify(web.status(leases, export_key(user_id)))
    except LeaseUnavailableError:
        return jsonify(UNAVAILABLE), 503


@api.get("/healthz")
def healthz() -> Any:
    """Liveness probe."""
    return {"ok": True}


app = Flask(__name__)
app.register_blueprint(api)
