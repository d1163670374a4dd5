"""Names figure 7's workers (:mod:`bench.limit_app`) and its harness share; the harness must not import the app."""

#: The actor of figure 7, on :data:`bench.names.HOLD_QUEUE`.
HOLD_LIMIT_ACTOR = "hold_limit"

#: Redis list of the workers' trace events, when ``BENCH_TRACE=1``.
TRACE_KEY = "bench:trace"
