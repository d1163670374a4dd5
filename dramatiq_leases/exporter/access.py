"""Who may read what the exporter serves: one access system, the web configuration.

``--web.config.file`` (:mod:`.webconfig`, exporter-toolkit's format) protects every path, in front of
the routes: basic auth or verified client certificates, over TLS. What it lets through, or what reaches
an endpoint without one, is served as follows. ``/metrics`` (no lease key in it) to every request. The
lease views (``/leases``, ``/busy``, ``/leases/history``: they show lease keys, which may name people)
to a request the web configuration authenticated; else on a loopback bind (this host only); else only
with :data:`OPEN_FLAG`, given deliberately, and 403 otherwise, saying how to serve them. The table of
these rules is in docs/guide.md, "Protecting the exporter".
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .webconfig import AUTHENTICATED, WebConfig

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

#: The one flag that serves the lease views, unauthenticated, on a bind that is not the loopback.
OPEN_FLAG = "--open-lease-views"

#: A refusal: the status and the JSON body of the answer.
Refusal = tuple[str, dict[str, Any]]


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(address: str) -> bool:
    """Whether a bound address (as ``server_address[0]`` gives it) accepts connections from this host only."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # no IPv6 zone
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def authenticates(web_config: WebConfig | None) -> bool:
    """Whether ``web_config`` authenticates anyone: basic auth users, or verified client certificates."""
    return web_config is not None and bool(web_config.users or web_config.verifies_clients)


@dataclass(frozen=True)
class Access:
    """Who may read the lease views.

    Attributes:
      open_lease_views: serve them to unauthenticated requests on any bind (:data:`OPEN_FLAG`).
      bound: the address the endpoint listens on, as ``host:port`` (set when it is bound).
      loopback: whether ``bound`` is a loopback address; until it is bound, it counts as not.
    """

    open_lease_views: bool = False
    bound: str = "an unknown address"
    loopback: bool = False

    def refusal(self, environ: WSGIEnvironment) -> Refusal | None:
        """Why this request may not read the lease views, or ``None`` if it may."""
        if environ.get(AUTHENTICATED) or self.loopback or self.open_lease_views:
            return None
        return (
            "403 Forbidden",
            {
                "error": "forbidden",
                "detail": "The lease views (/leases, /busy, /leases/history) show lease keys, which may carry "
                "personal data, so they are served only to requests --web.config.file authenticates or on a "
                f"loopback bind, and this exporter listens on {self.bound}. To serve them here, start the "
                "exporter with --web.config.file FILE (basic_auth_users or client certificates: every path "
                f"then needs them) or, on a network only trusted readers reach, {OPEN_FLAG}. --mask-keys "
                "shows keys as digests. /metrics needs neither.",
            },
        )

    def describe(self, web_config: WebConfig | None) -> tuple[int, str]:
        """The log level and the words of the start-up line saying who gets the lease views."""
        if web_config is not None and web_config.users:  # no request passes unauthenticated
            return logging.INFO, f"served to requests authenticated by --web.config.file {web_config.path}"
        who = (
            [f"holders of a client certificate --web.config.file {web_config.path} verifies"]
            if (authenticates(web_config) and web_config is not None)
            else []
        )
        if self.open_lease_views:
            return logging.WARNING, "served to " + " and ".join(
                [*who, f"anyone who reaches {self.bound} ({OPEN_FLAG})"]
            )
        if self.loopback:
            return logging.INFO, "served to " + " and ".join([*who, f"this host only (the loopback bind {self.bound})"])
        if who:
            return logging.INFO, f"served to {who[0]} only, on the non-loopback bind {self.bound}"
        return logging.WARNING, (
            f"refused (403) on the non-loopback bind {self.bound}: start the exporter with --web.config.file "
            f"FILE (basic_auth_users or client certificates) or {OPEN_FLAG} to serve them there"
        )
