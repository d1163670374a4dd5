"""Lease keys: validation, Redis key names and key templates.

A lease key is a non-empty string chosen by the user, such as
``"invoice:42"``. A :class:`KeyTemplate` builds one from a function's
arguments, either from a ``str.format`` template (``"invoice:{invoice_id}"``)
or from a callable taking the same arguments as the function.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import inspect
import string
from collections.abc import Callable, Mapping
from importlib.resources import files
from typing import Any

from .errors import LeaseConfigError, LeaseKeyError

#: The default prefix of every Redis key this package writes.
DEFAULT_PREFIX = "dramatiq-leases"

#: The longest lease key accepted, in characters.
MAX_KEY_LENGTH = 1024


def validate_key(key: object, *, what: str = "lease key") -> str:
    """Return ``key`` if it is a usable lease key, else raise :class:`LeaseKeyError`."""
    if not isinstance(key, str) or not key:
        raise LeaseKeyError(f"{what} must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise LeaseKeyError(f"{what} is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}: {key[:64]!r}...")
    return key


#: The kinds of Redis key a lease key has, named ``{prefix}:{kind}:{tag}`` (see :func:`lease_name` and its siblings).
KEY_KINDS = ("lease", "fence", "line", "waiters", "done", "history", "epoch", "rate", "debounce")

_GLOB = "glob characters in the SCAN patterns that `list` and the exporter build from the prefix would match other keys"

#: Characters a prefix may not hold, and why: the prefix is matched literally in ``SCAN`` patterns only if it
#: holds none of Redis's glob characters (backslash is the glob escape), and braces would end the hash tag.
_FORBIDDEN_IN_PREFIX = {
    "{": "braces would end the Redis Cluster hash tag early",
    "}": "braces would end the Redis Cluster hash tag early",
    "*": _GLOB,
    "?": _GLOB,
    "[": _GLOB,
    "]": _GLOB,
    "\\": "a backslash escapes the next character in the SCAN patterns that `list` and the exporter build from "
    "the prefix, which would then miss the prefix's leases",
}


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a usable key prefix, else raise :class:`LeaseConfigError`.

    A prefix is a non-empty string without braces or glob characters (``* ? [ ] \\``), so that every
    ``SCAN`` pattern built from it matches it literally, and with no segment after its first colon that is
    one of :data:`KEY_KINDS` (``app:line``, ``app:lease:eu``; equivalently: ``:line:`` is not in
    ``prefix + ":"``): the readers find a lease's sibling keys by the first ``:line:`` of a name
    (``{prefix}:line:{tag}`` to ``{prefix}:waiters:{tag}``), and another prefix's ``SCAN`` (``app`` scanning
    ``app:lease:*``) would take such a prefix's keys for its own.
    """
    if not isinstance(prefix, str) or not prefix:
        raise LeaseConfigError(f"prefix must be a non-empty string, got {prefix!r}")
    for char, why in _FORBIDDEN_IN_PREFIX.items():
        if char in prefix:
            raise LeaseConfigError(
                f"prefix must be without braces, glob characters or backslashes: {prefix!r} holds {char!r}; {why}"
            )
    for kind in KEY_KINDS:
        # "{prefix}:" is how every name starts: a ":kind:" in it comes before the name's own kind.
        if f":{kind}:" in prefix + ":":
            raise LeaseConfigError(
                f"prefix must not contain ':{kind}:' nor end with ':{kind}': in {prefix!r} it would be taken "
                f"for the kind of key that follows the prefix in each Redis key name ({{prefix}}:{kind}:{{...}}), "
                "so sibling keys would be derived wrongly and other prefixes' scans would take its keys for theirs"
            )
    return prefix


def hash_tag(key: str) -> str:
    """The Redis Cluster hash tag shared by all Redis keys of one lease key.

    The key itself where that is safe, so ``redis-cli`` shows readable names;
    a digest when the key contains braces, which would end the tag early.
    """
    if "{" in key or "}" in key:
        return "h:" + hashlib.sha1(key.encode()).hexdigest()
    return key


def lease_name(prefix: str, key: str, slot: int = 0) -> str:
    """The Redis key of the hash holding the lease on ``key`` in holder ``slot`` (0 to ``scripts.MAX_LIMIT - 1``).

    Slot 0 is ``{prefix}:lease:{tag}`` (a key of one holder has only it); slot ``s`` of a key held by several
    at once (``lock_limit``) is ``{prefix}:lease:{tag}:s``, in the same hash slot.
    """
    if slot:
        return f"{prefix}:lease:{{{hash_tag(key)}}}:{slot}"
    return f"{prefix}:lease:{{{hash_tag(key)}}}"


def slot_of(redis_key: str) -> int:
    """The holder slot of a lease hash's Redis key (0 for ``{prefix}:lease:{tag}``; see :func:`lease_name`)."""
    tail = redis_key.rpartition("}")[2]
    return int(tail[1:]) if tail.startswith(":") and tail[1:].isdigit() else 0


def fence_name(prefix: str, key: str) -> str:
    """The Redis key of the fencing counter of ``key``; kept for ever unless a ``fence_retention`` expires it."""
    return f"{prefix}:fence:{{{hash_tag(key)}}}"


def line_name(prefix: str, key: str) -> str:
    """The Redis key of the line of waiters for ``key`` (a sorted set by first attempt)."""
    return f"{prefix}:line:{{{hash_tag(key)}}}"


def waiters_name(prefix: str, key: str) -> str:
    """The Redis key of the entries of ``key``'s waiters (a hash by waiter id; see :mod:`.line`)."""
    return f"{prefix}:waiters:{{{hash_tag(key)}}}"


def slot_names(prefix: str, key: str, width: int) -> list[str]:
    """The Redis keys of ``key``'s holder slots 1 to ``width - 1`` (see :func:`lease_name`): what a script that
    reads a key's holders is given besides its slot 0."""
    return [lease_name(prefix, key, s) for s in range(1, width)]


def done_name(prefix: str, key: str) -> str:
    """The Redis key of the waiters of ``key`` that ran (a sorted set by expiry; see :mod:`.line`)."""
    return f"{prefix}:done:{{{hash_tag(key)}}}"


#: For each Redis Cluster slot, a hash tag in it (``tools/slot_tags.py`` wrote them). Read at import, not at the
#: first grant: a worker thread reading it would look its codec up, an import, and an exception Dramatiq raises
#: into the thread there (TimeLimit, Shutdown) strands the import's module lock: every thread then hangs on it.
_SLOT_TAGS = tuple(files(__package__).joinpath("slot_tags.txt").read_bytes().decode("ascii").split())


def epoch_name(prefix: str, key: str) -> str:
    """The Redis key of the epoch record of the Cluster slot ``key`` is in (the failover grace, in
    ``lua/acquire.lua``): one record per slot, named with that slot's tag, so a script on the key declares it."""
    slot = binascii.crc_hqx(hash_tag(key).encode(), 0) % 16_384  # Redis Cluster's CRC16 (XMODEM) of the tag
    return f"{prefix}:epoch:{{{_SLOT_TAGS[slot]}}}"


@functools.lru_cache(maxsize=1024)
def script_names(prefix: str, key: str) -> tuple[str, str, str, str, str]:
    """The lease (slot 0), fence, line, done and epoch names of ``key``: the grant's ``KEYS`` (the release's are
    the first four), built once for the last 1 024 keys (per-invoice keys must not grow it without bound)."""
    return (
        lease_name(prefix, key),
        fence_name(prefix, key),
        line_name(prefix, key),
        done_name(prefix, key),
        epoch_name(prefix, key),
    )


@functools.lru_cache(maxsize=1024)
def line_names(prefix: str, key: str) -> tuple[str, str, str, str]:
    """The order, waiters, unique and history names of ``key``: what the general scripts are given besides
    :func:`script_names`, built once for the last 1 024 keys."""
    return order_name(prefix, key), waiters_name(prefix, key), unique_name(prefix, key), history_name(prefix, key)


def unique_name(prefix: str, key: str) -> str:
    """The Redis key of ``key``'s unique records (``lock_unique``: a sorted set of message ids by end time)."""
    return f"{prefix}:unique:{{{hash_tag(key)}}}"


def order_name(prefix: str, key: str) -> str:
    """The Redis key of ``key``'s order record (``lock_on_busy="latest"``: a hash; see :mod:`.scripts`)."""
    return f"{prefix}:order:{{{hash_tag(key)}}}"


def debounce_name(prefix: str, key: str) -> str:
    """The Redis key of ``key``'s debounce record (``lock_debounce``: a hash; see :mod:`.debounce`)."""
    return f"{prefix}:debounce:{{{hash_tag(key)}}}"


def history_name(prefix: str, key: str) -> str:
    """The Redis key of ``key``'s history (a list of JSON events, newest first; see :mod:`.history`)."""
    return f"{prefix}:history:{{{hash_tag(key)}}}"


def rate_name(prefix: str, key: str, count: int, window: int) -> str:
    """The Redis key of the ring of ``key``'s rate of ``count`` grants per ``window`` ms (see :mod:`.rates`)."""
    return f"{prefix}:rate:{{{hash_tag(key)}}}:{count}/{window}"


def wake_name(prefix: str, key: str, waiter: str) -> str:
    """The Redis list a waiter waiting in place blocks on (``lua/wake.lua`` pushes on it)."""
    return f"{line_name(prefix, key)}:w:{waiter}"


def line_pattern(prefix: str) -> str:
    """A ``SCAN MATCH`` pattern for every line (and the wake lists, whose names end with a waiter id).

    The prefix is matched literally: :func:`validate_prefix` refused glob characters and backslashes.
    """
    return f"{prefix}:line:{{*}}"


def lease_pattern(prefix: str, match: str = "*") -> str:
    """A ``SCAN MATCH`` pattern for lease hashes whose tag matches the glob ``match`` (the prefix, literally)."""
    return f"{prefix}:lease:{{{match}}}"


class KeyTemplate:
    """Renders lease keys from the arguments of a function.

    Parameters:
      spec: a ``str.format`` template whose fields name parameters of ``fn``
        (``"invoice:{invoice_id}"``, ``"user:{user.id}"``), or a callable
        taking the same arguments as ``fn`` and returning the key.
      fn: the function whose arguments fill the template.
      owner: who declared the template, for error messages (an actor name).

    Raises:
      LeaseConfigError: if ``spec`` is neither, is an empty template, or names
        a parameter that ``fn`` does not have.
    """

    def __init__(self, spec: str | Callable[..., str], fn: Callable[..., Any], *, owner: str) -> None:
        self.spec = spec
        self.owner = owner
        self.signature = inspect.signature(fn)
        params = list(self.signature.parameters.values())
        # Names that positional arguments bind to, when binding is that simple (no *args).
        self._positional: list[str] | None = (
            None
            if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
            else [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        )
        self._fields: set[str] = set()
        # A template of plain {name} fields only, as (literal, field) pairs: rendered by _fill.
        self._parts: list[tuple[str, str | None]] | None = None
        if isinstance(spec, str):
            self._check_template(spec)
        elif not callable(spec):
            raise LeaseConfigError(f"{owner}: lock_key must be a template string or a callable, got {spec!r}")

    def _check_template(self, spec: str) -> None:
        if not spec:
            raise LeaseConfigError(f"{self.owner}: lock_key must be a non-empty string, got {spec!r}")
        try:
            parsed = list(string.Formatter().parse(spec))
        except ValueError as e:
            raise LeaseConfigError(f"{self.owner}: lock_key {spec!r} is not a valid template: {e}") from None
        fields = [name for _, name, _, _ in parsed if name is not None]
        if all(name is None or (name.isidentifier() and not fmt and conv is None) for _, name, fmt, conv in parsed):
            self._parts = [(literal, name) for literal, name, _, _ in parsed]
        params = self.signature.parameters
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for field in fields:
            # "{user.id}" and "{items[0]}" name the parameter before the first "." or "[".
            name = field.split(".", 1)[0].split("[", 1)[0]
            if not name or name.isdigit():
                raise LeaseConfigError(
                    f"{self.owner}: lock_key {spec!r} must name parameters, not positions ({{{field}}})"
                )
            positional_only = name in params and params[name].kind is inspect.Parameter.POSITIONAL_ONLY
            if (name not in params and not takes_kwargs) or positional_only:
                raise LeaseConfigError(
                    f"{self.owner}: lock_key {spec!r} names parameter {name!r}, "
                    f"which is not among its parameters {list(params)}"
                )
            self._fields.add(name)

    def render(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """Return the lease key for these arguments.

        Raises:
          LeaseKeyError: if the arguments do not fit the function, lack a
            field of the template, or render to something that is not a
            valid key.
        """
        if isinstance(self.spec, str) and self._positional is not None and len(args) <= len(self._positional):
            # Fast path for the common call: every field given by name or position.
            values = dict(zip(self._positional, args))
            values.update(kwargs)
            if self._fields <= values.keys():
                try:
                    key = self._fill(values) if self._parts is not None else self.spec.format_map(values)
                except (AttributeError, LookupError, TypeError, ValueError):
                    pass  # let the slow path below report it
                else:
                    return validate_key(key, what=f"{self.owner}: the key rendered by lock_key {self.spec!r}")
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise LeaseKeyError(
                f"{self.owner}: cannot render lock_key from args={args!r} kwargs={kwargs!r}: {e}"
            ) from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        for p in self.signature.parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                values.update(values.pop(p.name, {}))
        try:
            if self._parts is not None:
                key = self._fill(values)
            elif isinstance(self.spec, str):
                key = self.spec.format_map(values)
            else:
                key = self.spec(*args, **kwargs)
        except LeaseKeyError:
            raise
        except Exception as e:
            raise LeaseKeyError(
                f"{self.owner}: cannot render lock_key {self.spec!r} from args={args!r} kwargs={kwargs!r}: "
                f"{type(e).__name__}: {e}"
            ) from None
        return validate_key(key, what=f"{self.owner}: the key rendered by lock_key {self.spec!r}")

    def _fill(self, values: Mapping[str, Any]) -> str:
        """Render a template of plain fields, refusing a key over :data:`MAX_KEY_LENGTH` before building it: a
        field repeated over a large argument (a message's template, ``"{n}{n}..."``) costs that argument once."""
        assert self._parts is not None
        rendered: dict[str, str] = {}
        pieces: list[str] = []
        length = 0
        for literal, name in self._parts:
            pieces.append(literal)
            length += len(literal)
            if name is not None:
                text = rendered.get(name)
                if text is None:
                    text = rendered[name] = format(values[name])
                pieces.append(text)
                length += len(text)
            if length > MAX_KEY_LENGTH:
                raise LeaseKeyError(
                    f"{self.owner}: the key rendered by lock_key {self.spec!r} is over "
                    f"{MAX_KEY_LENGTH} characters long; the limit is {MAX_KEY_LENGTH}"
                )
        return "".join(pieces)
