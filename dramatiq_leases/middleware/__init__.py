"""The Dramatiq middleware: each message of an actor with ``lock_key`` runs under its lease.

A small package, one idea a module: :mod:`.options` (names, defaults,
checks), :mod:`.backoff` (how a busy message waits), :mod:`.context` (what
the parts share), :mod:`.delivery` (a delivery's start), :mod:`.acquiring` (one
delivery's way to its lease), :mod:`.guard` (the run of an actor under its
lease, safe from asynchronous exceptions), :mod:`.busy` (a busy key: back to
the queue), :mod:`.held_back` (an actor that raised ``RateLimited``),
:mod:`.outages` (sending a message back through a broker outage),
:mod:`.waiting` (the process's side of the line), :mod:`.declarations` (what
actors declare and messages carry), :mod:`.runs` (which thread holds which
lease, and how a run ends), :mod:`.unique` (sends refused while another
message of their key is queued or running), :mod:`.stop_budget` (time
limits against the worker's shutdown timeout), :mod:`.dramatiq_metrics` (Dramatiq's own
Prometheus middleware, kept from counting busy rounds), :mod:`.errors`, :mod:`.connecting` (the
store of a middleware given no Redis: ``DRAMATIQ_LEASES_URL`` or the broker's), and :mod:`.hooks`
(:class:`LeaseMiddleware` itself).
"""

from .backoff import DEFAULT_MAX_BACKOFF, DEFAULT_MIN_BACKOFF
from .errors import (
    DuplicateMessage,
    LeaseBusyFailed,
    LeaseKeyRenderError,
    LeaseLimitError,
    LeaseOptionError,
    LeaseSendUnavailableError,
    LeaseWaitExceeded,
    RateLimited,
)
from .guard import LeaseLost
from .hooks import LeaseMiddleware
from .options import (
    ACTOR_OPTIONS,
    DEFAULT_GIVE_UP,
    DEFAULT_LIMIT,
    DEFAULT_MAX_WAIT,
    DEFAULT_ON_BUSY,
    DEFAULT_TTL,
    LEASE_OPTION,
    ON_BUSY_POLICIES,
    UNIQUE_MODES,
)
from .runs import current_lease
from .unique import Sent, try_send, try_send_with_options

__all__ = [
    "ACTOR_OPTIONS",
    "DEFAULT_GIVE_UP",
    "DEFAULT_LIMIT",
    "DEFAULT_MAX_BACKOFF",
    "DEFAULT_MAX_WAIT",
    "DEFAULT_MIN_BACKOFF",
    "DEFAULT_ON_BUSY",
    "DEFAULT_TTL",
    "LEASE_OPTION",
    "ON_BUSY_POLICIES",
    "UNIQUE_MODES",
    "DuplicateMessage",
    "LeaseBusyFailed",
    "LeaseKeyRenderError",
    "LeaseLimitError",
    "LeaseLost",
    "LeaseMiddleware",
    "LeaseOptionError",
    "LeaseSendUnavailableError",
    "LeaseWaitExceeded",
    "RateLimited",
    "Sent",
    "current_lease",
    "try_send",
    "try_send_with_options",
]
