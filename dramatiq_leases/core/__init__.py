"""The lease core: Redis scripts, leases and their heartbeat. It does not import Dramatiq."""

from .errors import LeaseConfigError, LeaseError, LeaseKeyError, LeaseUnavailableError
from .heartbeat import Heartbeat
from .keys import DEFAULT_PREFIX, KeyTemplate
from .lease import Busy, Lease, LeaseInfo, Leases, Renewal, State

__all__ = [
    "DEFAULT_PREFIX",
    "Busy",
    "Heartbeat",
    "KeyTemplate",
    "Lease",
    "LeaseConfigError",
    "LeaseError",
    "LeaseInfo",
    "LeaseKeyError",
    "LeaseUnavailableError",
    "Leases",
    "Renewal",
    "State",
]
