"""The lease core: Redis scripts, leases and their heartbeat. It does not import Dramatiq."""

from .errors import LeaseConfigError, LeaseError, LeaseKeyError, LeaseUnavailableError
from .heartbeat import Heartbeat
from .keys import DEFAULT_PREFIX, KeyTemplate
from .lease import Busy, DeadRelease, Lease, LeaseInfo, Leases, Renewal, State

__all__ = [
    "DEFAULT_PREFIX",
    "Busy",
    "DeadRelease",
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
