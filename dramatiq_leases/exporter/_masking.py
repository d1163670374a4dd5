"""``--mask-keys``: the pseudonym shown for a key, the lease views' documents with keys replaced by it, and
error text with every spelling of a key replaced by it.

The core's errors quote the keys they concern (``could not read the history of 'KEY'``) and name their
Redis keys (``{prefix}:history:{KEY}``); a masked exporter passes such text on (an HTTP body, a log line)
only through :func:`scrub`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from ..core.keys import hash_tag

#: Hex digits of the SHA-256 shown for a key with ``--mask-keys`` (64 bits: rows never collide).
HASH_DIGITS = 16


def hashed_key(key: str) -> str:
    """The pseudonym shown for ``key`` with ``--mask-keys``: ``sha256:`` and 16 hex digits of its SHA-256."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_DIGITS]


def scrub(text: str, keys: Iterable[str]) -> str:
    """``text`` with each of ``keys`` replaced by its pseudonym wherever it appears: as is, as ``repr`` spells
    it inside its quotes, and as the hash tag of its Redis keys. Longest keys first, so a key that contains
    another is replaced whole. A short key may garble the text around it: a garbled message is safe, a
    leaked key is not."""
    for key in sorted(set(keys), key=len, reverse=True):
        if not key:
            continue
        digest = hashed_key(key)
        for form in sorted({key, repr(key)[1:-1], hash_tag(key)}, key=len, reverse=True):
            text = text.replace(form, digest)
    return text


def mask_document(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` (a ``/leases`` document) with every row's key replaced by its pseudonym and no
    ``inspect_command`` (which would name it); ``history_path`` stays: ``/leases/history`` takes a row's digest."""
    out = dict(doc)
    for table in ("leases", "hot_keys"):
        if isinstance(doc.get(table), list):
            out[table] = [{**row, "key": hashed_key(str(row["key"])), "inspect_command": None} for row in doc[table]]
    return out


def is_pseudonym(text: str) -> bool:
    """Whether ``text`` is spelt as :func:`hashed_key` spells a pseudonym (``sha256:`` and 16 characters)."""
    return text.startswith("sha256:") and len(text) == len("sha256:") + HASH_DIGITS


def unmask(digest: str, doc: Mapping[str, Any]) -> str | None:
    """The key of ``doc``'s rows (a ``/leases`` document, keys plain) whose pseudonym is ``digest``, or ``None``."""
    for table in ("leases", "hot_keys"):
        for row in doc.get(table) or ():
            if hashed_key(str(row["key"])) == digest:
                return str(row["key"])
    return None
