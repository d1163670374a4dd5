"""The test project's one app: a leased actor (tasks.py, which ``rundramatiq`` discovers)."""
