"""PLACEHOLDER for the docker-compose.yml demo producer (`python -m examples.compose_producer`).

Only here so that tests/test_bundle.py finds the module the compose file
names; the real producer replaces this file.
"""

raise NotImplementedError("examples.compose_producer is a placeholder")
