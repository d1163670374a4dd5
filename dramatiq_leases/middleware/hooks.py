"""The middleware's hooks: declare, send, acquire or send back, run under the lease, release."""

from __future__ import annotations

import functools
import inspect
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import dramatiq
from dramatiq.asyncio import async_to_sync
from dramatiq.middleware import Interrupt, Middleware

from ..core.client import client_from_url, connection_kwargs
from ..core.errors import LeaseConfigError, LeaseKeyError
from ..core.grants import DEFAULT_FAILOVER_GRACE
from ..core.heartbeat import Heartbeat
from ..core.keys import DEFAULT_PREFIX, validate_prefix
from ..core.numbers import whole_count, whole_ms
from ..core.replication import DEFAULT_REPLICA_TIMEOUT_MS, MAX_REPLICAS
from ..core.scripts import MAX_HISTORY
from ..core.store import Leases
from ..exposition import WorkerExposition
from ..otel_tracing import record_keys
from ..prometheus import LeaseMetrics, PrometheusMetrics
from . import delivery, held_back
from .backoff import DEFAULT_MAX_BACKOFF, DEFAULT_MIN_BACKOFF
from .busy import RoutineSkipFilter
from .confirms import warn_unconfirmed_sends
from .connecting import URL_VARIABLE, NoLeaseStoreError, client_for_broker, url_from_environment
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
from .unique import Uniqueness
from .waiting import LINE_OPTION, Waiting, moving_on

__all__ = ["LeaseMiddleware"]

logger = logging.getLogger(__name__)

_skip_filter = RoutineSkipFilter()


class LeaseMiddleware(Middleware):
    """Runs each message of an actor with ``lock_key`` only while it holds a Redis lease on that key.

    Its store: ``redis_url`` or ``client``; without either, ``$DRAMATIQ_LEASES_URL``, else the broker's own Redis
    when the broker is a ``RedisBroker`` (chosen at the first hook, which gets the broker), else
    :class:`LeaseConfigError`. Each ``lock_*`` parameter is the default of the actor and message option of the
    same name. Every parameter, its default and meaning: docs/reference.md, "Middleware parameters".
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
        if redis_url is not None and client is not None:
            raise LeaseConfigError("LeaseMiddleware takes one of redis_url or client, not both")
        # Checked here, even when the store is chosen later (see :mod:`.connecting`), to name this middleware's
        # parameters; Leases checks them again.
        _check_store_options(
            prefix, fence_retention, min_replicas, replica_timeout, history, restart_grace, failover_grace
        )
        if client is None:
            redis_url = redis_url if redis_url is not None else url_from_environment()
            client = None if redis_url is None else client_from_url(redis_url)  # None: the broker's, at a hook
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
        self._store_options: dict[str, Any] = {
            "prefix": prefix,
            "fence_retention": fence_retention,
            "min_replicas": min_replicas,
            "replica_timeout": replica_timeout,
            "history": history,
            "restart_grace": restart_grace,
            "failover_grace": failover_grace,
        }
        self.metrics = metrics if metrics is not None else PrometheusMetrics()
        # Dramatiq's own Prometheus middleware, if the broker has it: not to count busy rounds.
        self.dramatiq_prometheus = DramatiqPrometheus(self)
        self.host = socket.gethostname()  # named in every lease's metadata
        self._exposition = WorkerExposition(metrics_endpoint)
        self._booted = False
        self._context: Context | None = None  # the store and the parts built on it, once chosen
        self._choosing = threading.Lock()
        if client is not None:
            self._build(client)
        logging.getLogger("dramatiq.worker.WorkerThread").addFilter(_skip_filter)

    # The store and the parts built on it: in __init__ when it is named (redis_url, client, DRAMATIQ_LEASES_URL),
    # else at the first hook, which gets the broker (see :mod:`.connecting`).
    heartbeat: Heartbeat
    runs: Runs
    waiting: Waiting
    unique: Uniqueness
    debouncing: Debouncing
    #: What the parts read, instead of this middleware: the same objects as the attributes above.
    context: Context

    def _build(self, client: Any) -> Context:
        """Build the store on ``client`` and the parts on it; published by one store, ``_context``, last: an
        interruption before it leaves nothing a hook would use, and the next hook builds them again."""
        # Worker threads can be interrupted mid-command: each gets a connection of its own.
        leases = Leases(client, thread_connections=True, **self._store_options)
        heartbeat = Heartbeat(leases, metrics=self.metrics)
        runs = Runs(leases, heartbeat, self.metrics)
        waiting = Waiting(leases, on_drop=self.dramatiq_prometheus.left_delay_queue)
        unique = Uniqueness(self.declarations, leases, self.metrics)
        debouncing = Debouncing(self.declarations, leases, self.metrics, waiting)
        context = Context(
            leases=leases,
            metrics=self.metrics,
            declarations=self.declarations,
            runs=runs,
            waiting=waiting,
            unique=unique,
            debouncing=debouncing,
            host=self.host,
        )
        self.heartbeat, self.runs, self.waiting, self.unique, self.debouncing = (
            heartbeat,
            runs,
            waiting,
            unique,
            debouncing,
        )
        self.context = context
        self._context = context
        return context

    def _ready(self, broker: dramatiq.Broker) -> Context:
        """The store and its parts; at the first hook of a middleware given none, the broker's Redis (or
        :class:`LeaseConfigError` naming ``DRAMATIQ_LEASES_URL`` and ``redis_url``, a ``MiddlewareError`` that
        Dramatiq's hooks pass on)."""
        context = self._context
        if context is not None:
            return context
        with self._choosing:  # two threads' first hooks at once build one store
            context = self._context
            if context is None:
                try:
                    context = self._build(client_for_broker(broker))
                except NoLeaseStoreError:
                    raise
                except Exception as e:  # any other would be swallowed by Dramatiq's hooks: never go on without
                    raise NoLeaseStoreError(
                        f"LeaseMiddleware() could not set up its leases on its broker's Redis: {e}; set "
                        f"{URL_VARIABLE}, or pass redis_url or client"
                    ) from e
            return context

    @property
    def leases(self) -> Leases:
        """The lease store. Given ``redis_url``, ``client`` or ``DRAMATIQ_LEASES_URL``, from construction; else the
        broker's Redis, from the first hook (raises :class:`LeaseConfigError` before)."""
        context = self._context
        if context is None:
            raise LeaseConfigError(
                "LeaseMiddleware() has no lease store yet: without redis_url, client or "
                f"{URL_VARIABLE}, it shares its broker's Redis, chosen at its first hook (an actor declared, a "
                "message sent, a worker's boot)"
            )
        return context.leases

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
        self._ready(broker)
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
        self._ready(broker)
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
        copy they receive meanwhile is registered under it. The store is chosen by now at the latest: the
        hooks of the worker's threads (processing, delay queues, stops) come after this one and never choose it.
        """
        self._ready(broker)
        self.dramatiq_prometheus.adjust(broker)
        self.waiting.prepare()

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        """Start the heartbeat, the releaser and the line's listener here, on threads no asynchronous exception
        can reach.

        Then warn of each leased actor whose run may outlast the worker's shutdown timeout (its lease would
        be left to expire rather than released at a stop: docs/deployment.md); the actors are declared now.
        And of a RabbitMQ broker without publisher confirms, which can lose the copies the middleware sends on.
        """
        self.heartbeat.start()
        self.runs.releaser.start()
        self.waiting.boot(broker, worker.worker_threads)
        warn_stop_budget(broker, default_max_hold=self.declarations.defaults["lock_max_hold"])
        warn_unconfirmed_sends(broker)

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
        self._ready(broker)
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
            self.waiting.running()
        except Interrupt as e:
            try:
                delivery.interrupted(self.context, broker, message, e)
            except Interrupt as again:  # a second source (TimeLimit after Shutdown) while settling: the same
                delivery.interrupted(self.context, broker, message, again)

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        """Release the lease if the actor did not (a middleware failed before it ran)."""
        self.waiting.done_with_message()  # an interruption while waiting in place may have left its place taken
        self.runs.forget()
        if exception is not None:
            # A failure while waiting (TimeLimit in the hook): Retries, which runs after us, must
            # send a new attempt, not this one's place and wait clock.
            for name in (FIRST_ATTEMPT_OPTION, ATTEMPTS_OPTION, LINE_OPTION, SENT_BACK_OPTION, HELD_BACK_OPTION):
                message.options.pop(name, None)

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        """Release the lease of a message skipped after it was acquired."""
        self.waiting.done_with_message()
        self.runs.forget()

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        """Release every lease this process holds for an actor no longer running (see :meth:`Runs.shutdown`)."""
        self.runs.shutdown()
        self._exposition.shutdown()


def _check_store_options(
    prefix: str,
    fence_retention: int | None,
    min_replicas: int,
    replica_timeout: int,
    history: int | None,
    restart_grace: int | None,
    failover_grace: int | None,
) -> None:
    """Raise :class:`LeaseConfigError` naming the first store-wide parameter that cannot work."""
    owner = "LeaseMiddleware"
    validate_prefix(prefix)
    whole_count(min_replicas, "min_replicas", maximum=MAX_REPLICAS, owner=owner)
    whole_ms(replica_timeout, "replica_timeout", owner=owner)
    if fence_retention is not None:
        whole_ms(fence_retention, "fence_retention", owner=owner)
    if history is not None:
        whole_count(history, "history", maximum=MAX_HISTORY, owner=owner)
    for name, grace in (("restart_grace", restart_grace), ("failover_grace", failover_grace)):
        if grace is not None:
            whole_ms(grace, name, minimum=0, owner=owner)


def _warn_without_socket_timeout(client: Any) -> None:
    """A renewal hanging on a socket without timeout cannot confirm a lease; say so at construction."""
    kwargs = connection_kwargs(client)
    if kwargs and kwargs.get("socket_timeout") is None:
        logger.warning(
            "The Redis client given to LeaseMiddleware has no socket_timeout: a renewal that hangs "
            "is abandoned by the watchdog, but give it one shorter than your TTLs."
        )
