"""Two simulated hosts with their own network stacks: network namespaces joined by a veth pair.

    with two_hosts() as hosts:
        hosts[0].address  # "10.200.0.1", on interface hosts[0].interface inside namespace hosts[0].namespace
        start_node(..., master_addr=hosts[0].address, prefix=hosts[0].prefix, env=...GLOO_SOCKET_IFNAME=...)

Only what this module creates is touched: two namespaces and one veth pair named after this
process id, with 10.200.0.1/24 and 10.200.0.2/24 inside the namespaces (nothing on the host's
own interfaces or routes); everything is deleted on exit. `prefix` runs a command inside a
host's namespace under its own host name (a UTS namespace), so each rank's gethostname()
differs as on two machines. Needs root and iproute2; `unavailable()` says why not when it can't.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.200.0.{}/24"


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    interface: str
    address: str

    @property
    def prefix(self) -> tuple:
        """Command prefix: run inside this host's network namespace with host name `name`."""
        return (
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.name,
        )


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"mmprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"ip netns add failed: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def set_link(host: Host, up: bool) -> None:
    """Bring a host's end of the veth pair up or down (down: its packets stop, no connection is reset)."""
    _ip("-n", host.namespace, "link", "set", host.interface, "up" if up else "down")


@contextmanager
def two_hosts():
    tag = f"mm{os.getpid()}"
    hosts = [Host(f"node{i}", f"{tag}n{i}", f"{tag}v{i}", SUBNET.format(i + 1).split("/")[0]) for i in range(2)]
    made = []
    try:
        for h in hosts:
            _ip("netns", "add", h.namespace)
            made.append(h.namespace)
        _ip(
            "link",
            "add",
            hosts[0].interface,
            "netns",
            hosts[0].namespace,
            "type",
            "veth",
            "peer",
            "name",
            hosts[1].interface,
            "netns",
            hosts[1].namespace,
        )
        for i, h in enumerate(hosts):
            _ip("-n", h.namespace, "addr", "add", SUBNET.format(i + 1), "dev", h.interface)
            _ip("-n", h.namespace, "link", "set", "lo", "up")
            set_link(h, True)
        yield hosts
    finally:
        for namespace in made:  # deleting a namespace deletes its end of the veth pair, hence the pair
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
