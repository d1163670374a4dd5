"""Crash-safe Redis leases for Dramatiq actors.

Declare ``lock_key`` on an actor and add :class:`LeaseMiddleware` to the
broker; each message then runs only while it holds a lease on its key.

The lease core (:class:`Leases`, :class:`Lease`, :class:`Busy`) does not
import Dramatiq; the middleware names are loaded on first use, so a web app
that only takes leases never imports the worker machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core import (
    Busy,
    DeadRelease,
    Heartbeat,
    HistoryEvent,
    Lease,
    LeaseBusyError,
    LeaseConfigError,
    LeaseError,
    LeaseExpiredError,
    LeaseInfo,
    LeaseKeyError,
    Leases,
    LeaseStateError,
    LeaseUnavailableError,
    LeaseURLError,
    LineInfo,
    LostReason,
    ReadGaps,
    Renewal,
    State,
)
from .core import tracing as _core_tracing
from .leader import Leader, LeaderLost
from .otel_tracing import current_context as _otel_context
from .otel_tracing import span as _otel_span
from .prometheus import LeaseMetrics, OTelMetrics, PrometheusMetrics

# The core opens its spans through an interface; OpenTelemetry's plugs in here.
_core_tracing.set_tracer(_otel_span, _otel_context)

if TYPE_CHECKING:
    from .middleware import (
        DuplicateMessage,
        LeaseBusyFailed,
        LeaseKeyRenderError,
        LeaseLimitError,
        LeaseLost,
        LeaseMiddleware,
        LeaseOptionError,
        LeaseSendUnavailableError,
        LeaseWaitExceeded,
        RateLimited,
        Sent,
        current_lease,
        try_send,
        try_send_with_options,
    )

__version__ = "0.2.0.dev0"  # 0.1.0 is the first version (CHANGELOG.md); this one freezes the API for 1.0

_MIDDLEWARE_NAMES = {
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
}


def __getattr__(name: str) -> Any:
    if name in _MIDDLEWARE_NAMES:
        from . import middleware

        return getattr(middleware, name)
    raise AttributeError(f"module 'dramatiq_leases' has no attribute {name!r}")


# The public API, frozen for 1.0 (docs/api.md, checked by tests/test_api.py). With ``dramatiq_leases.web``
# and ``dramatiq_leases.embedded``, it is all there is: every other module is internal and may change.
__all__ = [
    "Busy",
    "DeadRelease",
    "DuplicateMessage",
    "Heartbeat",
    "HistoryEvent",
    "Leader",
    "LeaderLost",
    "Lease",
    "LeaseBusyError",
    "LeaseBusyFailed",
    "LeaseConfigError",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseInfo",
    "LeaseKeyError",
    "LeaseKeyRenderError",
    "LeaseLimitError",
    "LeaseLost",
    "LeaseMetrics",
    "LeaseMiddleware",
    "LeaseOptionError",
    "LeaseSendUnavailableError",
    "LeaseStateError",
    "LeaseURLError",
    "LeaseUnavailableError",
    "LeaseWaitExceeded",
    "Leases",
    "LineInfo",
    "LostReason",
    "OTelMetrics",
    "PrometheusMetrics",
    "RateLimited",
    "ReadGaps",
    "Renewal",
    "Sent",
    "State",
    "__version__",
    "current_lease",
    "try_send",
    "try_send_with_options",
]
