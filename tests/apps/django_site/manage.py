"""The test project's ``manage.py`` (``rundramatiq``, ``shell``), run with the repository's root on the path."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_site.settings")
    from django.core.management import execute_from_command_line  # type: ignore[import-untyped]  # no stubs

    execute_from_command_line(sys.argv)
