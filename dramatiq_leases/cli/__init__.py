"""The ``dramatiq-leases`` command: inspect and release leases, run the exporter or the demo.

Commands::

  dramatiq-leases list [--match GLOB] [--json]        (alias: ls)
  dramatiq-leases show KEY [--json] [--show-token] [--history]
  dramatiq-leases release KEY (--owner TOKEN | --if-dead [--fence N])
  dramatiq-leases exporter [--host HOST] [--port PORT] [--interval SECONDS] [--top N]
                           [--web.config.file FILE] [--open-lease-views] [--mask-keys]
                           [--web.max-connections N] [--web.read-timeout SECONDS]
  dramatiq-leases demo [--invoices N] [--per-invoice N] [--job-seconds S]

Global flags, accepted before or after the command: ``--redis-url`` (default:
``$REDIS_URL``, else ``redis://127.0.0.1:6379/0``; ``demo`` ignores both and
starts a private Redis unless ``--redis-url`` is given; a Redis Cluster:
``redis+cluster://HOST:PORT``, any one of its nodes; through Sentinel:
``redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``) and ``--prefix``
(default ``dramatiq-leases``).

Exit codes (an API: scripts rely on them):

* 0: success.
* 1: refused: ``release`` changed nothing because another owner holds the
  lease, or (``--if-dead``) its holder may still believe it holds it; or the
  demo's checks failed.
* 2: usage error (bad or missing arguments; ``release --if-dead`` of a key with
  several holders without ``--fence``, which names them).
* 3: not found: there is no lease on KEY.
* 4: Redis unreachable or failing; one line on stderr names the URL.
* 5: the exporter cannot listen on HOST:PORT (unknown host, address in use, port
  not permitted); one line on stderr names HOST:PORT and the system's reason.
* 6: ``list`` on a Redis Cluster: some masters did not answer; what the others
  hold was printed, and one line on stderr names those that did not.
* 130: interrupted (Ctrl-C); 143: the demo was stopped by SIGTERM (after cleaning up).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn, TextIO, cast

from ..core import Leases
from ..core.errors import LeaseError, LeaseUnavailableError, LeaseURLError
from ..core.keys import DEFAULT_PREFIX, validate_prefix
from ..urls import redact_url
from .commands import (
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    SCAN_COUNT,
    NotFoundError,
    RefusedError,
    cmd_demo,
    cmd_exporter,
    cmd_list,
    cmd_release,
    cmd_show,
)
from .render import PrintableWriter, format_duration, printable

if TYPE_CHECKING:
    from ..exporter.webconfig import WebConfig

# What `dramatiq_leases.cli` offered as one module, still importable from here.
__all__ = [
    "DEFAULT_REDIS_URL",
    "EXIT_CANNOT_LISTEN",
    "EXIT_CODES_HELP",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_PARTIAL",
    "EXIT_REFUSED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "SCAN_COUNT",
    "build_parser",
    "cmd_demo",
    "cmd_exporter",
    "cmd_list",
    "cmd_release",
    "cmd_show",
    "format_duration",
    "main",
]

#: Exit code of ``exporter`` when it cannot listen on HOST:PORT (unknown host, address in use, not permitted).
EXIT_CANNOT_LISTEN = 5

#: The Redis URL used when neither ``--redis-url`` nor ``$REDIS_URL`` is set.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    refused: release changed nothing (another owner holds the lease, or its
       holder may still be running under it); or the demo's checks failed
  2    usage error (release --if-dead of a key with several holders: --fence N
       says which)
  3    not found: no lease on KEY
  4    Redis unreachable or failing (one line on stderr names the URL)
  5    exporter: cannot listen on HOST:PORT (one line on stderr says why)
  6    list: some Redis Cluster masters did not answer, or a key's name is not
       UTF-8 (what could be read was printed; one line on stderr names each)
  130  interrupted (Ctrl-C)
  143  demo stopped by SIGTERM (after cleaning up)
"""

# Parser ----------------------------------------------------------------------

# What looks like a URL in a message: each one is shown through redact_url.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")


def _redact_urls(text: str) -> str:
    """``text`` with the password of every URL in it shown as ``***`` (:func:`redact_url`): what reaches the
    terminal never carries a Redis password, even one typed in a misspelt flag or quoted by redis-py."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors never echo a password (``--redis_url=redis://:pw@...``)."""

    def error(self, message: str) -> NoReturn:
        """Print the usage and ``message``, its URLs redacted, and exit 2."""
        super().error(_redact_urls(message))


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535 (0: any free port), got {text!r}")
    return value


def _host(text: str) -> str:
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]  # an IPv6 address as URLs write it: [::1]
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (0.0.0.0: every IPv4 interface; ::, every interface)")
    return text


class _Removed(argparse.Action):
    """A flag that was removed: giving it is a usage error naming what replaces it (hidden from --help)."""

    def __init__(self, option_strings: Sequence[str], dest: str, replacement: str = "", **kwargs: object) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, *_: object) -> None:
        raise argparse.ArgumentError(self, f"removed in 0.2: {self.replacement}")


#: The exporter's flags removed in 0.2, and what replaces each (docs/guide.md, "Protecting the exporter").
REMOVED_EXPORTER_FLAGS = {
    "--busy-view": "--busy-view open is now --open-lease-views (local, the default, needs no flag)",
    "--busy-token-file": "protect the lease views (and every other path) with --web.config.file FILE and its "
    "basic_auth_users or client certificates; a bearer token is no longer accepted",
    "--busy-keys": "--busy-keys hashed is now --mask-keys (plain, the default, needs no flag)",
}


def _web_config(path: str) -> WebConfig:
    """The web configuration in the file ``path``, loaded at parse time: a bad file is a usage error before
    anything starts, naming the file and the field."""
    from ..exporter.webconfig import WebConfigError, load_web_config  # imports no optional package at import

    try:
        return load_web_config(path)
    except WebConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dramatiq-leases``."""
    # The global flags work before or after the command; SUPPRESS keeps a
    # subcommand's absent flag from overwriting one given before it.
    common = _Parser(add_help=False)
    common.add_argument(
        "--redis-url",
        default=argparse.SUPPRESS,
        metavar="URL",
        help=f"Redis holding the leases (default: $REDIS_URL, else {DEFAULT_REDIS_URL}; "
        "a Redis Cluster: redis+cluster://HOST:PORT of any one node; "
        "through Sentinel: redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]; "
        "demo: a private Redis unless given)",
    )
    common.add_argument(
        "--prefix", default=argparse.SUPPRESS, help=f"prefix of the lease keys in Redis (default: {DEFAULT_PREFIX})"
    )
    parser = _Parser(
        prog="dramatiq-leases",
        description="Inspect and release Dramatiq leases in Redis, export their metrics, or run the demo.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "list",
        aliases=["ls"],
        parents=[common],
        help="list leases under the prefix",
        description="List leases (and stray keys) under the prefix, using SCAN: one row per holder, HELD "
        "saying how many hold its key of how many may (lock_limit).",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--match", default="*", metavar="GLOB", help="only leases whose key matches GLOB (default: *)")
    p.add_argument("--json", action="store_true", help="print one JSON array")

    p = sub.add_parser(
        "show",
        parents=[common],
        help="everything known about one lease key: each of its holders, its fence counter, its line",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("key", metavar="KEY", help="the lease key, such as invoice:42")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--show-token", action="store_true", help="print the owner token (whoever has it can release the lease)"
    )
    p.add_argument(
        "--history",
        action="store_true",
        help="also print the key's history, oldest event first (kept by workers with LeaseMiddleware(history=N)), "
        "even once its lease is gone",
    )

    p = sub.add_parser(
        "release",
        parents=[common],
        help="release a lease, only if owned or leaked",
        description="Release a lease. Never a blind delete: prove ownership with --owner, or use --if-dead "
        "to release it only if no holder can still believe it holds it: its holder's own deadline "
        "(the last renewal plus the TTL, less the holder's safety margin, or the end of its maximum "
        "hold) has passed, or the key has no TTL and no holder deadline ahead. An overdue heartbeat "
        "is not enough: the holder may still be running.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("key", metavar="KEY", help="the lease key, such as invoice:42")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--owner", metavar="TOKEN", help="release only if TOKEN holds the lease")
    how.add_argument(
        "--if-dead",
        action="store_true",
        help="release only if the holder's deadline has passed, or the key has no TTL and no holder deadline ahead",
    )
    p.add_argument(
        "--fence",
        type=_non_negative_int,
        metavar="N",
        help="with --if-dead: the holder to judge, by the fence of its grant (`show KEY` lists a key's holders); "
        "required when several hold the key (lock_limit)",
    )

    p = sub.add_parser(
        "exporter",
        parents=[common],
        help="serve lease metrics for Prometheus",
        description="Scan the leases in Redis; serve their metrics on /metrics (Prometheus)\n"
        "and, on /leases, the leases held now, worst first, and the keys with the\n"
        "longest lines (JSON, for Grafana's Infinity data source).",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The loopback by default: what the exporter serves is reachable from elsewhere only when the operator
    # says so (--host 0.0.0.0), and --web.config.file then guards every path.
    p.add_argument(
        "--host",
        type=_host,
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this host only; 0.0.0.0 for Prometheus on another "
        "host: the lease views are then refused unless --web.config.file authenticates the reader, or "
        "--open-lease-views)",
    )
    p.add_argument("--port", type=_port, default=9808, help="port to listen on, 0 to 65535 (default: 9808)")
    p.add_argument(
        "--interval",
        type=_positive_float,
        default=5.0,
        metavar="SECONDS",
        help="seconds between scans of the leases (default: 5)",
    )
    # The exporter's modules (prometheus_client) are imported only to run it: its defaults are repeated here.
    p.add_argument(
        "--top",
        type=_non_negative_int,
        default=50,
        metavar="N",
        help="rows of each table of /leases, which shows lease keys (default: 50; "
        "?limit= asks for fewer; 0 turns /leases off)",
    )
    p.add_argument(
        "--mask-keys",
        action="store_true",
        help="show each key of /leases as sha256:<16 hex digits> and no inspect command; /leases/history "
        "then takes that digest (for keys that carry personal data)",
    )
    p.add_argument(
        "--web.config.file",
        type=_web_config,
        metavar="FILE",
        dest="web_config",
        help="TLS and basic auth or client certificates on every path, /metrics and the lease views alike, "
        "in the web configuration format of Prometheus exporters (exporter-toolkit): tls_server_config, "
        "basic_auth_users (bcrypt), http_server_config.headers; read at start (needs: pip install "
        "'dramatiq-leases[exporter]'). Those it authenticates may read the lease views on any bind",
    )
    p.add_argument(
        "--open-lease-views",
        action="store_true",
        help="serve the lease views (/leases, /busy, /leases/history: they show lease keys, message ids, hosts "
        "and pids) to requests --web.config.file does not authenticate, on a bind that is not the loopback: "
        "only for a network that only trusted readers reach",
    )
    for flag, replacement in REMOVED_EXPORTER_FLAGS.items():
        p.add_argument(flag, action=_Removed, replacement=replacement)
    # As Prometheus' own flags: one client holding idle connections must not starve the scrape.
    p.add_argument(
        "--web.max-connections",
        type=_positive_int,
        default=64,
        metavar="N",
        dest="max_connections",
        help="connections served at once, half of them at most from one client address; more are refused "
        "at once (default: 64; keep it below the open files limit, ulimit -n)",
    )
    p.add_argument(
        "--web.read-timeout",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        dest="read_timeout",
        help="seconds a connection has, in all, for its TLS handshake and request head, and then to take "
        "the answer; closed past it (default: 10)",
    )

    p = sub.add_parser(
        "demo",
        parents=[common],
        help="watch workers contend, one die, and its lease expire",
        description="Start a private Redis (unless --redis-url) and Dramatiq workers, send contending "
        "jobs, SIGKILL a worker holding a lease, and show the orphaned lease expire and the job "
        "complete.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--invoices", type=_positive_int, default=3, help="number of lease keys (default: 3)")
    p.add_argument("--per-invoice", type=_positive_int, default=4, help="messages per key (default: 4)")
    p.add_argument("--job-seconds", type=_positive_float, default=1.0, help="duration of each job (default: 1)")
    return parser


def _fail(err: TextIO, text: str) -> None:
    # One line (newlines and tabs folded), its control characters escaped: messages quote keys and holders.
    err.write("dramatiq-leases: " + printable(_redact_urls(" ".join(text.split()))) + "\n")


def _exporter(leases: Leases, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``exporter``: a bind that fails ends in one line."""
    from ..exporter.server import ListenError  # prometheus_client: only for the exporter

    try:
        return cmd_exporter(leases, args, out)
    except ListenError as e:  # an environment error, not a usage one: the same flags may work elsewhere
        _fail(err, str(e))
        return EXIT_CANNOT_LISTEN


def _open(url: str, args: argparse.Namespace, err: TextIO) -> Leases | int:
    """The lease store at ``url``, or the exit code of why it cannot be used (said on ``err``)."""
    try:
        return Leases.from_url(url, prefix=args.prefix or DEFAULT_PREFIX)
    except LeaseUnavailableError as e:  # a cluster URL: its seed node is asked for the cluster's nodes at once
        _fail(err, f"cannot use Redis at {redact_url(url)}: {e}")
        return EXIT_UNREACHABLE
    except LeaseURLError as e:
        _fail(err, f"invalid --redis-url {redact_url(url)!r}: {e}")
        return EXIT_USAGE
    except LeaseError as e:  # an invalid --prefix
        _fail(err, str(e))
        return EXIT_USAGE


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
    if not getattr(args, "json", False):
        # Behind the escaping of each field (render.py): no raw control character reaches the terminal.
        out = cast(TextIO, PrintableWriter(out))
    try:
        if args.command == "demo":
            try:
                validate_prefix(args.prefix or DEFAULT_PREFIX)
            except LeaseError as e:
                _fail(err, str(e))
                return EXIT_USAGE
            return cmd_demo(args)
        url = args.redis_url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
        leases = _open(url, args, err)
        if isinstance(leases, int):
            return leases
        try:
            args.url = url  # for the exporter's `show` commands
            if args.command == "exporter":
                return _exporter(leases, args, out, err)
            command = {
                "list": cmd_list,
                "ls": cmd_list,
                "show": cmd_show,
                "release": cmd_release,
                "exporter": cmd_exporter,
            }[args.command]
            return command(leases, args, out)
        except LeaseUnavailableError as e:
            _fail(err, f"cannot use Redis at {redact_url(url)}: {e}")
            return EXIT_UNREACHABLE
        except RefusedError as e:
            _fail(err, str(e))
            return EXIT_REFUSED
        except NotFoundError as e:
            _fail(err, str(e))
            return EXIT_NOT_FOUND
        except LeaseError as e:  # an invalid key
            _fail(err, str(e))
            return EXIT_USAGE
        finally:
            leases.client.close()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
