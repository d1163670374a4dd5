"""What each ``dramatiq-leases`` command does, and the exit codes the commands end with."""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from typing import Any, TextIO

import redis

from ..core import LeaseInfo, Leases
from ..core.errors import LeaseUnavailableError
from ..core.keys import DEFAULT_PREFIX, validate_key
from ..core.reading import ReadGaps
from ..urls import redact_url
from .render import (
    deadline_in,
    describe_line,
    holder,
    is_lease,
    lease_dict,
    line_dict,
    overdue_after,
    printable,
    ttl_left,
    why_refused,
    why_released,
    write_list,
    write_show,
)

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_UNREACHABLE = 4
#: ``list`` printed what the Redis Cluster masters that answered hold, and some did not answer (named on stderr).
EXIT_PARTIAL = 6
EXIT_INTERRUPTED = 130

#: Keys read per SCAN step and per inspect round trip.
SCAN_COUNT = 500


class RefusedError(Exception):
    """A command that must not act (exit 1)."""


class NotFoundError(Exception):
    """The lease named on the command line does not exist (exit 3)."""


def _problem(info: LeaseInfo, gaps: ReadGaps) -> str | None:
    """Why this key is not a usable lease, or ``None`` if it is one (``gaps``: the read that found it)."""
    if is_lease(info):
        return None
    bad = gaps.keys.get(info.redis_key)  # a key that is not a hash, as the read found it
    return bad.problem if bad is not None else "hash without an owner token"


def _warn_unanswered(gaps: ReadGaps, err: TextIO | None) -> int:
    """Say on stderr, in one line, which Cluster masters did not answer; the exit code that says so too."""
    if not gaps.nodes:
        return EXIT_OK
    which = "; ".join(f"{node} ({error})" for node, error in sorted(gaps.nodes.items()))
    (err or sys.stderr).write(
        printable(
            f"dramatiq-leases: {len(gaps.nodes)} Redis Cluster master(s) did not answer, so what they hold is not "
            f"listed: {which}"
        )
        + "\n"
    )
    return EXIT_PARTIAL


def cmd_list(leases: Leases, args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    """``list``: every lease under the prefix (and debris), as a table or JSON.

    On a Redis Cluster, master by master: the leases of those that answer are listed, and those that do not
    are named on ``err`` (default stderr), with exit code :data:`EXIT_PARTIAL`.
    """
    gaps = ReadGaps()
    found = [info for info in leases.scan(count=SCAN_COUNT, gaps=gaps) if fnmatch.fnmatchcase(info.key, args.match)]
    found.sort(key=lambda i: i.key)
    problems = {info.redis_key: _problem(info, gaps) for info in found}
    if args.json:
        json.dump([lease_dict(i, problems[i.redis_key]) for i in found], out, indent=2)
        out.write("\n")
    elif not found:
        where = f"matching {args.match!r} " if args.match != "*" else ""
        masters = " on the masters that answered" if gaps.nodes else ""
        out.write(f"no leases {where}under prefix {leases.prefix!r}{masters}\n")
    else:
        write_list(found, problems, out)
    listed = {info.redis_key for info in found}
    unread = sorted((name, bad) for name, bad in gaps.keys.items() if name not in listed)
    for name, bad in unread:  # keys the scan found but no read could name (not UTF-8): not silently left out
        (err or sys.stderr).write(printable(f"dramatiq-leases: {name} could not be read: {bad.problem}") + "\n")
    code = _warn_unanswered(gaps, err)
    return EXIT_PARTIAL if unread else code


def _unreadable_notes(key: str, gaps: ReadGaps, out: TextIO) -> None:
    """A note on each of ``key``'s Redis keys found of the wrong type (the lease's own has its line already)."""
    for name, bad in sorted(gaps.keys.items()):
        if bad.kind != "lease":
            out.write(
                f"note: {name} is {bad.problem}; no dramatiq-leases code wrote it, and the scripts of "
                f"{key!r} fail on it until it is removed.\n"
            )


def cmd_show(leases: Leases, args: argparse.Namespace, out: TextIO) -> int:
    """``show KEY``: every field of one lease plus its fence counter."""
    key = validate_key(args.key)
    # A key of the wrong type among the lease's (its line, its fence counter...) is told, not taken for an
    # unreachable Redis: the read goes on past it.
    gaps = ReadGaps()
    info = leases.inspect(key, gaps=gaps)
    fences = leases.fence_state(key, gaps=gaps)
    line = leases.inspect_line(key, gaps=gaps)
    unreadable = {name: bad.problem for name, bad in sorted(gaps.keys.items())}
    if info is None and not line.length and not unreadable:
        last = f" (the last grant had fence {fences['fence']})" if fences.get("fence") else ""
        raise NotFoundError(f"no lease on {key!r} under prefix {leases.prefix!r}{last}")
    extra: dict[str, Any] = {"unreadable": unreadable} if unreadable else {}
    if info is None:
        # Free for a moment (its line's head is on its way to take it), or its keys cannot be read.
        if args.json:
            json.dump(
                {"key": key, "lease": None, "line": line_dict(line), "fence_state": fences, **extra}, out, indent=2
            )
            out.write("\n")
        else:
            out.write(f"no lease on {key!r} right now; line: {describe_line(line)}\n")
            _unreadable_notes(key, gaps, out)
        return EXIT_OK
    problem = _problem(info, gaps)
    token = info.token if args.show_token else None
    if args.json:
        data = lease_dict(info, problem)
        data.update(
            token=token,
            overdue_after=overdue_after(info),
            deadline_in=deadline_in(info),
            fence_state=fences,
            line=line_dict(line),
            **extra,
        )
        json.dump(data, out, indent=2)
        out.write("\n")
        return EXIT_OK
    if problem is not None:
        out.write(f"{info.redis_key} is {problem} (TTL left: {ttl_left(info)}).\n")
    else:
        write_show(info, token, fences, line, out)
    _unreadable_notes(key, gaps, out)
    return EXIT_OK


def cmd_release(leases: Leases, args: argparse.Namespace, out: TextIO) -> int:
    """``release KEY``: end a lease only if the token proves ownership, or no holder can still believe it holds it."""
    key = validate_key(args.key)
    info = leases.inspect(key)
    if info is None:
        raise NotFoundError(f"no lease on {key!r} under prefix {leases.prefix!r}; nothing to release")
    if args.owner is not None:
        if leases.release_token(key, args.owner):
            out.write(f"released {key!r} (fence {info.fence}, held by {holder(info)}): the token matched.\n")
            return EXIT_OK
        if leases.inspect(key) is None:
            raise NotFoundError(f"the lease on {key!r} ended meanwhile; nothing to release")
        raise RefusedError(
            f"refused: {key!r} is held by another owner (fence {info.fence}, {holder(info)}); nothing changed"
        )
    # The verdict is the script's, from the facts in Redis at that instant; `info` only describes the holder.
    result = leases.release_if_dead(key)
    if result.released is None:
        raise NotFoundError(f"the lease on {key!r} ended meanwhile; nothing to release")
    if result.fence != info.fence:  # another grant meanwhile: describe that one
        info = leases.inspect(key) or info
    if result.released:
        out.write(f"released {key!r} (fence {result.fence}, held by {holder(info)}): {why_released(info, result)}.\n")
        return EXIT_OK
    raise RefusedError(why_refused(key, info, result))


def cmd_exporter(leases: Leases, args: argparse.Namespace, out: TextIO) -> int:
    """``exporter``: serve lease metrics over HTTP for Prometheus (runs until interrupted)."""
    try:
        leases.client.ping()  # fail fast with exit 4 rather than serving errors
    except redis.RedisError as e:
        raise LeaseUnavailableError(f"{type(e).__name__}: {e}") from e
    from ..exporter import serve  # type: ignore[import-not-found, unused-ignore]
    from ..exporter.server import BusyAccess

    serve(
        leases,
        host=args.host,
        port=args.port,
        interval=args.interval,
        top=args.top,
        cli_options=exporter_cli_options(getattr(args, "url", None), leases.prefix),
        busy_access=BusyAccess(
            open=args.busy_view == "open", token=args.busy_token, hash_keys=args.busy_keys == "hashed"
        ),
    )
    return EXIT_OK


def exporter_cli_options(url: str | None, prefix: str) -> list[str]:
    """The global arguments the Busy page's ``show`` commands need: the non-default ``--redis-url``, ``--prefix``.

    The URL's password is shown as ``***``: the page is served without authentication.
    """
    from . import DEFAULT_REDIS_URL  # the package imports this module

    options = []
    if url is not None and url != DEFAULT_REDIS_URL:
        options += ["--redis-url", redact_url(url)]
    if prefix != DEFAULT_PREFIX:
        options += ["--prefix", prefix]
    return options


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: workers contend for leases, one is killed, its orphaned lease expires (:mod:`dramatiq_leases.demo`)."""
    from .. import demo

    return demo.run(
        args.redis_url,
        prefix=args.prefix or DEFAULT_PREFIX,
        invoices=args.invoices,
        per_invoice=args.per_invoice,
        job_seconds=args.job_seconds,
    )
