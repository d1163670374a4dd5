"""``python -m dramatiq_leases.cli``: the ``dramatiq-leases`` command."""

import sys

from . import main

sys.exit(main())
