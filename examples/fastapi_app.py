"""FastAPI: ``POST /exports/{user_id}`` starts a report export unless one is running for that user.

Run with ``uvicorn examples.fastapi_app:app`` from the repository root,
next to a worker (``dramatiq examples.web_tasks``); see ``web_tasks`` for
the environment variables. Same answers as ``examples/flask_app.py``: 202
with the fence and message id, 423 with ``Retry-After`` and a
``Lease-Ticket`` to send back for a place in the key's line, 503 without
Redis.

The handlers are plain ``def``: the Redis calls block, so FastAPI runs them
in its thread pool rather than on the event loop.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dramatiq_leases import LeaseUnavailableError, web
from examples.web_tasks import EXPORT_LOCK_TTL_MS, WEB_META, export_report, leases

app = FastAPI()


@app.post("/exports/{user_id}")
def start_export(user_id: int, request: Request, seconds: float = 2.0) -> JSONResponse:
    """Queue an export of ``user_id``'s report (``?seconds=`` sets how long it takes)."""
    try:
        # No interval: nobody renews this lease until a worker adopts it, so observers
        # (`dramatiq-leases list`, `release --if-dead`) judge it by its TTL alone.
        lease = web.try_acquire(
            leases,
            f"export:report:{user_id}",
            EXPORT_LOCK_TTL_MS,
            ticket=request.headers.get(web.TICKET_HEADER),
            meta=WEB_META,
        )
    except LeaseUnavailableError:
        return JSONResponse({"error": "unavailable", "detail": "Cannot reach Redis; try again."}, status_code=503)
    if isinstance(lease, web.Locked):
        return JSONResponse(
            web.locked_body(lease), status_code=web.HTTP_423_LOCKED, headers=web.locked_response_headers(lease)
        )
    try:
        message = export_report.send_with_options(args=(user_id, seconds), lease=lease)
    except BaseException:
        leases.release(lease)  # nothing was queued: free the user at once instead of at TTL
        raise
    return JSONResponse(web.accepted_body(lease, message.message_id), status_code=web.HTTP_202_ACCEPTED)


@app.get("/healthz")
def healthz() -> dict[str, bool]:
    """Liveness probe."""
    return {"ok": True}
