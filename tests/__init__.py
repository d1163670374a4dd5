"""The test suite. Every script it runs, in this process and in every process it starts, is built with the
check that fails a script on a key it was not given (``dramatiq_leases.core.scripts.CHECK_KEYS``): set here,
before the package is imported."""

import os

os.environ["DRAMATIQ_LEASES_CHECK_KEYS"] = "1"
