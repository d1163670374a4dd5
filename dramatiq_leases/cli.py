"""The ``dramatiq-leases`` command: inspect and release leases, run the exporter or the demo.

Commands::

  dramatiq-leases list [--match GLOB] [--json]        (alias: ls)
  dramatiq-leases show KEY [--json] [--show-token]
  dramatiq-leases release KEY (--owner TOKEN | --if-dead)
  dramatiq-leases exporter [--host HOST] [--port PORT] [--interval SECONDS]
  dramatiq-leases demo [--invoices N] [--per-invoice N] [--job-seconds S]

Global flags, accepted before or after the command: ``--redis-url`` (default:
``$REDIS_URL``, else ``redis://127.0.0.1:6379/0``; ``demo`` ignores both and
starts a private Redis unless ``--redis-url`` is given) and ``--prefix``
(default ``dramatiq-leases``).

Exit codes (an API: scripts rely on them):

* 0: success.
* 1: refused: ``release`` changed nothing because another owner holds the
  lease, or (``--if-dead``) its holder may still believe it holds it; or the
  demo's checks failed.
* 2: usage error (bad or missing arguments).
* 3: not found: there is no lease on KEY.
* 4: Redis unreachable or failing; one line on stderr names the URL.
* 130: interrupted (Ctrl-C); 143: the demo was stopped by SIGTERM (after cleaning up).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, TextIO

import redis

from .core import DeadRelease, LeaseInfo, Leases, State, stale_after
from .core.errors import LeaseError, LeaseUnavailableError
from .core.keys import DEFAULT_PREFIX, validate_key, validate_prefix
from .urls import redact_url

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_UNREACHABLE = 4
EXIT_INTERRUPTED = 130

#: The Redis URL used when neither ``--redis-url`` nor ``$REDIS_URL`` is set.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    refused: release changed nothing (another owner holds the lease, or its
       holder may still be running under it); or the demo's checks failed
  2    usage error
  3    not found: no lease on KEY
  4    Redis unreachable or failing (one line on stderr names the URL)
  130  interrupted (Ctrl-C)
  143  demo stopped by SIGTERM (after cleaning up)
"""

#: Keys read per SCAN step and per inspect round trip.
SCAN_COUNT = 500


class _RefusedError(Exception):
    """A command that must not act (exit 1)."""


class _NotFoundError(Exception):
    """The lease named on the command line does not exist (exit 3)."""


# Formatting ------------------------------------------------------------------


def format_duration(seconds: float | None) -> str:
    """A short human duration: ``10ms``, ``0.4s``, ``12.0s``, ``3m04s``, ``2h05m``, ``3d04h``; ``-`` for ``None``."""
    if seconds is None:
        return "-"
    if 0 < seconds < 0.1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _is_lease(info: LeaseInfo) -> bool:
    # Every lease hash carries a token; anything else under the prefix is debris.
    return bool(info.token)


def _holder(info: LeaseInfo) -> str:
    host, pid = info.meta.get("host", ""), info.meta.get("pid", "")
    return f"{host}:{pid}" if host or pid else "-"


def _ttl_left(info: LeaseInfo) -> str:
    return "none" if info.ttl_left == -1 else format_duration(info.ttl_left / 1000)


def _overdue_after(info: LeaseInfo) -> float | None:
    """Seconds without a renewal after which the heartbeat counts as overdue (a warning, not death), or ``None``."""
    # interval 0: nobody heartbeats this lease (taken outside a worker); only its deadline and TTL end it.
    return stale_after(info.interval) / 1000 if info.interval else None


def _deadline_in(info: LeaseInfo) -> float | None:
    """Seconds until the lease may be released: its holder's deadline plus safety margin (negative: past it)."""
    deadline = info.ends_ms
    return None if deadline is None else (deadline - info.now_ms) / 1000


def _expires(info: LeaseInfo) -> str:
    """When the key ends by its TTL, as ``at <time> (in <duration>)``, or ``never (no TTL)``."""
    if info.ttl_left < 0:
        return "never (no TTL)"
    return f"at {_timestamp(info.now_ms + info.ttl_left)} (in {format_duration(info.ttl_left / 1000)})"


def _ends(info: LeaseInfo, subject: str = "it") -> str:
    """How the key ends if nobody acts: by its TTL, or (no TTL) not at all, leaked once the holder's deadline passes."""
    if info.ttl_left < 0:
        return f"{subject} has no TTL, so after that deadline it is leaked (no_ttl) and never ends by itself"
    return f"{subject} ends by its TTL {_expires(info)}"


def _by_max_hold(info: LeaseInfo) -> bool:
    """Whether the holder's deadline comes from the maximum hold rather than the last renewal."""
    deadline = info.holder_deadline_ms
    return bool(info.max_hold_until_ms) and deadline is not None and deadline >= info.max_hold_until_ms - info.margin_ms


def _when(ms: int, now_ms: int) -> str:
    """``<time> (in <duration>)`` or ``<time> (<duration> ago)``."""
    delta = (ms - now_ms) / 1000
    ago = f"in {format_duration(delta)}" if delta >= 0 else f"{format_duration(-delta)} ago"
    return f"{_timestamp(ms)} ({ago})"


def _lease_dict(info: LeaseInfo, problem: str | None) -> dict[str, Any]:
    if problem is None:
        return {**info.as_dict(), "leaked": info.state.leaked, "holder": _holder(info)}
    # Not a lease hash: its timestamps are absent, so report only what is real.
    return {"key": info.key, "redis_key": info.redis_key, "state": info.state.value,
            "leaked": info.state.leaked, "ttl_left": info.ttl_left, "problem": problem}


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")


# Reading ---------------------------------------------------------------------


def _problem(leases: Leases, info: LeaseInfo) -> str | None:
    """Why this key is not a usable lease, or ``None`` if it is one."""
    if _is_lease(info):
        return None
    try:
        kind = leases.client.type(info.redis_key)
    except redis.RedisError as e:
        raise LeaseUnavailableError(f"could not read {info.redis_key!r}: {type(e).__name__}: {e}") from e
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    return "hash without an owner token" if kind == "hash" else f"a {kind} key, not a lease hash"


# Commands --------------------------------------------------------------------


def cmd_list(leases: Leases, args: argparse.Namespace, out: TextIO) -> int:
    """``list``: every lease under the prefix (and debris), as a table or JSON."""
    found = [info for info in leases.scan(count=SCAN_COUNT) if fnmatch.fnmatchcase(info.key, args.match)]
    found.sort(key=lambda i: i.key)
    problems = {info.redis_key: _problem(leases, info) for info in found}
    if args.json:
        json.dump([_lease_dict(i, problems[i.redis_key]) for i in found], out, indent=2)
        out.write("\n")
        return EXIT_OK
    if not found:
        where = f"matching {args.match!r} " if args.match != "*" else ""
        out.write(f"no leases {where}under prefix {leases.prefix!r}\n")
        return EXIT_OK
    rows = [["KEY", "ACTOR", "MESSAGE", "HOLDER", "AGE", "TTL LEFT", "HEARTBEAT", "FENCE", "STATE"]]
    for info in found:
        if problems[info.redis_key] is None:
            rows.append([
                info.key, info.meta.get("actor", "-"), info.meta.get("message_id", "-"), _holder(info),
                format_duration(info.age), _ttl_left(info), format_duration(info.heartbeat_age) + " ago",
                str(info.fence), info.state.value,
            ])
        else:
            rows.append([info.redis_key, "-", "-", "-", "-", _ttl_left(info), "-", "-", info.state.value])
    _table(rows, out)
    for info in found:
        problem = problems[info.redis_key]
        if problem is not None:
            out.write(f"note: {info.redis_key} is {problem}; no dramatiq-leases code wrote it.\n")
    states = {info.state for info in found}
    if State.HEARTBEAT_OVERDUE in states:
        out.write("note: heartbeat_overdue: renewals are late, but the holder may still be running until its "
                  "deadline; the lease then ends by its TTL. Investigate the holder; do not release it.\n")
    if any(state.leaked for state in states):
        out.write("note: holder_dead, past_max_hold, no_ttl: leaked, no holder can still believe it holds the "
                  "lease; `release KEY --if-dead` frees it.\n")
    return EXIT_OK


def _timestamp(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")


def _state_note(info: LeaseInfo) -> str:
    """What the lease's state means, and what (not) to do about it."""
    state, deadline = info.state, info.holder_deadline_ms
    if state is State.ALIVE:
        if deadline is None:
            return f"not written by a dramatiq-leases holder (no holder deadline); it ends by its TTL {_expires(info)}"
        if not info.interval:
            return ("not heartbeated (taken outside a worker, waiting to be adopted); its holder may rely on it "
                    f"until {_when(deadline, info.now_ms)}, and {_ends(info)}")
        return f"the holder's heartbeat is renewing it (last {info.heartbeat_age:.1f}s ago)"
    if state is State.HEARTBEAT_OVERDUE:
        assert deadline is not None  # overdue only before a deadline
        return (f"renewals are late: none for {info.heartbeat_age:.1f}s (expected every "
                f"{format_duration(info.interval / 1000)}), but the holder may still be running under the lease "
                f"until its deadline {_when(deadline, info.now_ms)}; {_ends(info, 'the lease')}. "
                "It is not leaked: investigate the holder, and leave the lease alone (ending it now could let "
                "a second worker run beside the first)")
    if state is State.NO_TTL:
        past = (f"its holder's deadline and safety margin passed at {_timestamp(deadline + info.margin_ms)} and "
                if deadline is not None else "")
        return (f"leaked: {past}the key has no TTL, so it would never expire by itself; "
                "`release --if-dead` removes it")
    assert deadline is not None  # holder_dead and past_max_hold both have a deadline in the past
    why = ("its maximum hold ended" if state is State.PAST_MAX_HOLD
           else "its holder's deadline and the safety margin its actor had to stop passed")
    return (f"leaked: {why} at {_when(deadline + info.margin_ms, info.now_ms)}, so no holder can still be "
            "running under it; its TTL was changed by hand; "
            f"it ends by its TTL {_expires(info)}, or `release --if-dead` ends it now")


def cmd_show(leases: Leases, args: argparse.Namespace, out: TextIO) -> int:
    """``show KEY``: every field of one lease plus its fence counter."""
    key = validate_key(args.key)
    info = leases.inspect(key)
    fences = leases.fence_state(key)
    if info is None:
        last = f" (the last grant had fence {fences['fence']})" if fences.get("fence") else ""
        raise _NotFoundError(f"no lease on {key!r} under prefix {leases.prefix!r}{last}")
    problem = _problem(leases, info)
    token = info.token if args.show_token else None
    if args.json:
        data = _lease_dict(info, problem)
        data.update(token=token, overdue_after=_overdue_after(info), deadline_in=_deadline_in(info),
                    fence_state=fences)
        json.dump(data, out, indent=2)
        out.write("\n")
        return EXIT_OK
    if problem is not None:
        out.write(f"{info.redis_key} is {problem} (TTL left: {_ttl_left(info)}).\n")
        return EXIT_OK
    lines = [
        ("key", info.key),
        ("redis key", info.redis_key),
        ("state", f"{info.state.value}: {_state_note(info)}"),
        ("fence", str(info.fence)),
        ("owner token", token if token is not None else "(hidden; --show-token prints it)"),
        *((name, value) for name, value in sorted(info.meta.items())),
        ("acquired", f"{_timestamp(info.acquired_ms)} ({format_duration(info.age)} ago)"),
        ("last heartbeat", f"{_timestamp(info.renewed_ms)} ({format_duration(info.heartbeat_age)} ago)"),
        ("renew interval", format_duration(info.interval / 1000)),
        ("overdue after", f"{format_duration(overdue)} without a heartbeat (a warning: the holder may still run)"
         if (overdue := _overdue_after(info)) else "never: not heartbeated (waiting to be adopted)"),
        ("holder deadline", _when(deadline, info.now_ms) + ": no holder trusts the lease after it"
         if (deadline := info.holder_deadline_ms) is not None else "none recorded"),
        ("ttl", format_duration(info.ttl / 1000)),
        ("ttl left", _ttl_left(info)),
        ("expires", _expires(info)),
        ("max hold until", _timestamp(info.max_hold_until_ms) if info.max_hold_until_ms else "none"),
        *([("adopted", _timestamp(info.adopted_ms))] if info.adopted_ms else []),
        ("fence counter", ", ".join(f"last {name} {value}" for name, value in sorted(fences.items()))
         or "none"),
    ]
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        out.write(f"{name.ljust(width)}  {value}\n")
    return EXIT_OK


def cmd_release(leases: Leases, args: argparse.Namespace, out: TextIO) -> int:
    """``release KEY``: end a lease only if the token proves ownership, or no holder can still believe it holds it."""
    key = validate_key(args.key)
    info = leases.inspect(key)
    if info is None:
        raise _NotFoundError(f"no lease on {key!r} under prefix {leases.prefix!r}; nothing to release")
    if args.owner is not None:
        if leases.release_token(key, args.owner):
            out.write(f"released {key!r} (fence {info.fence}, held by {_holder(info)}): the token matched.\n")
            return EXIT_OK
        if leases.inspect(key) is None:
            raise _NotFoundError(f"the lease on {key!r} ended meanwhile; nothing to release")
        raise _RefusedError(f"refused: {key!r} is held by another owner (fence {info.fence}, "
                            f"{_holder(info)}); nothing changed")
    # The verdict is the script's, from the facts in Redis at that instant; `info` only describes the holder.
    result = leases.release_if_dead(key)
    if result.released is None:
        raise _NotFoundError(f"the lease on {key!r} ended meanwhile; nothing to release")
    if result.fence != info.fence:  # another grant meanwhile: describe that one
        info = leases.inspect(key) or info
    if result.released:
        out.write(f"released {key!r} (fence {result.fence}, held by {_holder(info)}): {_why_released(info, result)}.\n")
        return EXIT_OK
    raise _RefusedError(_why_refused(key, info, result))


def _why_released(info: LeaseInfo, result: DeadRelease) -> str:
    if not _is_lease(info):
        return "it is not a lease hash, and had no TTL"
    if info.holder_deadline_ms is None:
        return "it named no holder deadline and had no TTL, so it would never have expired"
    past = f"{-result.deadline_in:.1f}s ago" if result.deadline_in is not None else "already"
    what = "its maximum hold ended" if _by_max_hold(info) else "its holder's deadline and safety margin passed"
    ttl = "; the key had no TTL" if info.ttl_left == -1 else ""
    return f"{what} {past}, so no holder could still be running under it{ttl}"


def _why_refused(key: str, info: LeaseInfo, result: DeadRelease) -> str:
    unchanged = "nothing changed"
    if result.deadline_in is None:
        what = "is not a lease hash" if not _is_lease(info) else "names no holder deadline"
        return (f"refused: {key!r} (fence {result.fence}) {what}, and expires by itself by its TTL "
                f"{_expires(info)}; {unchanged}")
    deadline = f"its deadline plus the safety margin its actor has to stop, in {result.deadline_in:.1f}s"
    if info.ends_ms is not None:
        deadline += f" ({_timestamp(info.ends_ms)})"
    ends = _ends(info)
    if not info.interval:
        return (f"refused: the lease on {key!r} (fence {result.fence}) is not heartbeated (taken outside a worker, "
                f"waiting to be adopted); its holder may rely on it until {deadline}; {ends}; {unchanged}")
    holder = f"{key!r} (fence {result.fence}, {_holder(info)})"
    if info.state is State.HEARTBEAT_OVERDUE:
        return (f"refused: the heartbeat of {holder} is overdue (last renewal {info.heartbeat_age:.1f}s ago), "
                f"but its holder may still be running under the lease until {deadline}: releasing it now could "
                f"let a second worker run beside it; {ends}; {unchanged}")
    return (f"refused: the holder of {holder} is alive: its last heartbeat was {info.heartbeat_age:.1f}s ago, "
            f"and it relies on the lease until {deadline}; {unchanged}")


def cmd_exporter(leases: Leases, args: argparse.Namespace, out: TextIO) -> int:
    """``exporter``: serve lease metrics over HTTP for Prometheus (runs until interrupted)."""
    try:
        leases.client.ping()  # fail fast with exit 4 rather than serving errors
    except redis.RedisError as e:
        raise LeaseUnavailableError(f"{type(e).__name__}: {e}") from e
    from .exporter import serve  # type: ignore[import-not-found, unused-ignore]

    serve(leases, host=args.host, port=args.port, interval=args.interval)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: workers contend for leases, one is killed, the orphaned lease expires (see ``demo.py``)."""
    from . import demo

    return demo.run(
        args.redis_url,
        prefix=args.prefix or DEFAULT_PREFIX,
        invoices=args.invoices,
        per_invoice=args.per_invoice,
        job_seconds=args.job_seconds,
    )


# Parser ----------------------------------------------------------------------


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dramatiq-leases``."""
    # The global flags work before or after the command; SUPPRESS keeps a
    # subcommand's absent flag from overwriting one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis-url", default=argparse.SUPPRESS, metavar="URL",
        help=f"Redis holding the leases (default: $REDIS_URL, else {DEFAULT_REDIS_URL}; "
             "demo: a private Redis unless given)",
    )
    common.add_argument("--prefix", default=argparse.SUPPRESS,
                        help=f"prefix of the lease keys in Redis (default: {DEFAULT_PREFIX})")
    parser = argparse.ArgumentParser(
        prog="dramatiq-leases",
        description="Inspect and release Dramatiq leases in Redis, export their metrics, or run the demo.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("list", aliases=["ls"], parents=[common], help="list leases under the prefix",
                       description="List leases (and stray keys) under the prefix, using SCAN.",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--match", default="*", metavar="GLOB",
                   help="only leases whose key matches GLOB (default: *)")
    p.add_argument("--json", action="store_true", help="print one JSON array")

    p = sub.add_parser("show", parents=[common], help="everything known about one lease",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("key", metavar="KEY", help="the lease key, such as invoice:42")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--show-token", action="store_true",
                   help="print the owner token (whoever has it can release the lease)")

    p = sub.add_parser(
        "release", parents=[common], help="release a lease, only if owned or leaked",
        description="Release a lease. Never a blind delete: prove ownership with --owner, or use --if-dead "
                    "to release it only if no holder can still believe it holds it: its holder's own deadline "
                    "(the last renewal plus the TTL, less the holder's safety margin, or the end of its maximum "
                    "hold) has passed, or the key has no TTL and no holder deadline ahead. An overdue heartbeat "
                    "is not enough: the holder may still be running.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("key", metavar="KEY", help="the lease key, such as invoice:42")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--owner", metavar="TOKEN", help="release only if TOKEN holds the lease")
    how.add_argument("--if-dead", action="store_true",
                     help="release only if the holder's deadline has passed, or the key has no TTL and no "
                          "holder deadline ahead")

    p = sub.add_parser("exporter", parents=[common], help="serve lease metrics for Prometheus",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    p.add_argument("--port", type=int, default=9808, help="port to listen on (default: 9808)")
    p.add_argument("--interval", type=_positive_float, default=5.0, metavar="SECONDS",
                   help="seconds between scans of the leases (default: 5)")

    p = sub.add_parser(
        "demo", parents=[common], help="watch workers contend, one die, and its lease expire",
        description="Start a private Redis (unless --redis-url) and Dramatiq workers, send contending "
                    "jobs, SIGKILL a worker holding a lease, and show the orphaned lease expire and the job "
                    "complete.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--invoices", type=_positive_int, default=3, help="number of lease keys (default: 3)")
    p.add_argument("--per-invoice", type=_positive_int, default=4, help="messages per key (default: 4)")
    p.add_argument("--job-seconds", type=_positive_float, default=1.0,
                   help="duration of each job (default: 1)")
    return parser


def _fail(err: TextIO, text: str) -> None:
    err.write("dramatiq-leases: " + " ".join(text.split()) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dramatiq-leases`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed by argparse
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    args.redis_url = getattr(args, "redis_url", None)
    args.prefix = getattr(args, "prefix", None)
    out, err = sys.stdout, sys.stderr
    try:
        if args.command == "demo":
            try:
                validate_prefix(args.prefix or DEFAULT_PREFIX)
            except LeaseError as e:
                _fail(err, str(e))
                return EXIT_USAGE
            return cmd_demo(args)
        url = args.redis_url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
        try:
            leases = Leases.from_url(url, prefix=args.prefix or DEFAULT_PREFIX)
        except LeaseError as e:  # an invalid --prefix
            _fail(err, str(e))
            return EXIT_USAGE
        except ValueError as e:
            _fail(err, f"invalid --redis-url {redact_url(url)!r}: {e}")
            return EXIT_USAGE
        try:
            command = {"list": cmd_list, "ls": cmd_list, "show": cmd_show, "release": cmd_release,
                       "exporter": cmd_exporter}[args.command]
            return command(leases, args, out)
        except LeaseUnavailableError as e:
            _fail(err, f"cannot use Redis at {redact_url(url)}: {e}")
            return EXIT_UNREACHABLE
        except _RefusedError as e:
            _fail(err, str(e))
            return EXIT_REFUSED
        except _NotFoundError as e:
            _fail(err, str(e))
            return EXIT_NOT_FOUND
        except LeaseError as e:  # an invalid key
            _fail(err, str(e))
            return EXIT_USAGE
        finally:
            leases.client.close()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
