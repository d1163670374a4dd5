"""The middleware's hooks: declare, send, acquire or send back, run under the lease, release."""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import dramatiq
from dramatiq.asyncio import async_to_sync
from dramatiq.middleware import Middleware, SkipMessage
from dramatiq.middleware.time_limit import TimeLimit

from ..core.errors import LeaseConfigError, LeaseKeyError
from ..core.heartbeat import Heartbeat
from ..core.keys import DEFAULT_PREFIX, KeyTemplate
from ..core.lease import Busy, Lease, new_token
from ..core.scripts import MAX_MS
from ..core.store import Leases, client_from_url
from ..exposition import WorkerExposition
from ..metrics import LeaseMetrics, PrometheusMetrics
from .backoff import DEFAULT_BACKOFF_MAX, DEFAULT_BACKOFF_MIN, backoff_delay
from .errors import LeaseKeyRenderError, LeaseOptionError, LeaseWaitExceeded
from .guard import DONE, READY, LeaseLost, Run, call_under, coroutine_under
from .options import (
    ACTOR_OPTIONS,
    ATTEMPTS_OPTION,
    DEFAULT_GIVE_UP,
    DEFAULT_MAX_WAIT,
    DEFAULT_TTL,
    FIRST_ATTEMPT_OPTION,
    LEASE_MESSAGE_OPTIONS,
    LEASE_OPTION,
    TIME_LIMIT_GRACE,
    Options,
    optional_ms,
    resolve,
)

__all__ = ["LeaseKeyRenderError", "LeaseLost", "LeaseMiddleware", "LeaseOptionError", "LeaseWaitExceeded",
           "current_lease"]

logger = logging.getLogger(__name__)

#: Set on a skipped delivery so Dramatiq's "was skipped" warning can be muted: a busy lease is routine.
_SKIP_MARK = "lease_skipped"


class _RoutineSkipFilter(logging.Filter):
    """Drops Dramatiq's WARNING for deliveries this middleware sent back on purpose (it logs its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args and record.msg == "Message %s was skipped.":
            options = getattr(args[0], "options", None)
            return not (isinstance(options, dict) and options.get(_SKIP_MARK))
        return True


_skip_filter = _RoutineSkipFilter()


_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("dramatiq_leases_current", default=None)


def current_lease() -> Lease:
    """The lease held by the running actor (works in sync and async actors).

    Raises:
      RuntimeError: outside an actor that holds a lease.
    """
    lease = _current.get()
    if lease is None:
        raise RuntimeError("current_lease() was called outside an actor that holds a lease (is lock_key set?)")
    return lease


_DIRECT = object()  # marks a call of the actor outside a worker's message


class LeaseMiddleware(Middleware):
    """Runs each message of an actor with ``lock_key`` only while it holds a Redis lease on that key.

    The lease is acquired before the actor runs, renewed by a heartbeat
    while it runs, and released (owner-checked) when it returns or raises.
    A message whose key is busy goes back to the queue with exponential
    backoff and full jitter: no worker thread waits and Retries' budget is
    untouched. A lease lost mid-run interrupts the actor with
    :class:`LeaseLost`. If Redis cannot be reached, the actor does not run.

    Parameters:
      redis_url: where leases are stored (``redis://...``); or pass ``client``.
      client: a ready ``redis.Redis`` or ``RedisCluster`` client instead of a URL.
      prefix: prefix of every Redis key written. Default ``"dramatiq-leases"``.
      ttl: default ``lock_ttl`` in ms (at least 100). Default 30 000.
      renew_interval: default ``lock_renew_interval`` in ms. Default ``lock_ttl / 3``.
      max_hold: default ``lock_max_hold`` in ms: how long an actor may run
        under its lease. Default the actor's ``time_limit`` (from TimeLimit)
        plus TimeLimit's check interval and 1 s, so ``TimeLimitExceeded``
        comes first and a hung actor cannot hold forever.
      backoff_min: default ``lock_backoff_min`` in ms. Default 50.
      backoff_max: default ``lock_backoff_max`` in ms. Default 2 000: a
        waiting message asks at least every 2 s, so a freed key is taken soon
        (see docs/benchmarks.md for the trade-off).
      max_wait: default ``lock_max_wait`` in ms, the wait budget; ``None``
        waits forever. Default 3 600 000 (an hour).
      give_up: default ``lock_give_up``: ``"fail"`` (dead-letter the message)
        or ``"drop"`` (acknowledge it without running). Default ``"fail"``.
      metrics: where to report; default :class:`PrometheusMetrics`.
      metrics_endpoint: when Dramatiq's own ``Prometheus`` middleware is
        absent, serve the lease metrics of all worker processes on
        ``$DRAMATIQ_LEASES_METRICS_PORT`` (default 9192). With it, they
        appear on its endpoint (9191) whatever the order of the two.

    Actor and message options (a message option beats the actor option,
    which beats the default above): ``lock_key`` (a template such as
    ``"invoice:{invoice_id}"`` or a callable taking the actor's arguments),
    ``lock_ttl``, ``lock_renew_interval``, ``lock_max_hold``,
    ``lock_backoff_min``, ``lock_backoff_max``, ``lock_max_wait``,
    ``lock_give_up``. ``send_with_options(lease=lease)`` hands a lease
    acquired by the producer to the worker, which adopts it once. A message
    of an actor without ``lock_key`` that carries any of these is refused at
    send time. Every time is a whole number of milliseconds.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        client: Any = None,
        prefix: str = DEFAULT_PREFIX,
        ttl: int = DEFAULT_TTL,
        renew_interval: int | None = None,
        max_hold: int | None = None,
        backoff_min: int = DEFAULT_BACKOFF_MIN,
        backoff_max: int = DEFAULT_BACKOFF_MAX,
        max_wait: int | None = DEFAULT_MAX_WAIT,
        give_up: str = DEFAULT_GIVE_UP,
        metrics: LeaseMetrics | None = None,
        metrics_endpoint: bool = True,
    ) -> None:
        if (redis_url is None) == (client is None):
            raise LeaseConfigError("LeaseMiddleware needs exactly one of redis_url or client")
        if client is None:
            client = client_from_url(redis_url or "")
        else:
            _warn_without_socket_timeout(client)
        # Worker threads can be interrupted mid-command: each gets a connection of its own.
        self.leases = Leases(client, prefix=prefix, thread_connections=True)
        self.metrics = metrics if metrics is not None else PrometheusMetrics()
        self.heartbeat = Heartbeat(self.leases, metrics=self.metrics)
        self.defaults = {
            "lock_ttl": ttl,
            "lock_renew_interval": renew_interval,
            "lock_max_hold": max_hold,
            "lock_backoff_min": backoff_min,
            "lock_backoff_max": backoff_max,
            "lock_max_wait": max_wait,
            "lock_give_up": give_up,
        }
        self._options(None, {})  # validate the defaults now
        self._templates: dict[str, KeyTemplate] = {}
        self._fns: dict[str, Callable[..., Any]] = {}
        self._message_templates: dict[tuple[str, str], KeyTemplate] = {}
        self._actor_options: dict[str, Options] = {}
        # Worker thread id -> its message's run; None while a lease is being asked for (the actor must not run).
        self._runs: dict[int, Run | None] = {}
        # Token -> run of an async actor whose coroutine outlived the worker's wait: its lease is kept.
        self._deferred: dict[str, Run] = {}
        self._time_limit: float | None = None
        self._time_limit_interval = 0
        self._exposition = WorkerExposition(metrics_endpoint)
        self._booted = False
        self._host = socket.gethostname()
        logging.getLogger("dramatiq.worker.WorkerThread").addFilter(_skip_filter)

    @property
    def actor_options(self) -> set[str]:
        return set(ACTOR_OPTIONS)

    # Options -----------------------------------------------------------------

    def _options(self, actor: str | None, *sources: Mapping[str, Any]) -> Options:
        """Resolve options from the first source that has each (message, actor), then the defaults."""
        try:
            return resolve(f"actor {actor!r}" if actor else "LeaseMiddleware", self.defaults, *sources)
        except LeaseOptionError as e:
            e.actor = actor
            raise

    def _max_hold(self, opts: Options, message: Any, actor: Any) -> int | None:
        """``lock_max_hold``, else the time limit plus TimeLimit's check interval and a grace, so it fires first."""
        if opts.max_hold is not None:
            return opts.max_hold
        limit = message.options.get("time_limit") or actor.options.get("time_limit") or self._time_limit
        if limit is None or limit == math.inf:
            return None
        # Capped: a time limit near the largest accepted number must not make the lease refuse to be granted.
        return min(MAX_MS, math.ceil(limit) + self._time_limit_interval + TIME_LIMIT_GRACE)

    def _template(self, actor_name: str, options: Mapping[str, Any]) -> KeyTemplate | None:
        """The key template of a message: its own ``lock_key`` option, else its actor's."""
        template = self._templates.get(actor_name)
        spec = options.get("lock_key")
        if template is None or spec is None:
            return template
        cached = self._message_templates.get((actor_name, spec)) if isinstance(spec, str) else None
        if cached is None:
            owner = f"actor {actor_name!r}"
            if not isinstance(spec, str):
                raise LeaseOptionError(f"{owner}: a message's lock_key must be a template string, got {spec!r}",
                                       actor=actor_name)
            try:
                cached = KeyTemplate(spec, self._fns[actor_name], owner=owner)
            except LeaseConfigError as e:
                raise LeaseOptionError(str(e), actor=actor_name) from None
            self._message_templates[(actor_name, spec)] = cached
        return cached

    # Declaration and send ---------------------------------------------------

    def before_declare_actor(self, broker: dramatiq.Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        """Check the actor's lease options and prepare its key template; raises :class:`LeaseOptionError`."""
        name = f"actor {actor.actor_name!r}"
        spec = actor.options.get("lock_key")
        if spec is None:
            stray = sorted(ACTOR_OPTIONS & {k for k, v in actor.options.items() if v is not None})
            if stray:
                raise LeaseOptionError(f"{name}: {', '.join(stray)} given without lock_key", actor=actor.actor_name)
            return
        # Here too, not only at process boot: a Worker started in-process never emits process_boot.
        self._note_time_limit(broker)
        opts = self._options(actor.actor_name, actor.options)
        try:
            optional_ms(name, "time_limit", actor.options.get("time_limit"))
        except LeaseOptionError as e:
            e.actor = actor.actor_name
            raise
        self._actor_options[actor.actor_name] = opts
        try:
            self._templates[actor.actor_name] = KeyTemplate(spec, actor.fn, owner=name)
        except LeaseConfigError as e:
            raise LeaseOptionError(str(e), actor=actor.actor_name) from None
        self._fns[actor.actor_name] = actor.fn
        fn = actor.fn
        original = getattr(fn, "__wrapped__", None)
        if original is not None and inspect.iscoroutinefunction(original):
            # Dramatiq runs it on its event loop: track the coroutine itself, which can outlive the wait.
            fn = async_to_sync(self._coroutine_in_run(original))
        actor.fn = self._guarded(fn)
        if self._booted:
            self.metrics.declare({"actor": actor.actor_name, "queue": actor.queue_name})

    def _note_time_limit(self, broker: dramatiq.Broker) -> None:
        for m in broker.middleware:
            if isinstance(m, TimeLimit):
                self._time_limit = m.time_limit
                self._time_limit_interval = math.ceil(getattr(m.manager, "interval", 1.0) * 1000)

    @property
    def forks(self) -> list[Callable[[], int]]:
        """The metrics endpoint process, when this middleware serves its own."""
        return self._exposition.forks

    def after_process_boot(self, broker: dramatiq.Broker) -> None:
        """Set up metrics for this worker process and note TimeLimit's default."""
        self._note_time_limit(broker)
        self._exposition.boot(broker.middleware)
        self._booted = True
        for actor_name in self._templates:
            actor = broker.get_actor(actor_name)
            self.metrics.declare({"actor": actor_name, "queue": actor.queue_name})

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        """Start the heartbeat here, on a thread no asynchronous exception can reach."""
        self.heartbeat.start()

    def before_enqueue(self, broker: dramatiq.Broker, message: dramatiq.Message[Any], delay: int | None) -> None:
        """Refuse, at send time, a message whose options are invalid or whose key cannot be rendered."""
        options = message.options
        owner = f"actor {message.actor_name!r}"
        template = self._template(message.actor_name, options)
        if template is None:
            stray = sorted(k for k in LEASE_MESSAGE_OPTIONS if options.get(k) is not None)
            if stray and message.actor_name in broker.actors:
                raise LeaseOptionError(
                    f"{owner}: message option {stray[0]}={options[stray[0]]!r} needs an actor declared with "
                    "lock_key; without it the message would run with no lease", actor=message.actor_name
                )
            return
        if not ACTOR_OPTIONS.isdisjoint(options):
            self._options(message.actor_name, options, broker.get_actor(message.actor_name).options)
        if options.get("time_limit") is not None:  # the default lock_max_hold derives from it
            try:
                optional_ms(owner, "time_limit", options["time_limit"])
            except LeaseOptionError as e:
                e.actor = message.actor_name
                raise
        try:
            key = template.render(tuple(message.args), message.kwargs)
        except LeaseKeyError as e:
            raise LeaseKeyRenderError(str(e), actor=message.actor_name) from None
        handed = options.get(LEASE_OPTION)
        if isinstance(handed, Lease):
            if handed.key != key:
                raise LeaseKeyRenderError(
                    f"{owner}: the lease handed over is on {handed.key!r}, but this message's key is {key!r}",
                    key=key, actor=message.actor_name,
                )
            # Only what the worker needs to prove ownership travels with the message.
            options[LEASE_OPTION] = {"key": handed.key, "token": handed.token}

    # Processing -------------------------------------------------------------

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        """Acquire (or adopt) the message's lease, or send the message back and skip it."""
        thread_id = threading.get_ident()
        stale = self._runs.get(thread_id)
        if stale is not None:
            self._end(stale)  # a previous message's after-hooks never ran (interrupted): end its hold now
        try:
            template = self._template(message.actor_name, message.options)
        except LeaseOptionError as e:
            self._refuse(message, e)
        if template is None:
            self._runs.pop(thread_id, None)
            return
        # Until a lease is registered below, the guarded actor refuses to run in this thread:
        # Dramatiq swallows unexpected errors from this hook and would run the actor anyway.
        self._runs[thread_id] = None
        actor = broker.get_actor(message.actor_name)
        meta = {
            "actor": message.actor_name,
            "queue": message.queue_name,
            "message_id": message.message_id,
            "host": self._host,
            "pid": str(os.getpid()),
        }
        try:
            if ACTOR_OPTIONS.isdisjoint(message.options):
                opts = self._actor_options[message.actor_name]
            else:
                opts = self._options(message.actor_name, message.options, actor.options)
            key = template.render(tuple(message.args), message.kwargs)
        except (LeaseConfigError, LeaseKeyError) as e:
            self._refuse(message, e)

        # Registered before Redis is asked: if anything interrupts us from here on, the
        # after-hooks release by this token (an owner-checked no-op if nothing was granted).
        run = Run(key, new_token(), thread_id)
        self._runs[thread_id] = run
        started = time.monotonic()
        try:
            result = self._acquire(run, key, opts, self._max_hold(opts, message, actor), meta, message.options)
        except Exception as e:
            # Fail closed: no lease, no run.
            self.metrics.acquire(meta, "error", time.monotonic() - started)
            self.metrics.redis_error("acquire")
            logger.warning("Could not acquire lease %r for message %s: %s. Retrying later.", key, message.message_id, e)
            self._send_back(broker, message, opts, count_attempt=False)
            raise SkipMessage(f"lease {key!r} unavailable: {e}") from None

        if isinstance(result, Busy):
            self._runs[thread_id] = None  # nothing was granted: nothing to release
            self.metrics.acquire(meta, "busy", time.monotonic() - started)
            self._on_busy(broker, message, opts, result, meta)
            raise SkipMessage(f"lease {key!r} is busy")

        run.lease = result
        _current.set(result)
        self.heartbeat.track(result, run.lost)
        self.metrics.acquire(meta, "acquired", time.monotonic() - started)
        # The wait clock belongs to this delivery: a retry of it (Retries) starts a new one.
        first = message.options.pop(FIRST_ATTEMPT_OPTION, None)
        message.options.pop(ATTEMPTS_OPTION, None)
        self.metrics.wait(meta, max(0.0, result.acquired_at - first / 1000) if first else 0.0)
        logger.debug("Acquired lease %r (fence %d) for message %s.", key, result.fence, message.message_id)

    def _refuse(self, message: Any, error: Exception) -> NoReturn:
        # Only reachable when the producer had no LeaseMiddleware to refuse it at send time.
        logger.error("Message %s cannot run: %s. Moving it to the dead-letter queue.", message.message_id, error)
        message.fail()
        raise SkipMessage(str(error)) from None

    def _acquire(self, run: Run, key: str, opts: Options, max_hold: int | None, meta: dict[str, str],
                 options: Mapping[str, Any]) -> Lease | Busy:
        handed = options.get(LEASE_OPTION)
        if isinstance(handed, dict) and handed.get("key") == key and handed.get("token"):
            adopted = self.leases.adopt(key, handed["token"], opts.ttl, interval=opts.renew_interval,
                                        max_hold=max_hold, meta=meta, new_token=run.token)
            if adopted is not None:
                return adopted
            logger.info("Lease %r handed over with the message has ended; acquiring anew.", key)
        return self.leases.try_acquire(key, opts.ttl, interval=opts.renew_interval, max_hold=max_hold, meta=meta,
                                       token=run.token)

    def _on_busy(self, broker: dramatiq.Broker, message: Any, opts: Options, busy: Busy, meta: dict[str, str]) -> None:
        # The Redis server's clock, so workers with skewed clocks agree on how long a message waited.
        now_ms = busy.now_ms or int(time.time() * 1000)
        first = message.options.get(FIRST_ATTEMPT_OPTION) or now_ms
        waited = now_ms - first
        attempts = int(message.options.get(ATTEMPTS_OPTION, 0)) + 1
        if opts.max_wait is not None and waited >= opts.max_wait:
            self.metrics.gave_up(meta)
            logger.error(
                "Gave up on message %s of actor %r: lease %r stayed busy for %d attempts over %.1fs "
                "(lock_max_wait=%d ms); %s.",
                message.message_id, message.actor_name, busy.key, attempts, waited / 1000, opts.max_wait,
                "moving it to the dead-letter queue" if opts.give_up == "fail" else "dropping it",
            )
            if opts.give_up == "fail":
                message.fail()
                raise LeaseWaitExceeded(
                    f"lease {busy.key!r} stayed busy for {attempts} attempts over {waited / 1000:.1f}s",
                    key=busy.key, actor=message.actor_name,
                )
            self._mark_skipped(message)
            return
        self.metrics.busy_retry(meta)
        logger.debug("Lease %r is busy (%d ms left); message %s goes back to the queue (attempt %d).",
                     busy.key, busy.ttl_left, message.message_id, attempts)
        self._send_back(broker, message, opts, count_attempt=True, first_ms=first, now_ms=now_ms,
                        holder_ttl=busy.ttl_left)

    def _send_back(
        self,
        broker: dramatiq.Broker,
        message: Any,
        opts: Options,
        *,
        count_attempt: bool,
        first_ms: int | None = None,
        now_ms: int = 0,
        holder_ttl: int = -1,
    ) -> None:
        """Re-enqueue the same message (same id) after a backoff with full jitter."""
        attempts = int(message.options.get(ATTEMPTS_OPTION, 0))
        delay = backoff_delay(attempts, opts.backoff_min, opts.backoff_max, holder_ttl)
        options: dict[str, Any] = {ATTEMPTS_OPTION: attempts + 1 if count_attempt else attempts}
        if first_ms is not None:
            options[FIRST_ATTEMPT_OPTION] = first_ms
            if opts.max_wait is not None:
                # Land the last retry at the end of the budget rather than past it.
                delay = max(1, min(delay, first_ms + opts.max_wait - now_ms))
        try:
            broker.enqueue(message.copy(options=options), delay=delay)
        except Exception:
            logger.exception("Could not send message %s back to the queue; failing it instead.", message.message_id)
            message.fail()
            return
        self._mark_skipped(message)

    @staticmethod
    def _mark_skipped(message: Any) -> None:
        # This delivery is skipped, not finished: Results must not store None for it.
        message.options["store_results"] = False
        message.options[_SKIP_MARK] = True

    def _guarded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap an actor's function so it runs only under its message's lease, released the moment it returns."""
        runs = self._runs
        end = self._end

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            run = runs.get(threading.get_ident(), _DIRECT)
            if run is _DIRECT:
                return fn(*args, **kwargs)  # called directly, not by a worker
            if run is None:
                raise LeaseLost("the actor was about to run without its lease; refusing (see the log)")
            assert isinstance(run, Run)
            if run.state is not READY:
                return fn(*args, **kwargs)  # a direct call from inside the running actor
            return call_under(run, fn, args, kwargs, end)

        return guarded

    def _coroutine_in_run(self, async_fn: Callable[..., Any]) -> Callable[..., Any]:
        runs = self._runs
        end = self._end

        @functools.wraps(async_fn)
        def start(*args: Any, **kwargs: Any) -> Any:
            run = runs.get(threading.get_ident())
            coro = async_fn(*args, **kwargs)
            return coroutine_under(run, coro, end) if isinstance(run, Run) else coro

        return start

    def _end(self, run: Run) -> None:
        """Stop renewing and release the lease. Idempotent, and never raises but for an interruption.

        Nothing after a completed actor may turn it into a failure: any error
        here is logged, and the lease then ends by its TTL. While an async
        actor's coroutine still runs (it ignored cancellation), the lease is
        kept, renewed, and ended when the coroutine ends.
        """
        with run.lock:
            if run.coroutine_running:
                run.end_deferred = True
                self._deferred[run.token] = run
                return
        self._deferred.pop(run.token, None)
        lease = run.lease
        if lease is not None:
            self.heartbeat.untrack(lease)
        if run.released:
            return
        first_try = not run.release_tried
        run.release_tried = True
        try:
            released = self.leases.release_token(run.key, run.token, fence=lease.fence if lease else None)
        except Exception as e:
            run.released = True
            self.metrics.redis_error("release")
            logger.warning("Could not release lease %r: %s: %s. It expires within its TTL.", run.key,
                           type(e).__name__, e)
            return
        run.released = True
        if not released and first_try and lease is not None and run.lost_reason is None:
            logger.warning("Lease %r (fence %d) was no longer held at release.", run.key, lease.fence)

    def _forget(self, message: Any) -> None:
        run = self._runs.pop(threading.get_ident(), None)
        if run is not None:
            run.finish()
            self._end(run)
        _current.set(None)

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        """Release the lease if the actor did not (a middleware failed before it ran)."""
        self._forget(message)

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        """Release the lease of a message skipped after it was acquired."""
        self._forget(message)

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        """Release every lease this process holds for an actor no longer running.

        An actor still running (or about to) after the worker's shutdown timeout keeps its
        lease, renewed, until the process exits; it then expires within its
        TTL. Releasing it would let another worker run the same key while
        this one still does.
        """
        # Not only running actors: one still being set up (its lease taken, its actor about to start) too.
        running = {r.token: r for r in list(self._runs.values()) if r is not None and r.state != DONE}
        running.update(self._deferred)
        for lease in self.heartbeat.tracked():
            if lease.token in running:
                logger.warning("Actor holding lease %r is still running at shutdown; the lease is kept until "
                               "this process exits, then expires within %d ms.", lease.key, lease.ttl)
                continue
            self.heartbeat.untrack(lease)
            try:
                self.leases.release(lease)
            except Exception as e:
                logger.warning("Could not release lease %r at shutdown: %s.", lease.key, e)
        if not running:
            self.heartbeat.stop()
        self._exposition.shutdown()


def _warn_without_socket_timeout(client: Any) -> None:
    """A renewal hanging on a socket without timeout cannot confirm a lease; say so at construction."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if isinstance(kwargs, dict) and kwargs.get("socket_timeout") is None:
        logger.warning("The Redis client given to LeaseMiddleware has no socket_timeout: a renewal that hangs "
                       "is abandoned by the watchdog, but give it one shorter than your TTLs.")
