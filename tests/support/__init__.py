"""Helpers shared by the test modules: an in-process Dramatiq stack, worker processes, promtool, waiting."""
