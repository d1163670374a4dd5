"""Crash-safe Redis leases for Dramatiq actors.

Declare ``lock_key`` on an actor and add :class:`LeaseMiddleware` to the
broker; each message then runs only while it holds a lease on its key.
"""

from .core import Busy, Lease, LeaseConfigError, LeaseError, LeaseInfo, LeaseKeyError, Leases, LeaseUnavailableError
from .metrics import LeaseMetrics, PrometheusMetrics
from .middleware import (
    LeaseKeyRenderError,
    LeaseLost,
    LeaseMiddleware,
    LeaseOptionError,
    LeaseWaitExceeded,
    current_lease,
)

__version__ = "0.1.0"

__all__ = [
    "Busy",
    "Lease",
    "LeaseConfigError",
    "LeaseError",
    "LeaseInfo",
    "LeaseKeyError",
    "LeaseKeyRenderError",
    "LeaseLost",
    "LeaseMetrics",
    "LeaseMiddleware",
    "LeaseOptionError",
    "LeaseUnavailableError",
    "LeaseWaitExceeded",
    "Leases",
    "PrometheusMetrics",
    "__version__",
    "current_lease",
]
