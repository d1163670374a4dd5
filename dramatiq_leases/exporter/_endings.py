"""How a grant the exporter saw has ended, judged from its key's fence counter (the observer's expiry count)."""

from __future__ import annotations

from enum import Enum


class Ending(str, Enum):
    """How a grant the exporter saw has ended, as its key's fence counter tells."""

    RELEASED = "released"
    EXPIRED = "expired"
    #: The counter does not say: it is gone (a ``fence_retention`` shorter than the scan interval expired
    #: it), or later grants rewrote the record. Never counted as an expiry: it would feed the safety SLO
    #: false alarms.
    UNKNOWN = "unknown"


def grant_ending(fence: int, state: dict[str, int], slot: int | None = None) -> Ending:
    """How grant ``fence`` of a key ended, judged from the key's fence counter ``state``.

    ``released`` is the highest fence released by its owner, ``expired`` the last fence a later acquirer
    found unreleased, ``fence`` the last granted. A counter that is gone, or made again since (with a
    retention, an idle counter expires; the next grant or release starts a new one), cannot tell:
    :attr:`Ending.UNKNOWN`. ``slot``: the grant's holder slot when its end is recorded per slot
    (:attr:`LeaseInfo.per_slot`): that slot's ``r:<slot>``, ``e:<slot>`` and ``g:<slot>`` are read instead.
    """
    if slot is None:
        released, expired, last = state.get("released"), state.get("expired"), state.get("fence")
    else:
        released, expired, last = state.get(f"r:{slot}"), state.get(f"e:{slot}"), state.get(f"g:{slot}")
    if released == fence:
        return Ending.RELEASED
    if expired == fence:
        return Ending.EXPIRED
    if last is None:  # gone, or made again by a later release: nothing says what became of this grant
        return Ending.UNKNOWN
    # The counter that granted it still counts (one made again starts above it, and its releases too), and
    # says it was never released: nothing granted since, or a release older than it.
    if last == fence or (released is not None and released < fence):
        return Ending.EXPIRED
    if released is not None and (expired is None or expired < fence):
        return Ending.RELEASED  # released since, and no expiry since, so not one of this grant
    # Later grants rewrote the record (an expiry since, or a counter made again): say so rather than alarm.
    return Ending.UNKNOWN


def ended_by_ttl(fence: int, state: dict[str, int], slot: int | None = None) -> bool:
    """Whether grant ``fence`` of a key is known to have ended by TTL (:func:`grant_ending`)."""
    return grant_ending(fence, state, slot) is Ending.EXPIRED
