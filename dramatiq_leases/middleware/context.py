"""What the middleware's parts share: built once by :class:`LeaseMiddleware`, handed to each part instead of it.

The parts (:mod:`.acquiring`, :mod:`.delivery`, :mod:`.ordering`) read these and nothing else of the
middleware, and never import :mod:`.hooks`: the imports of ``middleware/`` form no cycle. :class:`Uniqueness`,
one of the fields, takes the declarations, store and metrics it needs itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.metrics import LeaseMetrics
from ..core.store import Leases
from .debouncing import Debouncing
from .declarations import Declarations
from .runs import Runs
from .unique import Uniqueness
from .waiting import Waiting


@dataclass(frozen=True, slots=True)
class Context:
    """One middleware's store, metrics, declarations and per-process state.

    Attributes:
      leases: the lease store.
      metrics: where to report.
      declarations: the actors' declarations and option defaults (message, then actor, then default).
      runs: which thread holds which lease.
      waiting: the process's side of the line.
      unique: the ``lock_unique`` records.
      debouncing: the ``lock_debounce`` records.
      host: this host's name, in every lease's metadata.
    """

    leases: Leases
    metrics: LeaseMetrics
    declarations: Declarations
    runs: Runs
    waiting: Waiting
    unique: Uniqueness
    debouncing: Debouncing
    host: str
