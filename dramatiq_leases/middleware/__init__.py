"""The Dramatiq middleware: each message of an actor with ``lock_key`` runs under its lease.

A small package, one idea a module: :mod:`.options` (names, defaults,
checks), :mod:`.backoff` (how a busy message waits), :mod:`.guard` (the run
of an actor under its lease, safe from asynchronous exceptions),
:mod:`.errors`, and :mod:`.hooks` (:class:`LeaseMiddleware` itself).
"""

from .backoff import DEFAULT_BACKOFF_MAX, DEFAULT_BACKOFF_MIN
from .errors import LeaseKeyRenderError, LeaseOptionError, LeaseWaitExceeded
from .guard import LeaseLost
from .hooks import LeaseMiddleware, current_lease
from .options import ACTOR_OPTIONS, DEFAULT_GIVE_UP, DEFAULT_MAX_WAIT, DEFAULT_TTL, LEASE_OPTION

__all__ = [
    "ACTOR_OPTIONS",
    "DEFAULT_BACKOFF_MAX",
    "DEFAULT_BACKOFF_MIN",
    "DEFAULT_GIVE_UP",
    "DEFAULT_MAX_WAIT",
    "DEFAULT_TTL",
    "LEASE_OPTION",
    "LeaseKeyRenderError",
    "LeaseLost",
    "LeaseMiddleware",
    "LeaseOptionError",
    "LeaseWaitExceeded",
    "current_lease",
]
