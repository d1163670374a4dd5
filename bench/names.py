"""Names shared by the worker app (:mod:`bench.app`) and the harness, which must not import the app."""

#: Redis list the jobs append their records to.
LOG_KEY = "bench:log"

#: Queues, one per role, so a worker group can be pointed at one role with ``--queues``.
THROUGHPUT_QUEUE = "bench-tp"
HOLD_QUEUE = "bench-hold"
PROBE_QUEUE = "bench-probe"

#: Redis hash of enqueues per message id, when counted (:mod:`bench.enqueues`).
ENQUEUES_KEY = "bench:enqueues"
