"""Write ``dramatiq_leases/core/slot_tags.txt``: for each Redis Cluster slot, the shortest hash tag in it.

Each slot's epoch record (``lua/acquire.lua``'s failover grace) is named with its slot's tag, so that a script
on any of the slot's keys can declare it. Run ``python -m tools.slot_tags`` to write the file again (its
content never changes: the tags are found in the same order every time).
"""

from __future__ import annotations

import binascii
from pathlib import Path

SLOTS = 16_384
PATH = Path(__file__).resolve().parent.parent / "dramatiq_leases" / "core" / "slot_tags.txt"


def tags() -> list[str]:
    """The first hexadecimal string (from ``0`` upwards) that Redis hashes to each slot, slot by slot."""
    found: list[str | None] = [None] * SLOTS
    left, n = SLOTS, 0
    while left:
        tag = format(n, "x")
        slot = binascii.crc_hqx(tag.encode(), 0) % SLOTS  # Redis Cluster's CRC16 (XMODEM)
        if found[slot] is None:
            found[slot] = tag
            left -= 1
        n += 1
    return [tag for tag in found if tag is not None]


if __name__ == "__main__":
    PATH.write_text("\n".join(tags()) + "\n", encoding="ascii")
