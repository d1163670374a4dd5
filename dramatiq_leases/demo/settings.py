"""The names and numbers that the demo and its worker app share, and the Redis names of one run."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

# Names shared with demo.app, which reads its settings from the environment.
ENV_REDIS_URL = "DRAMATIQ_LEASES_DEMO_REDIS_URL"
ENV_PREFIX = "DRAMATIQ_LEASES_DEMO_PREFIX"
ENV_NAMESPACE = "DRAMATIQ_LEASES_DEMO_NAMESPACE"
ENV_EVENTS_KEY = "DRAMATIQ_LEASES_DEMO_EVENTS_KEY"
ENV_LOCK_TTL = "DRAMATIQ_LEASES_DEMO_LOCK_TTL_MS"
ENV_PARENT_PID = "DRAMATIQ_LEASES_DEMO_PARENT_PID"
ENV_PRIVATE_REDIS = "DRAMATIQ_LEASES_DEMO_PRIVATE_REDIS"

#: The demo's queue and actor.
QUEUE_NAME = "invoices"
ACTOR_NAME = "process_invoice"

#: Lease TTL of the demo's actor: short, so the orphaned lease expires within seconds.
LOCK_TTL_MS = 3000

#: How long a Dramatiq worker may miss heartbeats before its unacked messages are requeued.
HEARTBEAT_TIMEOUT_MS = 3000

#: Worker instances (``dramatiq`` commands) and threads in each.
WORKER_INSTANCES = 3
THREADS = 2

#: Seconds between looks at Redis, and between status lines.
POLL_INTERVAL = 0.1
STATUS_INTERVAL = 1.0


@dataclass(frozen=True)
class RunNames:
    """Every Redis name one run writes, specific to it so that a shared Redis is left untouched."""

    #: The lease prefix.
    prefix: str
    #: The Dramatiq namespace.
    namespace: str
    #: The list in which the workers record their job events.
    events_key: str

    @classmethod
    def new(cls, prefix: str) -> RunNames:
        """Fresh names for a run: ``prefix`` and the namespace with a random suffix."""
        run_id = secrets.token_hex(3)
        namespace = f"dramatiq-leases-demo-{run_id}"
        return cls(prefix=f"{prefix}-demo-{run_id}", namespace=namespace, events_key=f"{namespace}:events")
