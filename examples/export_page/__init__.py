"""The export page: an Export button in a browser over the Flask example's JSON API.

``python -m examples.export_page`` (or ``make export-page``) starts a private
Redis, a worker and the page; ``flask --app examples.export_page.app run``
serves the page alone, next to a worker (``dramatiq examples.web_tasks``).
"""
