"""Benchmarks of dramatiq-leases against the locks users would otherwise reach for.

Run ``python -m bench`` (see ``docs/benchmarks.md``).
"""
