"""Worker "hosts" in network namespaces, each linked to the root namespace by a veth pair, and partitions.

A :class:`Host` is a network namespace whose only way out is one veth pair with a /30 subnet of its own:
the root side (``host_ip``) is where the root namespace's servers (Redis) are reached from inside. Run a
command in it with :meth:`Host.argv` (``ip netns exec``).

:meth:`Host.partition` makes every packet between the host and the root namespace vanish, both ways:
a ``blackhole`` qdisc on each end of the pair swallows whatever is sent (the sender is told it went
out), so clients see timeouts, never a refusal, as in a real partition. Neighbour entries are static,
so no ARP request goes unanswered (a failed ARP resolution would turn later connects into an immediate
"no route to host"). :meth:`Host.heal` removes both qdiscs; TCP retransmissions then get through.
(``netem`` and ``iptables`` are not required: this kernel has neither, but ``blackhole`` is built in.)

Names carry the creating process's pid (``dlp<pid>-<n><label>``, interfaces with a final ``h``/``n``
for their root or namespace side), so :func:`sweep` can remove what a crashed earlier run left behind
without touching the networks of a run still alive. :class:`Network` deletes its namespaces and links
on close, whatever happened, and ends the processes still inside them (ours: they were started there).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

PREFIX = "dlp"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
#: Where the /30 subnets come from: 16 384 of them, picked from the pid and skipped while in use.
POOL = ipaddress.IPv4Network("10.213.0.0/16")
_serial = itertools.count()


class NetnsUnavailableError(RuntimeError):
    """Network namespaces, veth pairs or the blackhole qdisc cannot be used here (not root, no iproute2...)."""


def _run(argv: list[str], *, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
    return proc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def _namespaces() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    proc = _run(["ip", "-o", "link", "show"], check=False)
    # "12: dlp123-0ah@if11: <...>": the name ends at "@" (a veth's peer) or ":".
    return [
        re.split(r"[@:]", line.split(": ", 1)[1], maxsplit=1)[0] for line in proc.stdout.splitlines() if ": " in line
    ]


def _kill_inside(netns: str) -> None:
    """SIGKILL the processes still in ``netns`` (started there by the run that created it), by pid."""
    proc = _run(["ip", "netns", "pids", netns], check=False)
    for pid in (int(p) for p in proc.stdout.split() if p.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def sweep() -> list[str]:
    """Delete the namespaces and links of this module whose creating process is gone; return their names."""
    removed = []
    for netns in _namespaces():
        owner = _owner(netns)
        if owner is not None and not _alive(owner):
            _kill_inside(netns)
            _run(["ip", "netns", "del", netns], check=False)
            removed.append(netns)
    for link in _links():
        owner = _owner(link)
        if owner is not None and not _alive(owner):
            _run(["ip", "link", "del", link], check=False)
            removed.append(link)
    return removed


def _used_addresses() -> list[ipaddress.IPv4Interface]:
    proc = _run(["ip", "-4", "-o", "addr", "show"], check=False)
    out = []
    for line in proc.stdout.splitlines():
        words = line.split()
        if "inet" in words:
            out.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]))
    return out


def _free_subnets(count: int, seed: int) -> list[ipaddress.IPv4Network]:
    used = _used_addresses()
    subnets = list(POOL.subnets(new_prefix=30))
    picked: list[ipaddress.IPv4Network] = []
    for i in range(len(subnets)):
        subnet = subnets[(seed + i) % len(subnets)]
        if not any(address.network.overlaps(subnet) for address in used):
            picked.append(subnet)
            if len(picked) == count:
                return picked
    raise NetnsUnavailableError(f"no free /30 subnet left in {POOL}")


def _mac(argv_prefix: list[str], link: str) -> str:
    [info] = json.loads(_run([*argv_prefix, "ip", "-j", "link", "show", "dev", link]).stdout)
    return str(info["address"])


@dataclass
class Host:
    """One network namespace linked to the root namespace by a veth pair."""

    label: str
    netns: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str
    cut_at: float | None = None

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def partition(self) -> float:
        """Make every packet between this host and the root namespace vanish; returns when (``time.time()``)."""
        _run(["tc", "qdisc", "replace", "dev", self.host_if, "root", "blackhole"])
        _run(self.argv(["tc", "qdisc", "replace", "dev", self.ns_if, "root", "blackhole"]))
        self.cut_at = time.time()
        return self.cut_at

    def settled(self, port: int) -> bool:
        """Whether Redis (``host_ip:port``) has received all this host sent it: no connection of the host to it
        has unacknowledged data, or is being opened or closed.

        After a heal, TCP retransmits what was sent during the partition, on its own backoff (seconds): a
        command a client already gave up on can still reach Redis and run then (a broker's fetch, taking a
        message that nobody will receive). Once settled, nothing sent during the partition is still on its way.
        """
        out = _run(self.argv(["ss", "-Htn", "state", "all", "dst", self.host_ip])).stdout
        busy = {"SYN-SENT", "FIN-WAIT-1", "CLOSING", "LAST-ACK"}
        for line in out.splitlines():
            state, _recv_q, send_q, _local, peer = line.split()[:5]
            if peer.rsplit(":", 1)[-1] == str(port) and (state in busy or send_q != "0"):
                return False
        return True

    def heal(self) -> float:
        """Let packets through again (idempotent); returns when (``time.time()``)."""
        _run(["tc", "qdisc", "del", "dev", self.host_if, "root"], check=False)
        _run(self.argv(["tc", "qdisc", "del", "dev", self.ns_if, "root"]), check=False)
        self.cut_at = None
        return time.time()


class Network:
    """Hosts in namespaces, one veth pair and /30 subnet each; everything is removed on :meth:`close`.

    Raises :class:`NetnsUnavailableError` (from the constructor) when namespaces cannot be made here.
    """

    def __init__(self, labels: tuple[str, ...] = ("a", "b")) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailableError("network namespaces need root")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NetnsUnavailableError(f"{tool!r} (iproute2) is not installed")
        sweep()
        self.hosts: dict[str, Host] = {}
        self._created_ns: list[str] = []
        self._created_links: list[str] = []
        pid, serial = os.getpid(), next(_serial) % 100
        try:
            subnets = _free_subnets(len(labels), seed=pid * 8 + serial * len(labels))
            for label, subnet in zip(labels, subnets):
                self.hosts[label] = self._create(f"{PREFIX}{pid}-{serial}{label}", label, subnet)
        except BaseException as e:
            self.close()
            if isinstance(e, subprocess.CalledProcessError):
                raise NetnsUnavailableError(f"{' '.join(e.cmd)} failed: {(e.stderr or '').strip()}") from e
            raise

    def _create(self, base: str, label: str, subnet: ipaddress.IPv4Network) -> Host:
        host_ip, ns_ip = (str(address) for address in subnet.hosts())
        netns, host_if, ns_if = base, f"{base}h", f"{base}n"
        _run(["ip", "netns", "add", netns])
        self._created_ns.append(netns)
        _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if])
        self._created_links.append(host_if)
        _run(["ip", "link", "set", ns_if, "netns", netns])
        host = Host(label, netns, host_if, ns_if, host_ip, ns_ip)
        inside = ["ip", "netns", "exec", netns]
        _run(["ip", "addr", "add", f"{host_ip}/30", "dev", host_if])
        _run(["ip", "link", "set", host_if, "up"])
        _run([*inside, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if])
        _run([*inside, "ip", "link", "set", ns_if, "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])
        # Static neighbours: a partition must not turn into failed ARP lookups (fast "no route to host").
        _run(["ip", "neigh", "replace", ns_ip, "lladdr", _mac(inside, ns_if), "dev", host_if, "nud", "permanent"])
        _run(
            [*inside, "ip", "neigh", "replace", host_ip, "lladdr", _mac([], host_if), "dev", ns_if, "nud", "permanent"]
        )
        # Fail here, not mid-test, if the qdisc that makes partitions is missing.
        _run(["tc", "qdisc", "replace", "dev", host_if, "root", "blackhole"])
        _run(["tc", "qdisc", "del", "dev", host_if, "root"])
        return host

    def __getitem__(self, label: str) -> Host:
        return self.hosts[label]

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def heal_all(self) -> None:
        for host in self.hosts.values():
            host.heal()

    def close(self) -> None:
        """Heal, end what still runs inside, delete the namespaces and links. Idempotent; never raises."""
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                host.heal()
        # Deleting the root side deletes its peer at once (a namespace's links go only once it is freed).
        for link in self._created_links:
            with contextlib.suppress(Exception):
                _run(["ip", "link", "del", link], check=False)
        for netns in self._created_ns:
            with contextlib.suppress(Exception):
                _kill_inside(netns)
                _run(["ip", "netns", "del", netns], check=False)
        self._created_ns.clear()
        self._created_links.clear()


def leftovers() -> list[str]:
    """Namespaces and links of this module that exist now (any owner)."""
    return [name for name in [*_namespaces(), *_links()] if _owner(name) is not None]
