"""What each ``dramatiq-leases`` command does, and the exit codes the commands end with."""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import redis

from ..core import LeaseInfo, Leases
from ..core.errors import LeaseConfigError, LeaseUnavailableError
from ..core.keys import DEFAULT_PREFIX, unique_name, validate_key
from ..core.rates import RateState
from ..core.reading import ReadGaps
from ..core.unique import UniqueRecords
from ..urls import redact_url
from .history import operator, write_history
from .render import (
    deadline_in,
    describe_line,
    held_by,
    holder,
    is_lease,
    key_limit,
    lease_dict,
    line_dict,
    overdue_after,
    printable,
    ttl_left,
    why_refused,
    why_released,
    write_list,
    write_show,
    write_show_holders,
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
    found.sort(key=lambda i: (i.key, i.slot))
    problems = {info.redis_key: _problem(info, gaps) for info in found}
    if args.json:
        held = held_by(found, problems)
        rows = [{**lease_dict(i, problems[i.redis_key]), "holders": held.get(i.key, (1, 1))[0]} for i in found]
        json.dump(rows, out, indent=2)
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


def _holder_dict(info: LeaseInfo, problem: str | None, token: str | None) -> dict[str, Any]:
    """One holder for ``show --json``: its lease object, its token (``None`` when hidden) and its deadlines."""
    data = lease_dict(info, problem)
    data.update(token=token, overdue_after=overdue_after(info), deadline_in=deadline_in(info))
    return data


def cmd_show(leases: Leases, args: argparse.Namespace, out: TextIO) -> int:
    """``show KEY``: every field of each of the key's holders, plus its fence counter and its line; with
    ``--history``, the key's history too (``"history"`` in the JSON), also once its lease is gone."""
    key = validate_key(args.key)
    if not getattr(args, "history", False):
        return _show(leases, args, key, out)
    events = leases.history(key)
    shown = io.StringIO() if args.json else out
    try:
        code = _show(leases, args, key, shown)
    except NotFoundError:
        if not events:  # nothing to show at all
            raise
        code = EXIT_OK
        if not args.json:
            out.write(f"no lease on {key!r} right now\n")
    if args.json:
        text = shown.getvalue() if isinstance(shown, io.StringIO) else ""
        doc = json.loads(text) if text else {"key": key, "lease": None, "holders": []}
        doc["history"] = [event.as_dict() for event in events]
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        write_history(key, events, out)
    return code


def _show(leases: Leases, args: argparse.Namespace, key: str, out: TextIO) -> int:
    """``show KEY`` without its history."""
    # A key of the wrong type among the lease's (its line, its fence counter...) is told, not taken for an
    # unreachable Redis: the read goes on past it.
    gaps = ReadGaps()
    holders = leases.holders(key, gaps=gaps)
    fences = leases.fence_state(key, gaps=gaps)
    line = leases.inspect_line(key, gaps=gaps)
    unreadable = {name: bad.problem for name, bad in sorted(gaps.keys.items())}
    unique = _unique_records(leases, key, unreadable)
    rates = leases.rate_states(key)
    if not holders and not line.length and not unreadable and not unique and not rates:
        last = f" (the last grant had fence {fences['fence']})" if fences.get("fence") else ""
        raise NotFoundError(f"no lease on {key!r} under prefix {leases.prefix!r}{last}")
    extra: dict[str, Any] = {"unreadable": unreadable} if unreadable else {}
    if unique:
        extra["unique"] = unique
    if rates:
        extra["rates"] = [
            {"count": r.rate.count, "window_ms": r.rate.window, "starts": r.starts, "next_start_in_ms": r.next_start_ms}
            for r in rates
        ]
    limit = key_limit(holders, fences)
    if not holders:
        # Free for a moment (its line's head is on its way to take it), or its keys cannot be read.
        if args.json:
            doc: dict[str, Any] = {"key": key, "lease": None, "holders": [], "held": 0, "limit": limit}
            json.dump({**doc, "line": line_dict(line), "fence_state": fences, **extra}, out, indent=2)
            out.write("\n")
        else:
            out.write(f"no lease on {key!r} right now; line: {describe_line(line)}\n")
            _rate_notes(rates, out)
            _unique_notes(unique, out)
            _unreadable_notes(key, gaps, out)
        return EXIT_OK
    shown = [(info, info.token if args.show_token else None, _problem(info, gaps)) for info in holders]
    if args.json:
        # The first holder's fields at the top, as for a key of one holder; every holder under "holders".
        each = [_holder_dict(info, problem, token) for info, token, problem in shown]
        data = dict(each[0])
        data.update(holders=each, held=len(holders), limit=limit, fence_state=fences, line=line_dict(line), **extra)
        json.dump(data, out, indent=2)
        out.write("\n")
        return EXIT_OK
    if len(shown) > 1:
        write_show_holders(key, shown, fences, line, out, limit=limit)
    else:
        ((info, token, problem),) = shown
        if problem is not None:
            out.write(f"{info.redis_key} is {problem} (TTL left: {ttl_left(info)}).\n")
        else:
            write_show(info, token, fences, line, out, limit=limit)
    _rate_notes(rates, out)
    _unique_notes(unique, out)
    _unreadable_notes(key, gaps, out)
    return EXIT_OK


def _unique_records(leases: Leases, key: str, unreadable: dict[str, str]) -> list[dict[str, Any]]:
    """The key's unique records (``lock_unique``), each with the seconds left before it ends by itself; a key
    of another type in their place is noted in ``unreadable``."""
    try:
        records = UniqueRecords(leases).records(key)
        now_ms = int(leases.client.time()[0]) * 1000 if records else 0
    except LeaseUnavailableError:
        unreadable[unique_name(leases.prefix, key)] = "not a sorted set of unique records"
        return []
    return [
        {
            "message_id": r.message_id,
            "mode": r.mode,
            "attempt": r.attempt,
            "ends_in": max(0, (r.ends_ms - now_ms) // 1000),
        }
        for r in records
    ]


def _rate_notes(rates: list[RateState], out: TextIO) -> None:
    """Where the key stands against each of its rates (``lock_rate``)."""
    for r in rates:
        nxt = "now" if not r.next_start_ms else f"in {r.next_start_ms} ms"
        out.write(f"rate {r.rate.count}/{r.rate.window} ms: {r.starts} start(s) in the last window; next start {nxt}\n")


def _unique_notes(unique: list[dict[str, Any]], out: TextIO) -> None:
    """Why a send of the key is refused: each message holding a unique record."""
    for r in unique:
        until = "it starts" if r["mode"] == "queued" else "it is done for good"
        out.write(
            f"unique record: message {printable(r['message_id'])} (lock_unique={r['mode']!r}, attempt "
            f"{r['attempt']}): a send of this key is refused until {until} (the record ends by itself in "
            f"{r['ends_in']} s without a sign of life of its message)\n"
        )


def _holders_named(holders: Sequence[LeaseInfo]) -> str:
    """``fence 7 in slot 0 (alive, web-7:4242); fence 9 in slot 1 (holder_dead, web-8:17)``."""
    return "; ".join(f"fence {i.fence} in slot {i.slot} ({i.state.value}, {holder(i)})" for i in holders)


def _release_owner(leases: Leases, key: str, holders: list[LeaseInfo], token: str, out: TextIO) -> int:
    """``release KEY --owner TOKEN``: the holder whose token it is, whichever slot it holds."""
    mine = next((info for info in holders if info.token == token), None)
    if leases.release_token(key, token, slot=mine.slot if mine is not None else None, by=operator()):
        info = mine or holders[0]
        out.write(f"released {key!r} (fence {info.fence}, held by {holder(info)}): the token matched.\n")
        return EXIT_OK
    if not leases.holders(key):
        raise NotFoundError(f"the lease on {key!r} ended meanwhile; nothing to release")
    if len(holders) == 1:
        (info,) = holders
        raise RefusedError(
            f"refused: {key!r} is held by another owner (fence {info.fence}, {holder(info)}); nothing changed"
        )
    raise RefusedError(
        f"refused: none of the {len(holders)} holders of {key!r} has that token ({_holders_named(holders)}); "
        "nothing changed"
    )


def cmd_release(leases: Leases, args: argparse.Namespace, out: TextIO) -> int:
    """``release KEY``: end a lease only if the token proves ownership, or no holder can still believe it holds it.

    On a key held by several at once, ``--if-dead`` judges the holder named by ``--fence``; without it, such a
    key is a usage error naming its holders (never a guess at which to end).
    """
    key = validate_key(args.key)
    fence = getattr(args, "fence", None)
    if fence is not None and args.owner is not None:
        raise LeaseConfigError("--fence goes with --if-dead: --owner TOKEN already names the holder")
    holders = leases.holders(key)
    if not holders:
        raise NotFoundError(f"no lease on {key!r} under prefix {leases.prefix!r}; nothing to release")
    if args.owner is not None:
        return _release_owner(leases, key, holders, args.owner, out)
    if fence is None and len(holders) > 1:
        raise LeaseConfigError(
            f"{key!r} has {len(holders)} holders ({_holders_named(holders)}): say which to judge with --fence N"
        )
    info = holders[0] if fence is None else next((i for i in holders if i.fence == fence), None)
    if info is None:
        raise NotFoundError(
            f"no holder of {key!r} has fence {fence} (its holders: {_holders_named(holders)}); nothing to release"
        )
    # The verdict is the script's, from the facts in Redis at that instant, on this holder's grant only;
    # `info` only describes the holder.
    result = leases.release_if_dead(key, fence=info.fence, by=operator())
    if result.released is None:
        raise NotFoundError(f"the lease on {key!r} (fence {info.fence}) ended meanwhile; nothing to release")
    if result.fence != info.fence:
        raise RefusedError(
            f"refused: the grant of fence {info.fence} on {key!r} ended meanwhile, and fence {result.fence} holds "
            "its slot now (`show` it, and judge that one); nothing changed"
        )
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

    serve(
        leases,
        host=args.host,
        port=args.port,
        interval=args.interval,
        top=args.top,
        cli_options=exporter_cli_options(getattr(args, "url", None), leases.prefix),
        web_config=getattr(args, "web_config", None),
        open_lease_views=args.open_lease_views,
        mask_keys=args.mask_keys,
        max_connections=args.max_connections,
        read_timeout=args.read_timeout,
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
