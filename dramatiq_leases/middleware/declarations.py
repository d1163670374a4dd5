"""What actors declare and messages carry: key templates and lease options, checked at declaration and send."""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Mapping
from typing import Any

import dramatiq
from dramatiq.middleware.time_limit import TimeLimit

from ..core.errors import LeaseConfigError, LeaseKeyError
from ..core.keys import MAX_KEY_LENGTH, KeyTemplate
from ..core.lease import Lease
from ..core.scripts import MAX_MS
from .errors import LeaseKeyRenderError, LeaseLimitError, LeaseOptionError
from .options import (
    ACTOR_OPTIONS,
    LEASE_MESSAGE_OPTIONS,
    LEASE_OPTION,
    TIME_LIMIT_GRACE,
    Options,
    check_limit,
    optional_ms,
    resolve,
)

#: How many distinct message-level ``lock_key`` templates are kept prepared (then the cache starts again):
#: a producer sending one template per invoice must not grow a worker without bound.
MESSAGE_TEMPLATE_CACHE = 256


def check_message_template(spec: object, actor: str) -> str:
    """``spec`` if a message may carry it as ``lock_key``, else :class:`LeaseOptionError`.

    A message is input from whoever can write to the broker, so its template is checked before any
    work, and may hold only literal text and plain ``{parameter}`` fields: no format spec
    (``{x:>300000000}`` would allocate gigabytes), no conversion, no attribute or index access
    (``{x.__class__}`` walks objects). Rendering it then costs about the size of the arguments.
    """
    owner = f"actor {actor!r}"
    if not isinstance(spec, str):
        raise LeaseOptionError(f"{owner}: a message's lock_key must be a template string, got {spec!r}", actor=actor)
    if len(spec) > MAX_KEY_LENGTH:
        raise LeaseOptionError(
            f"{owner}: a message's lock_key is {len(spec)} characters long; the limit is "
            f"{MAX_KEY_LENGTH}: {spec[:64]!r}...",
            actor=actor,
        )
    try:
        fields = [
            (name, conversion, fmt) for _, name, fmt, conversion in string.Formatter().parse(spec) if name is not None
        ]
    except ValueError as e:
        raise LeaseOptionError(
            f"{owner}: a message's lock_key {spec!r} is not a valid template: {e}", actor=actor
        ) from None
    for name, conversion, fmt in fields:
        if conversion is not None or fmt or not name.isidentifier():
            raise LeaseOptionError(
                f"{owner}: a message's lock_key {spec!r} may only use plain {{parameter}} fields, got "
                f"{{{name}{'!' + conversion if conversion else ''}{':' + fmt if fmt else ''}}} (format specs, "
                "conversions and attribute or index access are for the actor's own lock_key)",
                actor=actor,
            )
    return spec


class Declarations:
    """The leased actors of one middleware: their templates and resolved options.

    Parameters:
      defaults: the middleware's default of each actor option (``lock_ttl``, ...).
    """

    def __init__(self, defaults: Mapping[str, Any]) -> None:
        self.defaults = dict(defaults)
        self._templates: dict[str, KeyTemplate] = {}
        self._fns: dict[str, Callable[..., Any]] = {}
        self._message_templates: dict[tuple[str, str], KeyTemplate] = {}
        self._actor_options: dict[str, Options] = {}
        self._time_limit: float | None = None
        self._time_limit_interval = 0
        self.options(None)  # check the defaults now

    @property
    def actors(self) -> list[str]:
        """The names of the actors declared with ``lock_key``."""
        return list(self._templates)

    def options(self, actor: str | None, *sources: Mapping[str, Any]) -> Options:
        """Each option from the first source that has it (message, actor), else the default; all checked."""
        try:
            return resolve(f"actor {actor!r}" if actor else "LeaseMiddleware", self.defaults, *sources)
        except LeaseOptionError as e:
            e.actor = actor
            raise

    def message_options(self, message: Any, actor: dramatiq.Actor[Any, Any]) -> Options:
        """The options of ``message``: its actor's, resolved once, unless the message overrides some."""
        if ACTOR_OPTIONS.isdisjoint(message.options):
            return self._actor_options[message.actor_name]
        return self.options(message.actor_name, message.options, actor.options)

    def limit(self, opts: Options, message: Any) -> int:
        """The message's ``lock_limit``: the option's int, or what the actor's callable returns for its arguments.

        Raises:
          LeaseLimitError: the callable raised (its exception is the cause): a passing failure, retried.
          LeaseOptionError: the callable returned anything but an int from 1 to 1 000: a bad setting.
        """
        value = opts.limit
        if not callable(value):
            return value
        owner = f"actor {message.actor_name!r}"
        try:
            result = value(*message.args, **message.kwargs)
        except Exception as e:
            raise LeaseLimitError(
                f"{owner}: lock_limit {value!r} raised {type(e).__name__}: {e} for args={tuple(message.args)!r} "
                f"kwargs={message.kwargs!r}",
                limit=value,
                actor=message.actor_name,
            ) from e
        try:
            return check_limit(owner, result, returned_by=value)
        except LeaseOptionError as e:
            e.actor = message.actor_name
            raise

    def send_limit(self, opts: Options, message: Any) -> int:
        """:meth:`limit` at send time, where any failure refuses the send: :class:`LeaseOptionError`."""
        try:
            return self.limit(opts, message)
        except LeaseLimitError as e:
            raise LeaseOptionError(str(e), actor=message.actor_name) from None

    def time_limit(self, message: Any, actor: Any) -> float | None:
        """The message's time limit in ms (message option, actor option, TimeLimit's default), if any."""
        limit = message.options.get("time_limit") or actor.options.get("time_limit") or self._time_limit
        return None if limit is None or limit == math.inf else float(limit)

    def max_hold(self, opts: Options, message: Any, actor: Any) -> int | None:
        """``lock_max_hold``, else the time limit plus TimeLimit's check interval and a grace, so it fires first."""
        if opts.max_hold is not None:
            return opts.max_hold
        limit = self.time_limit(message, actor)
        if limit is None:
            return None
        # Capped: a time limit near the largest accepted number must not make the lease refuse to be granted.
        return min(MAX_MS, math.ceil(limit) + self._time_limit_interval + TIME_LIMIT_GRACE)

    def note_time_limit(self, broker: dramatiq.Broker) -> None:
        """Read TimeLimit's default limit and check interval, from which ``lock_max_hold`` defaults."""
        for m in broker.middleware:
            if isinstance(m, TimeLimit):
                self._time_limit = m.time_limit
                self._time_limit_interval = math.ceil(getattr(m.manager, "interval", 1.0) * 1000)

    def template(self, actor_name: str, options: Mapping[str, Any]) -> KeyTemplate | None:
        """The key template of a message: its own ``lock_key`` option, else its actor's; ``None`` if not leased."""
        template = self._templates.get(actor_name)
        spec = options.get("lock_key")
        if template is None or spec is None:
            return template
        cached = self._message_templates.get((actor_name, spec)) if isinstance(spec, str) else None
        if cached is None:
            check_message_template(spec, actor_name)
            try:
                cached = KeyTemplate(spec, self._fns[actor_name], owner=f"actor {actor_name!r}")
            except LeaseConfigError as e:
                raise LeaseOptionError(str(e), actor=actor_name) from None
            if len(self._message_templates) >= MESSAGE_TEMPLATE_CACHE:
                self._message_templates.clear()
            self._message_templates[(actor_name, spec)] = cached
        return cached

    def declare(self, broker: dramatiq.Broker, actor: dramatiq.Actor[Any, Any]) -> bool:
        """Check ``actor``'s lease options and prepare its key template; ``False`` if it has no ``lock_key``.

        Raises:
          LeaseOptionError: naming the actor, the option and the value.
        """
        name = f"actor {actor.actor_name!r}"
        spec = actor.options.get("lock_key")
        if spec is None:
            stray = sorted(ACTOR_OPTIONS & {k for k, v in actor.options.items() if v is not None})
            if stray:
                raise LeaseOptionError(f"{name}: {', '.join(stray)} given without lock_key", actor=actor.actor_name)
            return False
        # Here too, not only at process boot: a Worker started in-process never emits process_boot.
        self.note_time_limit(broker)
        opts = self.options(actor.actor_name, actor.options)
        self._check_time_limit(actor.actor_name, actor.options)
        try:
            template = KeyTemplate(spec, actor.fn, owner=name)
        except LeaseConfigError as e:
            raise LeaseOptionError(str(e), actor=actor.actor_name) from None
        self._actor_options[actor.actor_name] = opts
        self._templates[actor.actor_name] = template
        self._fns[actor.actor_name] = actor.fn
        return True

    def check_message(self, broker: dramatiq.Broker, message: dramatiq.Message[Any], *, resent: bool = False) -> None:
        """Refuse, at send time, a message whose options are invalid or whose key cannot be rendered.

        A lease handed over with the message (``lease=``) is reduced to what
        the worker needs to prove ownership. ``resent``: the message was sent before (a retry, a copy sent
        back or parked, a delayed message moving to its queue): its actor's ``lock_limit`` callable is not
        asked, since its answer may have changed since the send (a tier service briefly down); refused
        here, the message would be lost. Each delivery asks it, and fails or refuses it there.
        """
        options = message.options
        owner = f"actor {message.actor_name!r}"
        template = self.template(message.actor_name, options)
        if template is None:
            stray = sorted(k for k in LEASE_MESSAGE_OPTIONS if options.get(k) is not None)
            if stray and message.actor_name in broker.actors:
                raise LeaseOptionError(
                    f"{owner}: message option {stray[0]}={options[stray[0]]!r} needs an actor declared with "
                    "lock_key; without it the message would run with no lease",
                    actor=message.actor_name,
                )
            return
        if callable(options.get("lock_limit")):
            raise LeaseOptionError(
                f"{owner}: a message's lock_limit must be an int (a message crosses the broker as JSON), got "
                f"{options['lock_limit']!r}; a callable is for the actor's own lock_limit",
                actor=message.actor_name,
            )
        actor = broker.get_actor(message.actor_name)
        opts = self.message_options(message, actor)
        if not resent:
            self.send_limit(opts, message)  # a callable's answer for these arguments, checked now
        self._check_time_limit(message.actor_name, options)  # the default lock_max_hold derives from it
        try:
            key = template.render(tuple(message.args), message.kwargs)
        except LeaseKeyError as e:
            raise LeaseKeyRenderError(str(e), actor=message.actor_name) from None
        handed = options.get(LEASE_OPTION)
        if handed is not None and opts.on_busy == "latest":
            raise LeaseOptionError(latest_handoff(message.actor_name), actor=message.actor_name)
        if isinstance(handed, Lease):
            if handed.key != key:
                raise LeaseKeyRenderError(
                    f"{owner}: the lease handed over is on {handed.key!r}, but this message's key is {key!r}",
                    key=key,
                    actor=message.actor_name,
                )
            options[LEASE_OPTION] = {"key": handed.key, "token": handed.token}
            if handed.slot:  # a key several may hold at once: the holder slot it was granted
                options[LEASE_OPTION]["slot"] = handed.slot

    @staticmethod
    def _check_time_limit(actor: str, options: Mapping[str, Any]) -> None:
        try:
            optional_ms(f"actor {actor!r}", "time_limit", options.get("time_limit"))
        except LeaseOptionError as e:
            e.actor = actor
            raise


def latest_handoff(actor: str) -> str:
    """Why a message of a ``lock_on_busy="latest"`` actor cannot carry a lease handed over (``lease=``)."""
    return (
        f"actor {actor!r}: message option lease= cannot go with lock_on_busy='latest': a lease handed over is "
        "adopted without the key's send order, so a message sent before it could run after it"
    )
