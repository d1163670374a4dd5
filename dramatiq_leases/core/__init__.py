"""The lease core: Redis scripts, leases and their heartbeat. It does not import Dramatiq."""

from .client import RedisClient
from .errors import (
    LeaseBusyError,
    LeaseConfigError,
    LeaseError,
    LeaseExpiredError,
    LeaseKeyError,
    LeaseStateError,
    LeaseUnavailableError,
    LeaseURLError,
)
from .heartbeat import Heartbeat
from .history import HistoryEvent
from .info import LeaseInfo, State, stale_after
from .keys import DEFAULT_PREFIX, KeyTemplate
from .lease import Busy, Lease, LostReason, Renewal
from .reading import LineInfo, ReadGaps
from .recovery import DeadRelease
from .store import Leases

__all__ = [
    "DEFAULT_PREFIX",
    "Busy",
    "DeadRelease",
    "Heartbeat",
    "HistoryEvent",
    "KeyTemplate",
    "Lease",
    "LeaseBusyError",
    "LeaseConfigError",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseInfo",
    "LeaseKeyError",
    "LeaseStateError",
    "LeaseURLError",
    "LeaseUnavailableError",
    "Leases",
    "LineInfo",
    "LostReason",
    "ReadGaps",
    "RedisClient",
    "Renewal",
    "State",
    "stale_after",
]
