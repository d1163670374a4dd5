"""Settings of the test project: django_dramatiq on a RedisBroker, ``LeaseMiddleware()`` by its dotted path only.

``LEASES_TEST_BROKER_URL``: the broker's Redis. The lease store is whatever ``LeaseMiddleware()`` finds itself:
``DRAMATIQ_LEASES_URL`` if the test sets it, else the broker's Redis. ``LEASES_TEST_RECORD_URL``: where the
actor records its runs (tasks.py).
"""

from __future__ import annotations

import os

SECRET_KEY = "dramatiq-leases-tests-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["django_dramatiq", "tests.apps.django_site.fenced"]
DATABASES: dict[str, dict[str, str]] = {}  # nothing here touches a database
DRAMATIQ_BROKER = {
    "BROKER": "dramatiq.brokers.redis.RedisBroker",
    "OPTIONS": {"url": os.environ["LEASES_TEST_BROKER_URL"]},
    "MIDDLEWARE": [
        "dramatiq.middleware.AgeLimit",
        "dramatiq.middleware.TimeLimit",
        "dramatiq.middleware.Callbacks",
        "dramatiq.middleware.Retries",
        "dramatiq_leases.LeaseMiddleware",
    ],
}
