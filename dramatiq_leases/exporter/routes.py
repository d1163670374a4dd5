"""What the exporter serves, by path: the lease views, and prometheus_client's exposition for anything else.

One table of routes (:data:`LEASE_VIEWS`), one dispatch (:meth:`ExporterApp.__call__`): a lease view is
looked up, then it is off (``--top 0``: 404), refused (:mod:`.access`, before anything else: a refused
caller learns nothing about it), not a ``GET`` or ``HEAD`` (405), or answered by its handler. Every
other path goes to prometheus_client's ``make_wsgi_app``, so ``/metrics`` answers as it always has
(content negotiation, gzip, ``name[]`` filters). The web configuration's basic auth and headers wrap
this whole app (:func:`.server.start_server`), so a route added here is covered without a check of its
own. The documents' fields: docs/reference.md, "The Busy view".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, make_wsgi_app

from ..core.errors import LeaseError, LeaseUnavailableError
from . import page
from ._masking import hashed_key, is_pseudonym, mask_document, scrub, unmask
from .access import Access

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

#: The path of the Busy view's JSON.
LEASES_PATH = "/leases"
#: The path of a key's history (``?key=KEY``).
HISTORY_PATH = "/leases/history"
#: The path of the Busy page (HTML).
BUSY_PAGE_PATH = page.BUSY_PAGE_PATH
#: The lease views: the paths that show lease keys, under :class:`.access.Access`'s rules.
LEASE_VIEWS = (LEASES_PATH, HISTORY_PATH, BUSY_PAGE_PATH)

#: An answer: status, body (a JSON document, or bytes served with the headers given) and headers.
Answer = tuple[str, "dict[str, Any] | bytes", list[tuple[str, str]]]


class ExporterApp:
    """The WSGI app: the lease views from the last scan, anything else from the registry's exposition.

    Parameters:
      registry: what ``/metrics`` exposes.
      busy_json: the ``/leases`` document for a ``limit`` (``None``: the default), without any Redis call;
        ``None`` turns the lease views off (404).
      history_json: a key's history document (one Redis call), for ``/leases/history?key=KEY``; ``None``: 404.
      open_lease_views: serve the lease views unauthenticated on any bind (``--open-lease-views``).
      mask_keys: show keys as ``sha256:`` and 16 hex digits, and no ``inspect_command`` (``--mask-keys``).

    Attributes:
      access: who may read the lease views; its address is set by :func:`.server.start_server` (until then,
        an app served by some other server counts as served on a non-loopback bind).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        busy_json: Callable[[int | None], dict[str, Any]] | None,
        *,
        history_json: Callable[[str], dict[str, Any]] | None = None,
        open_lease_views: bool = False,
        mask_keys: bool = False,
    ) -> None:
        self.metrics = make_wsgi_app(registry)
        self.busy_json = busy_json
        self.history_json = history_json
        self.mask_keys = mask_keys
        self.access = Access(open_lease_views=open_lease_views)
        self._handlers: dict[str, Callable[[dict[str, list[str]]], Answer] | None] = {
            LEASES_PATH: self._leases if busy_json is not None else None,
            HISTORY_PATH: self._history if history_json is not None else None,
            BUSY_PAGE_PATH: self._page if busy_json is not None else None,
        }

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """WSGI entry point: the one dispatch."""
        path = environ.get("PATH_INFO", "/").rstrip("/")
        if path not in self._handlers:
            return self.metrics(environ, start_response)  # type: ignore[no-any-return]
        head = environ.get("REQUEST_METHOD") == "HEAD"
        handler = self._handlers[path]
        if handler is None:
            answer: Answer = ("404 Not Found", {"error": "the Busy view is off (--top 0)"}, [])
        elif (refusal := self.access.refusal(environ)) is not None:
            answer = (*refusal, [])
        elif environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            answer = ("405 Method Not Allowed", {"error": "use GET"}, [("Allow", "GET, HEAD")])
        else:
            answer = handler(parse_qs(environ.get("QUERY_STRING", "")))
        status, body, headers = answer
        if isinstance(body, bytes):
            start_response(status, headers)
            return [] if head else [body]
        encoded = _json(start_response, status, body, headers)
        return [] if head else encoded

    def _page(self, query: dict[str, list[str]]) -> Answer:
        """``/busy``: the page, which carries no data (its script fetches ``/leases``)."""
        return "200 OK", page.BUSY_PAGE, list(page.HEADERS)

    def _leases(self, query: dict[str, list[str]]) -> Answer:
        """``/leases?limit=N``: the last scan's rows."""
        assert self.busy_json is not None
        values = query.get("limit")
        limit = None
        if values:
            try:
                limit = int(values[-1])
                if limit < 0:
                    raise ValueError
            except ValueError:
                return "400 Bad Request", {"error": f"limit must be a non-negative integer, got {values[-1]!r}"}, []
        doc = self.busy_json(limit)
        return "200 OK", mask_document(doc) if self.mask_keys else doc, []

    def _history(self, query: dict[str, list[str]]) -> Answer:
        """``/leases/history?key=KEY``: the key's history, read from Redis now (keys masked: a row's digest)."""
        assert self.history_json is not None
        keys = query.get("key")
        if not keys:
            return "400 Bad Request", {"error": "name the key: /leases/history?key=KEY"}, []
        key = keys[-1]
        if self.mask_keys:
            # Only a digest is taken: a plain key would travel in URLs and logs, which masking keeps keys out of.
            if not is_pseudonym(key):
                error = "keys are masked (--mask-keys): ask by a digest /leases shows, ?key=sha256:<16 hex digits>"
                return "400 Bad Request", {"error": error}, []
            found = unmask(key, self.busy_json(None) if self.busy_json is not None else {})
            if found is None:
                return "404 Not Found", {"error": f"no key of the last scan's /leases rows has the digest {key}"}, []
            key = found
        try:
            doc = self.history_json(key)
        except LeaseError as e:  # an invalid key, a history that is not a list (400); Redis not answering (503)
            status = "503 Service Unavailable" if isinstance(e, LeaseUnavailableError) else "400 Bad Request"
            # The core's message quotes the key and its Redis names: masked, the digest asked by stands in.
            return status, {"error": scrub(str(e), [key]) if self.mask_keys else str(e)}, []
        return "200 OK", {**doc, "key": hashed_key(key)} if self.mask_keys else doc, []


def _json(
    start_response: StartResponse, status: str, doc: dict[str, Any], headers: list[tuple[str, str]] | None = None
) -> list[bytes]:
    body = json.dumps(doc, separators=(",", ":")).encode()
    start_response(
        status,
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            *(headers or []),
        ],
    )
    return [body]
