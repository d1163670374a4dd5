"""Where a :class:`LeaseMiddleware` given neither ``redis_url`` nor ``client`` keeps its leases.

As Django's ``DRAMATIQ_BROKER["MIDDLEWARE"]`` builds it: ``LeaseMiddleware()``, no arguments. Its store is then,
in this order:

* the URL in ``DRAMATIQ_LEASES_URL`` (any form ``redis_url`` takes), read at construction;
* else the broker's own Redis, when the broker is a Dramatiq ``RedisBroker``: a client of the same server and
  database with the broker client's connection settings but connections of its own
  (:func:`~dramatiq_leases.core.client.client_like`), under this package's key prefix. The broker is known
  only at the middleware's first hook (``add_middleware`` gives it none), so that is where it is chosen;
* else :class:`LeaseConfigError`, at that first hook, naming both ways.
"""

from __future__ import annotations

import os
from typing import Any

from dramatiq.middleware.middleware import MiddlewareError

from ..core.client import RedisClient, client_like
from ..core.errors import LeaseConfigError

#: The environment variable naming the lease store of a ``LeaseMiddleware()`` given no ``redis_url`` or client.
URL_VARIABLE = "DRAMATIQ_LEASES_URL"


class NoLeaseStoreError(LeaseConfigError, MiddlewareError):
    """No Redis for the leases (a :class:`LeaseConfigError`). A ``MiddlewareError`` too, as Dramatiq's hooks
    swallow any other: the actor's declaration, the send or the worker's boot fails instead of going on
    without the middleware, and an actor never runs unprotected."""


def url_from_environment() -> str | None:
    """The lease store's URL from ``DRAMATIQ_LEASES_URL``; ``None`` when unset or blank."""
    return os.environ.get(URL_VARIABLE, "").strip() or None


def client_for_broker(broker: Any) -> RedisClient:
    """A client of ``broker``'s own Redis with connections of its own; raises :class:`NoLeaseStoreError` when the
    broker is not a ``RedisBroker`` (or has no client yet)."""
    from dramatiq.brokers.redis import RedisBroker

    client = getattr(broker, "client", None) if isinstance(broker, RedisBroker) else None
    if client is None or not hasattr(client, "connection_pool"):
        raise NoLeaseStoreError(
            f"LeaseMiddleware() has no Redis for its leases: its broker is a {type(broker).__name__}, not a "
            f"RedisBroker whose Redis it could share. Set {URL_VARIABLE} (redis://host:6379/1, or any URL "
            "redis_url takes), or pass LeaseMiddleware(redis_url=...) or LeaseMiddleware(client=...)."
        )
    return client_like(client)
