"""The Busy page in a browser: ``GET /busy``, one HTML page that shows ``/leases`` and refreshes itself.

Its source is three package data files, ``static/busy.html``, ``busy.css`` and ``busy.js`` (vanilla
JavaScript, no build step): the HTML links the other two, so the page opens as is from the source tree,
and the exporter serves it as one document, the stylesheet and script inlined, under a
Content-Security-Policy that lets only them run (by hash) and reach only the page's own origin. The
script builds every cell with ``textContent``, never parsing data as HTML. What the page shows:
docs/guide.md, "The Busy view".
"""

from __future__ import annotations

import base64
import hashlib
from importlib import resources

#: The path of the Busy page (HTML), beside ``/leases`` (its JSON).
BUSY_PAGE_PATH = "/busy"

#: The package data files of the page, in ``dramatiq_leases/exporter/static/``.
SOURCES = ("busy.html", "busy.css", "busy.js")

#: The tags of ``busy.html`` that the served page replaces with the file they name, inlined.
_STYLESHEET = '<link rel="stylesheet" href="busy.css">'
_SCRIPT_TAG = '<script src="busy.js"></script>'


def source(name: str) -> str:
    """The text of the page's data file ``name`` (one of :data:`SOURCES`), as shipped in the package."""
    return (resources.files(__package__) / "static" / name).read_text(encoding="utf-8")


def _inline(html: str, tag: str, element: str, text: str) -> str:
    if html.count(tag) != 1:
        raise RuntimeError(f"busy.html must hold {tag} exactly once")  # a broken package, found at import
    return html.replace(tag, f"<{element}>{text}</{element}>")


def _source_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


# Inlined after a newline, so each file starts at its first line and the element's text is "\n" + the file.
_STYLE, _SCRIPT = "\n" + source("busy.css"), "\n" + source("busy.js")

#: The page, as served: busy.html with busy.css and busy.js inlined.
BUSY_PAGE = _inline(_inline(source("busy.html"), _STYLESHEET, "style", _STYLE), _SCRIPT_TAG, "script", _SCRIPT).encode(
    "utf-8"
)

#: Only this page's own script and style run, and it reaches only its own origin.
CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; script-src {_source_hash(_SCRIPT)}; style-src {_source_hash(_STYLE)}; "
    "connect-src 'self'; img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


#: The headers the page is served with.
HEADERS = (
    ("Content-Type", "text/html; charset=utf-8"),
    ("Content-Length", str(len(BUSY_PAGE))),
    ("Cache-Control", "no-store"),
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
)
