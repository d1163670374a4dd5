"""PLACEHOLDER for the docker-compose.yml demo worker app (`dramatiq examples.compose_app`).

Only here so that tests/test_bundle.py finds the module the compose file
names; the real app replaces this file.
"""

raise NotImplementedError("examples.compose_app is a placeholder")
