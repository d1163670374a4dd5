"""The middleware's hooks: declare, send, acquire or send back, run under the lease, release."""

from __future__ import annotations

import functools
import inspect
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

import dramatiq
from dramatiq.asyncio import async_to_sync
from dramatiq.middleware import Interrupt, Middleware

from ..core.client import client_from_url, connection_kwargs
from ..core.errors import LeaseConfigError, LeaseKeyError
from ..core.grants import DEFAULT_FAILOVER_GRACE
from ..core.heartbeat import Heartbeat
from ..core.keys import DEFAULT_PREFIX
from ..core.numbers import whole_count, whole_ms
from ..core.replication import DEFAULT_REPLICA_TIMEOUT_MS, MAX_REPLICAS
from ..core.store import Leases
from ..exposition import WorkerExposition
from ..otel_tracing import record_keys
from ..prometheus import LeaseMetrics, PrometheusMetrics
from . import delivery, held_back
from .backoff import DEFAULT_MAX_BACKOFF, DEFAULT_MIN_BACKOFF
from .busy import RoutineSkipFilter
from .context import Context
from .debouncing import Debouncing
from .declarations import Declarations
from .dramatiq_metrics import DramatiqPrometheus
from .options import (
    ACTOR_OPTIONS,
    ATTEMPTS_OPTION,
    DEFAULT_GIVE_UP,
    DEFAULT_LIMIT,
    DEFAULT_MAX_WAIT,
    DEFAULT_ON_BUSY,
    DEFAULT_TTL,
    DEFAULT_UNIQUE_TTL,
    FIRST_ATTEMPT_OPTION,
    HELD_BACK_OPTION,
    SENT_BACK_OPTION,
)
from .ordering import stamp
from .runs import Runs
from .stop_budget import warn_stop_budget
from .unique import Uniqueness, moving_on
from .waiting import LINE_OPTION, Waiting

__all__ = ["LeaseMiddleware"]

logger = logging.getLogger(__name__)

_skip_filter = RoutineSkipFilter()


class LeaseMiddleware(Middleware):
    """Runs each message of an actor with ``lock_key`` only while it holds a Redis lease on that key.

    The lease is acquired before the actor runs, renewed by a heartbeat
    while it runs, and released (owner-checked) when it returns or raises.
    A message whose key is busy takes a place in the key's line (see
    :mod:`.waiting`): near the head it waits in place, woken by the release
    (at most half the worker threads, a quarter of its time limit at most);
    further back it is parked in the broker until its turn nears. Retries'
    budget is untouched. A lease lost mid-run interrupts the actor with
    :class:`LeaseLost`. If Redis cannot be reached, the actor does not run.

    Parameters:
      redis_url: where leases are stored (``redis://...``; through Sentinel:
        ``redis+sentinel://host:26379,host2:26379/service/db``, see
        :meth:`Leases.from_url`); or pass ``client``.
      client: a ready ``redis.Redis`` (``Sentinel(...).master_for(...)`` too)
        or ``RedisCluster`` client instead of a URL.
      prefix: prefix of every Redis key written. Default ``"dramatiq-leases"``.
      lock_ttl: default ``lock_ttl`` in ms (at least 100). Default 30 000.
      lock_renew_interval: default ``lock_renew_interval`` in ms. Default ``lock_ttl / 3``.
      lock_max_hold: default ``lock_max_hold`` in ms: how long an actor may run
        under its lease. Default the actor's ``time_limit`` (from TimeLimit)
        plus TimeLimit's check interval and 1 s, so ``TimeLimitExceeded``
        comes first and a hung actor cannot hold forever.
      lock_min_backoff: default ``lock_min_backoff`` in ms. Default 50.
      lock_max_backoff: default ``lock_max_backoff`` in ms. Default 2 000: a
        waiting message asks at least every 2 s, so a freed key is taken soon
        (see docs/benchmarks.md for the trade-off).
      lock_max_wait: default ``lock_max_wait`` in ms, the wait budget; ``None``
        waits forever. Default 3 600 000 (an hour).
      lock_give_up: default ``lock_give_up``: ``"fail"`` (dead-letter the message)
        or ``"drop"`` (acknowledge it without running). Default ``"fail"``.
      lock_limit: default ``lock_limit``: how many messages of one key may run
        at once (an int from 1 to 1 000, or a callable of the actor's
        arguments returning one). Each holder has its own lease: token, TTL,
        heartbeat, fence. An attempt counts the key's holders against its own
        limit. Default 1.
      lock_on_busy: default ``lock_on_busy``, what a message does when its
        key is full: ``"wait"`` (its place in the key's line), ``"skip"``
        (acknowledged without running), ``"fail"`` (dead-lettered without
        running or a retry: :class:`LeaseBusyFailed`), ``"latest"`` (waits,
        but the key keeps only its newest such message waiting; the one it
        replaces is acknowledged without running). Default ``"wait"``. Every
        message that does not run is logged (INFO, naming the key's holders)
        and counted in ``dramatiq_lease_not_run_total{reason}``.
      lock_unique: default ``lock_unique``: ``None`` (no uniqueness),
        ``"queued"`` (a send is refused, with :class:`DuplicateMessage`,
        while another message of its key is queued: sent and not started) or
        ``"until_done"`` (until that message is done for good). Default
        ``None`` (see :mod:`.unique`).
      lock_unique_ttl: default ``lock_unique_ttl`` in ms: how long a unique
        record outlives the last sign of life of its message (its send plus
        its delay, a delivery, a retry, a park), so that a message purged or
        deleted by hand frees its key. Default 3 600 000 (an hour).
      lock_rate: default ``lock_rate``: at most N starts of a key in any
        window of a given length (``"10/s"``, ``"5/10s"``, ``"5000/d"``, or a
        list of such that all hold). A message the rate does not allow yet
        finds its key full and does what ``lock_on_busy`` says: ``"wait"``
        takes its place in the key's line and starts when the rate allows.
        Default ``None`` (no rate). An actor whose downstream says "too many
        requests" raises :class:`RateLimited`: its key is held back, and the
        message runs again first, without a retry.
      lock_debounce: default ``lock_debounce`` in ms: one run per burst of
        sends of a key (sends within this long of each other), with the newest
        message's arguments, once the key had no send for this long; the
        others are acknowledged without running (see :mod:`.debouncing`).
        Default ``None`` (none).
      lock_debounce_max: default ``lock_debounce_max`` in ms: a burst runs once
        its first send is this old, even if sends keep coming. Default ``None``.
      metrics: where to report; default :class:`PrometheusMetrics`.
      metrics_endpoint: when Dramatiq's own ``Prometheus`` middleware is
        absent, serve the lease metrics of all worker processes on
        ``$DRAMATIQ_LEASES_METRICS_PORT`` (default 9192). With it, they
        appear on its endpoint (9191) whatever the order of the two, and
        its own metrics do not count a busy message's rounds (see
        :mod:`.dramatiq_metrics`): it is counted once, when it runs.
      fence_retention: keep the fence counter of a key idle this long (ms),
        then let it expire: bounded memory for fleets leasing per-user or
        per-invoice keys (:class:`Leases`' ``fence_retention``; every
        process using the store must agree). Default ``None``: for ever.
      min_replicas: how many replicas must acknowledge each grant, adoption
        and renewal (``WAIT``, in the same round trip) before it counts; 0
        to 100, default 0 (none asked). A grant fewer acknowledged in time is
        released and the message comes back later, as when Redis is
        unreachable; a renewal round fewer acknowledged confirms nothing
        (see :class:`Leases` and docs/replication.md). Not with RedisCluster.
      replica_timeout: how long, in ms, to wait for those acknowledgements.
        Default 500; shorter than the client's ``socket_timeout``.
      history: keep each key's history, its newest ``history`` events (0 to
        10 000), for a week after the last (:class:`Leases`' ``history``;
        ``dramatiq-leases show KEY --history``). Default ``None``: none.
      restart_grace: for a lease store without persistence: after the
        server starts, a key it knows nothing of is not granted until it has
        been up this long (ms; set it to the longest ``lock_ttl``), so that
        no message runs beside a holder the restart made it forget
        (:class:`Leases`' ``restart_grace``; an actor with a longer
        ``lock_ttl`` is named in a warning when declared). Default ``None``:
        none.
      failover_grace: after the lease store's replication id changes (a
        failover, a restart from a snapshot), no key is granted for this long
        (ms; :class:`Leases`' ``failover_grace``; set it to the longest
        ``lock_ttl``, an actor with a longer one is named in a warning when
        declared; ``None`` or 0 turns it off). Default 30 000.
      trace_keys: record lease keys in span attributes (``lease.key``).
        Off by default, since keys often carry user ids; ``None`` leaves
        the process-wide setting (``DRAMATIQ_LEASES_TRACE_KEYS``) as it is.

    Each parameter ``lock_*`` is the default of the actor and message option
    of the same name (a message option beats the actor option, which beats
    the default): ``lock_key`` (a template such as
    ``"invoice:{invoice_id}"`` or a callable taking the actor's arguments),
    ``lock_ttl``, ``lock_renew_interval``, ``lock_max_hold``,
    ``lock_min_backoff``, ``lock_max_backoff``, ``lock_max_wait``,
    ``lock_give_up``, ``lock_limit``, ``lock_on_busy``, ``lock_unique``,
    ``lock_unique_ttl``, ``lock_rate``, ``lock_debounce``, ``lock_debounce_max``.
    ``send_with_options(lease=lease)`` hands a lease
    acquired by the producer to the worker, which adopts it once. A message
    of an actor without ``lock_key`` that carries any of these is refused at
    send time. Every time is a whole number of milliseconds.
    """

    def __init__(  # noqa: PLR0913 (keyword-only: the middleware's documented options)
        self,
        redis_url: str | None = None,
        *,
        client: Any = None,
        prefix: str = DEFAULT_PREFIX,
        lock_ttl: int = DEFAULT_TTL,
        lock_renew_interval: int | None = None,
        lock_max_hold: int | None = None,
        lock_min_backoff: int = DEFAULT_MIN_BACKOFF,
        lock_max_backoff: int = DEFAULT_MAX_BACKOFF,
        lock_max_wait: int | None = DEFAULT_MAX_WAIT,
        lock_give_up: str = DEFAULT_GIVE_UP,
        lock_limit: int | Callable[..., int] = DEFAULT_LIMIT,
        lock_on_busy: str = DEFAULT_ON_BUSY,
        lock_unique: str | None = None,
        lock_unique_ttl: int = DEFAULT_UNIQUE_TTL,
        lock_rate: str | Sequence[str] | None = None,
        lock_debounce: int | None = None,
        lock_debounce_max: int | None = None,
        metrics: LeaseMetrics | None = None,
        metrics_endpoint: bool = True,
        trace_keys: bool | None = None,
        fence_retention: int | None = None,
        min_replicas: int = 0,
        replica_timeout: int = DEFAULT_REPLICA_TIMEOUT_MS,
        history: int | None = None,
        restart_grace: int | None = None,
        failover_grace: int | None = DEFAULT_FAILOVER_GRACE,
    ) -> None:
        if (redis_url is None) == (client is None):
            raise LeaseConfigError("LeaseMiddleware needs exactly one of redis_url or client")
        # Checked here to name this middleware's parameters; Leases checks them again.
        whole_count(min_replicas, "min_replicas", maximum=MAX_REPLICAS, owner="LeaseMiddleware")
        whole_ms(replica_timeout, "replica_timeout", owner="LeaseMiddleware")
        if client is None:
            client = client_from_url(redis_url or "")
        else:
            _warn_without_socket_timeout(client)
        self.declarations = Declarations(
            {
                "lock_ttl": lock_ttl,
                "lock_renew_interval": lock_renew_interval,
                "lock_max_hold": lock_max_hold,
                "lock_min_backoff": lock_min_backoff,
                "lock_max_backoff": lock_max_backoff,
                "lock_max_wait": lock_max_wait,
                "lock_give_up": lock_give_up,
                "lock_limit": lock_limit,
                "lock_on_busy": lock_on_busy,
                "lock_unique": lock_unique,
                "lock_unique_ttl": lock_unique_ttl,
                "lock_rate": lock_rate,
                "lock_debounce": lock_debounce,
                "lock_debounce_max": lock_debounce_max,
            }
        )
        if trace_keys is not None:
            record_keys(trace_keys)
        # Worker threads can be interrupted mid-command: each gets a connection of its own.
        self.leases = Leases(
            client,
            prefix=prefix,
            thread_connections=True,
            fence_retention=fence_retention,
            min_replicas=min_replicas,
            replica_timeout=replica_timeout,
            history=history,
            restart_grace=restart_grace,
            failover_grace=failover_grace,
        )
        self.metrics = metrics if metrics is not None else PrometheusMetrics()
        self.heartbeat = Heartbeat(self.leases, metrics=self.metrics)
        self.runs = Runs(self.leases, self.heartbeat, self.metrics)
        # Dramatiq's own Prometheus middleware, if the broker has it: not to count busy rounds.
        self.dramatiq_prometheus = DramatiqPrometheus(self)
        self.waiting = Waiting(self.leases, on_drop=self.dramatiq_prometheus.left_delay_queue)
        self.unique = Uniqueness(self.declarations, self.leases, self.metrics)
        self.debouncing = Debouncing(self.declarations, self.leases, self.metrics, self.waiting)
        self.host = socket.gethostname()  # named in every lease's metadata
        # What the parts read, instead of this middleware: the same objects as the attributes above.
        self.context = Context(
            leases=self.leases,
            metrics=self.metrics,
            declarations=self.declarations,
            runs=self.runs,
            waiting=self.waiting,
            unique=self.unique,
            debouncing=self.debouncing,
            host=self.host,
        )
        self._exposition = WorkerExposition(metrics_endpoint)
        self._booted = False
        logging.getLogger("dramatiq.worker.WorkerThread").addFilter(_skip_filter)

    @property
    def booted(self) -> bool:
        """Whether this process booted as a worker process (Dramatiq's ``process_boot``)."""
        return self._booted

    @property
    def actor_options(self) -> set[str]:
        return set(ACTOR_OPTIONS)

    # Declaration and send ---------------------------------------------------

    def before_declare_actor(self, broker: dramatiq.Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        """Check the actor's lease options and prepare its key template; raises :class:`LeaseOptionError`."""
        if not self.declarations.declare(broker, actor):
            return
        ttl = self.declarations.options(actor.actor_name, actor.options).ttl
        for name, grace, when in (
            ("restart_grace", self.leases.restart_grace, "a restart"),
            ("failover_grace", self.leases.failover_grace, "a failover"),
        ):
            if 0 < grace < ttl:  # a grace covers holders of its length only
                logger.warning(
                    "actor %r: lock_ttl=%d is longer than %s=%d: after %s of the lease store, its key may be "
                    "granted while a holder the store forgot still runs",
                    actor.actor_name,
                    ttl,
                    name,
                    grace,
                    when,
                )
        fn = actor.fn
        original = getattr(fn, "__wrapped__", None)
        if original is not None and inspect.iscoroutinefunction(original):
            # Dramatiq runs it on its event loop: track the coroutine itself, which can outlive the wait.
            fn = async_to_sync(self.runs.tracking_coroutine(original))
        actor.fn = self.runs.guarded(fn, functools.partial(held_back.rate_limited, self.context, broker))
        if self._booted:
            self.metrics.declare({"actor": actor.actor_name, "queue": actor.queue_name})

    @property
    def forks(self) -> list[Callable[[], int]]:
        """The metrics endpoint process, when this middleware serves its own."""
        return self._exposition.forks

    def after_process_boot(self, broker: dramatiq.Broker) -> None:
        """Set up metrics for this worker process and note TimeLimit's default."""
        self.declarations.note_time_limit(broker)
        self._exposition.boot(broker.middleware)
        self.metrics.declare_process()
        self._booted = True
        for actor_name in self.declarations.actors:
            actor = broker.get_actor(actor_name)
            self.metrics.declare({"actor": actor_name, "queue": actor.queue_name})

    def before_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        """Keep Dramatiq's Prometheus from counting busy rounds: its metrics exist once every process boot ran.

        Name the line's channel too: the consumers start before ``after_worker_boot``, and a parked
        copy they receive meanwhile is registered under it.
        """
        self.dramatiq_prometheus.adjust(broker)
        self.waiting.prepare()

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        """Start the heartbeat, the releaser and the line's listener here, on threads no asynchronous exception
        can reach.

        Then warn of each leased actor whose run may outlast the worker's shutdown timeout (its lease would
        be left to expire rather than released at a stop: docs/deployment.md); the actors are declared now.
        """
        self.heartbeat.start()
        self.runs.releaser.start()
        self.waiting.boot(broker, worker.worker_threads)
        warn_stop_budget(broker, default_max_hold=self.declarations.defaults["lock_max_hold"])

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        """Wake the threads waiting in place: they park their messages instead of holding up the shutdown."""
        self.waiting.shutdown()

    def before_delay_message(self, broker: dramatiq.Broker, message: Any) -> None:
        """A parked copy reached this process's delay queue: register it with its line."""
        self.waiting.on_delay(message)

    def before_enqueue(self, broker: dramatiq.Broker, message: dramatiq.Message[Any], delay: int | None) -> None:
        """Refuse, at send time, a message whose options are invalid or whose key cannot be rendered, or (with
        ``lock_unique``) whose key is taken: :class:`DuplicateMessage`. Give a first send with
        ``lock_on_busy="latest"`` its order (see :mod:`.ordering`)."""
        self.waiting.on_enqueue(message)
        if delay is None and "eta" not in message.options:
            # Maybe one of our delayed copies leaving this process's delay queue, before anyone can run it.
            self.dramatiq_prometheus.left_delay_queue(message)
        resent = self._resent(message)
        try:
            self.declarations.check_message(broker, message, resent=resent)
        except (LeaseConfigError, LeaseKeyError) as e:
            if not resent:
                raise
            # Sent before (by a producer that did not check it, or with options written by hand): its delivery
            # refuses it, dead-lettered with an ERROR. Raised here, it would crash the consumer thread moving a
            # delayed copy on, again at each redelivery, and never settle.
            logger.debug("Message %s is enqueued again as sent; its delivery will refuse it: %s", message.message_id, e)
            return
        self.unique.before_enqueue(broker, message, delay, resent=resent)
        stamp(self.context, broker, message, delay, resent=resent)
        self.debouncing.before_enqueue(broker, message, resent=resent)

    def _resent(self, message: Any) -> bool:
        """Whether this enqueue is of a message sent before: a copy of the delivery this thread processes (a
        Retries retry, a copy sent back or parked), a parked copy sent on, or a delayed message moving on to
        its queue (Dramatiq's consumer thread enqueues it)."""
        return self.unique.processing(message) or LINE_OPTION in message.options or moving_on()

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        """The broker has the message: its unique record, if it took one, lives on past the send's grace."""
        self.unique.after_enqueue(broker, message, delay)
        self.debouncing.after_enqueue(message)

    def after_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        """Acknowledged: its unique record ends, unless the message was enqueued again meanwhile."""
        self.unique.settled(broker, message)

    def after_nack(self, broker: dramatiq.Broker, message: Any) -> None:
        """Dead-lettered: its unique record ends, unless the message was enqueued again meanwhile."""
        self.unique.settled(broker, message)

    # Processing -------------------------------------------------------------

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        """Acquire (or adopt) the message's lease, or send the message back and skip it (see :mod:`.delivery`)."""
        # Caught here, not in a function this calls: its entry would be one more place for an interruption to
        # land, and reach Retries. Every skip is marked where it is raised (whose skip it is, for Dramatiq's
        # Prometheus middleware and logs): a handler here that ran code after a copy was sent back would be one
        # more place too.
        try:
            delivery.acquire_or_skip(self.context, broker, message)
        except Interrupt as e:
            try:
                delivery.interrupted(self.context, broker, message, e)
            except Interrupt as again:  # a second source (TimeLimit after Shutdown) while settling: the same
                delivery.interrupted(self.context, broker, message, again)

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        """Release the lease if the actor did not (a middleware failed before it ran)."""
        self.waiting.forget_thread()  # an interruption while waiting in place may have left its place taken
        self.runs.forget()
        if exception is not None:
            # A failure while waiting (TimeLimit in the hook): Retries, which runs after us, must
            # send a new attempt, not this one's place and wait clock.
            for name in (FIRST_ATTEMPT_OPTION, ATTEMPTS_OPTION, LINE_OPTION, SENT_BACK_OPTION, HELD_BACK_OPTION):
                message.options.pop(name, None)

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        """Release the lease of a message skipped after it was acquired."""
        self.waiting.forget_thread()
        self.runs.forget()

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        """Release every lease this process holds for an actor no longer running (see :meth:`Runs.shutdown`)."""
        self.runs.shutdown()
        self._exposition.shutdown()


def _warn_without_socket_timeout(client: Any) -> None:
    """A renewal hanging on a socket without timeout cannot confirm a lease; say so at construction."""
    kwargs = connection_kwargs(client)
    if kwargs and kwargs.get("socket_timeout") is None:
        logger.warning(
            "The Redis client given to LeaseMiddleware has no socket_timeout: a renewal that hangs "
            "is abandoned by the watchdog, but give it one shorter than your TTLs."
        )
