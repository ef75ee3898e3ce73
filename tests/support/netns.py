"""Hosts on one machine: Linux network namespaces joined by a bridge that only they share.

Why namespaces: a GPU host that drops off the network, or dies, must be a real host to the control plane
(its TCP connections go silent, its heartbeats stop), not a process we signal. Each `Network` has a switch
namespace holding the bridge, one namespace per host with a veth into the bridge, and one veth into the
test's own (root) namespace, the observer, so that the test reads Postgres and Redis of the control host
like an operator would. The bridge lives in its own namespace because the root namespace of a machine
with Docker forwards no bridged traffic (FORWARD DROP with br_netfilter).

Addresses come from 198.18.0.0/15 (reserved for benchmarking), one /24 per network chosen so it clashes
with no address of the root namespace; nothing is routed out of it, so no traffic leaves the machine.
Names start with `anb` + a 6-hex id; a marker file names the owning pytest process, and `sweep_leftovers`
removes the namespaces and links of owners that are gone (a crashed run), never those of a live run.

Faults: `partition(host)` sets the host's port on the bridge down (both sides see silent drops, as with a
cut cable), `heal(host)` sets it up, `lose(host)` SIGKILLs every process in the host's namespace.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "anb"
_NS_RE = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})-")
_LINK_RE = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})o$")
MARKERS = Path(tempfile.gettempdir()) / "animastor-netns"
CONTROL_DATA = "animastor-control-"  # + `anb<id>-…`: the control host's data directories (netns_services.py)
BENCHMARK_NET = ipaddress.IPv4Network("198.18.0.0/15")


class NetnsError(RuntimeError):
    """An `ip` command failed: its command line and stderr."""


def ip(*args: str, check: bool = True, timeout: float = 20.0) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be built here (not root, no `ip`, namespaces refused), or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}{secrets.token_hex(3)}-probe"
    try:
        ip("netns", "add", probe)
    except (NetnsError, OSError, subprocess.SubprocessError) as err:
        return f"`ip netns add` is not allowed here: {err}"
    ip("netns", "del", probe, check=False)
    return None


def namespace_pids(ns: str) -> list[int]:
    out = ip("netns", "pids", ns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in `ns` until none is left (a process may fork while we kill)."""
    deadline = time.monotonic() + timeout
    while pids := namespace_pids(ns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} of namespace {ns} survive SIGKILL")
        time.sleep(0.05)


def _owner_alive(net_id: str) -> bool:
    try:
        pid = int((MARKERS / net_id).read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers() -> list[str]:
    """Remove namespaces and observer links of networks whose owning process is gone; what was removed."""
    removed: list[str] = []
    names = [line.split()[0] for line in ip("netns", "list", check=False).splitlines() if line.strip()]
    for ns in names:
        match = _NS_RE.match(ns)
        if match and not _owner_alive(match.group(1)):
            kill_namespace(ns)
            ip("netns", "del", ns, check=False)
            removed.append(ns)
    for line in ip("-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        match = _LINK_RE.match(name)
        if match and not _owner_alive(match.group(1)):
            ip("link", "del", name, check=False)
            removed.append(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{CONTROL_DATA}{PREFIX}*"):
        match = re.match(rf"{CONTROL_DATA}{PREFIX}([0-9a-f]{{6}})-", folder.name)
        if match and not _owner_alive(match.group(1)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    if MARKERS.is_dir():
        for marker in MARKERS.iterdir():
            if not _owner_alive(marker.name):
                marker.unlink(missing_ok=True)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 that no address of the root namespace is in (other runs hold theirs)."""
    used: set[ipaddress.IPv4Address] = set()
    for line in ip("-o", "-4", "addr", "show", check=False).splitlines():
        found = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", line)
        if found:
            used.add(ipaddress.IPv4Address(found.group(1)))
    subnets = list(BENCHMARK_NET.subnets(new_prefix=24))
    for index in secrets.SystemRandom().sample(range(len(subnets)), len(subnets)):
        if not any(address in subnets[index] for address in used):
            return subnets[index]
    raise NetnsError("no free /24 left in 198.18.0.0/15")


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its address on the bridge and its port (in the switch namespace)."""

    name: str
    ns: str
    address: str
    port: str

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace (`ip netns exec` execs it: same pid, same process group)."""
        return ["ip", "netns", "exec", self.ns, *argv]


class Network:
    """A bridge, the hosts on it and the observer link; `close()` removes all of it, processes first."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(3)
        self.switch = f"{PREFIX}{self.id}-sw"
        self.observer_link = f"{PREFIX}{self.id}o"
        self.hosts: dict[str, Host] = {}
        self.partitioned: set[str] = set()
        MARKERS.mkdir(parents=True, exist_ok=True)
        (MARKERS / self.id).write_text(str(os.getpid()))
        self.subnet = _free_subnet()
        self._addresses = iter(self.subnet.hosts())
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            self.observer = str(next(self._addresses))
            ip("link", "add", self.observer_link, "type", "veth", "peer", "name", "observer", "netns", self.switch)
            ip("-n", self.switch, "link", "set", "observer", "master", "br0", "up")
            ip("addr", "add", f"{self.observer}/24", "dev", self.observer_link)
            ip("link", "set", self.observer_link, "up")
        except BaseException:
            self.close()
            raise

    def add_host(self, name: str) -> Host:
        """A namespace `<id>-<name>` with loopback up and `eth0` on the bridge at the next address."""
        if not re.fullmatch(r"[a-z0-9]{1,10}", name) or name in self.hosts or name == "sw":
            raise ValueError(f"bad or duplicate host name {name!r}")
        host = Host(name, f"{PREFIX}{self.id}-{name}", str(next(self._addresses)), f"p-{name}")
        self.hosts[name] = host
        ip("netns", "add", host.ns)
        ip("-n", host.ns, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.ns, "link", "set", "eth0", "up")
        return host

    # -- faults -------------------------------------------------------------------------------------------------
    def partition(self, host: Host) -> None:
        ip("-n", self.switch, "link", "set", host.port, "down")
        self.partitioned.add(host.name)

    def heal(self, host: Host) -> None:
        ip("-n", self.switch, "link", "set", host.port, "up")
        self.partitioned.discard(host.name)

    def heal_all(self) -> None:
        for name in list(self.partitioned):
            self.heal(self.hosts[name])

    def pids(self, host: Host) -> list[int]:
        return namespace_pids(host.ns)

    def lose(self, host: Host) -> None:
        """Host loss: every process of the namespace SIGKILLed at once (its links stay as they are)."""
        kill_namespace(host.ns)

    # -- teardown -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process of every namespace, delete the namespaces (their links go with them) and the
        observer link; each step runs even when an earlier one failed."""
        errors: list[str] = []
        for ns in [*(h.ns for h in self.hosts.values()), self.switch]:
            try:
                kill_namespace(ns)
            except NetnsError as err:
                errors.append(str(err))
            ip("netns", "del", ns, check=False)
        ip("link", "del", self.observer_link, check=False)
        (MARKERS / self.id).unlink(missing_ok=True)
        left = [ns for ns in ip("netns", "list", check=False).split() if ns.startswith(f"{PREFIX}{self.id}-")]
        if left or errors:
            raise NetnsError(f"network {self.id} not fully removed: namespaces {left}; {errors}")
