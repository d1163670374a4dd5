"""The metrics interface of the lease core: what it reports, never how.

:class:`LeaseMetrics` is implemented outside the core (Prometheus, OpenTelemetry);
its base class records nothing. Labels are the lease's ``actor`` and ``queue``
metadata, never the lease key: keys are unbounded and often carry user ids.
"""

from __future__ import annotations

from collections.abc import Mapping

from .lease import LostReason

Meta = Mapping[str, str]

#: Why a held lease can be lost (the ``reason`` label of ``dramatiq_lease_lost_total``).
LOST_REASONS = tuple(reason.value for reason in LostReason)

#: Why a message did not run (the ``reason`` label of ``dramatiq_lease_not_run_total``): its key was busy and
#: its ``lock_on_busy`` said skip or fail, a newer message took its place (``latest``), it spent its wait
#: budget (``lock_max_wait``), it was a stray copy of a message that already ran, or its actor's ``lock_limit``
#: callable failed on the worker (``limit_error``, per delivery: it raised, and Retries decides, or it
#: returned a bad value, and the message is dead-lettered); or its actor raised ``RateLimited``
#: (``rate_limited``: acknowledged, and its copy runs once the key's hold ends); or a newer send of its burst
#: runs instead (``debounced``: ``lock_debounce``).
NOT_RUN_REASONS = (
    "skipped",
    "failed",
    "superseded",
    "gave_up",
    "duplicate",
    "limit_error",
    "rate_limited",
    "debounced",
)

#: Outcomes of one renewal (the ``outcome`` label of ``dramatiq_lease_renewals_total``).
RENEWAL_OUTCOMES = ("ok", "lost", "error")

#: Operations whose Redis errors a worker counts (the ``operation`` label of ``dramatiq_lease_redis_errors_total``).
ERROR_OPERATIONS = ("acquire", "renew", "release")

# Histogram buckets are part of the interface: every implementation uses the same ones, so that
# the alert thresholds and dashboard heatmaps, which sit on these boundaries, mean the same thing.

#: Buckets (seconds) for acquire, release and renewal round trips.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

#: Buckets (seconds) for waits and holds, which last as long as jobs do.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


def labels_of(meta: Meta) -> tuple[str, str]:
    """The ``(actor_name, queue_name)`` labels of a lease's metadata."""
    return meta.get("actor", ""), meta.get("queue", "")


class LeaseMetrics:
    """What the lease core and the middleware report. This base class records nothing."""

    def acquire(self, meta: Meta, outcome: str, seconds: float) -> None:
        """One acquire attempt took ``seconds``; ``outcome`` is acquired, busy or error."""

    def wait(self, meta: Meta, seconds: float) -> None:
        """A message acquired its lease ``seconds`` after its first attempt."""

    def busy_retry(self, meta: Meta) -> None:
        """A message went back to the queue because its lease was busy (parked, or asked to come again)."""

    def handoff(self, meta: Meta, seconds: float) -> None:
        """A waiter of the line was granted the lease ``seconds`` after the previous holder released it."""

    def gave_up(self, meta: Meta) -> None:
        """A message exhausted its wait budget."""

    def not_run(self, meta: Meta, reason: str) -> None:
        """A message was acknowledged or dead-lettered without running, for ``reason`` (:data:`NOT_RUN_REASONS`)."""

    def held(self, meta: Meta, delta: int) -> None:
        """The number of leases held changed by ``delta``."""

    def hold(self, meta: Meta, seconds: float) -> None:
        """A lease was held for ``seconds`` and has ended."""

    def renewal(self, meta: Meta, outcome: str) -> None:
        """One lease renewal ended with ``outcome``: ok, lost or error."""

    def renew_round(self, seconds: float) -> None:
        """One heartbeat round (all due leases of the process) took ``seconds``."""

    def lost(self, meta: Meta, reason: str) -> None:
        """A held lease was lost for ``reason``: gone, stolen, unreachable or max_hold."""

    def redis_error(self, operation: str) -> None:
        """Redis failed during ``operation``: acquire, renew, release or scan."""

    def declare(self, meta: Meta) -> None:
        """Create the series of an actor at zero, so that ``increase()`` sees its first event."""

    def declare_process(self) -> None:
        """Create the process's series without labels of an actor (Redis errors) at zero, at boot.

        A worker's endpoint then serves lease series even before (or without) a leased actor: their
        absence means the scrape reaches something else (``DramatiqLeaseWorkerMetricsMissing``).
        """


#: Records nothing; the default where no metrics are wanted.
NULL_METRICS = LeaseMetrics()
