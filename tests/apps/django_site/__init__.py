"""A minimal Django project whose Dramatiq settings name ``"dramatiq_leases.LeaseMiddleware"`` (tests/test_setup.py)."""
