"""Which network interface a worker's process group uses, on hosts whose hostname resolves to a loopback address.

Gloo (and NCCL's bootstrap) pick the address a rank announces to the others from the machine's hostname. Where
/etc/hosts maps the hostname to 127.0.0.1 or 127.0.1.1 (stock Ubuntu, many cloud and container images), every rank
announces a loopback address, and ranks on other nodes connect to their own loopback: "connectFullMesh failed ...
Connection refused". Ray knows each node's real address (its node IP), so each worker binds its process group to
the interface holding it, before the group starts:

    bind_process_group(node_ip)   # sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME when the hostname is loopback

Settings a user made (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) are kept. Ray-free: psutil lists the interfaces.
"""
from __future__ import annotations

import ipaddress
import os
import socket

IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class ProcessGroupNetworkError(RuntimeError):
    """A worker cannot take part in a multi-node process group; the message names the node and the fix."""


def hostname_address() -> str | None:
    """The address this machine's hostname resolves to, or None when it does not resolve."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def is_loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The name of the interface holding `address` (IPv4 or IPv6), or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def bind_process_group(node_ip: str) -> str | None:
    """Before the process group starts, in each worker: when the hostname resolves to a loopback address (or to
    nothing) but the node's IP is not a loopback one, bind Gloo and NCCL to the interface holding the node IP.
    Returns the interface chosen, None when nothing needed changing. Raises ProcessGroupNetworkError when no
    interface holds the node IP (the group could only fail, with a Gloo traceback)."""
    resolved = hostname_address()
    if not (resolved is None or is_loopback(resolved)) or is_loopback(node_ip):
        return None  # the hostname gives a reachable address, or every rank is on this one machine anyway
    if all(os.environ.get(name) for name in IFNAME_ENVS):
        return None
    iface = interface_of(node_ip)
    if iface is None:
        host = socket.gethostname()
        raise ProcessGroupNetworkError(
            f"node {node_ip}: its hostname {host!r} resolves to {resolved or 'nothing'}, and no interface of this "
            f"machine holds Ray's node IP {node_ip}, so the other workers could not reach this one's process group; "
            f"map {host} to this node's reachable address in /etc/hosts, or set GLOO_SOCKET_IFNAME (NCCL: "
            f"NCCL_SOCKET_IFNAME) on every node to the interface the nodes reach each other on")
    for name in IFNAME_ENVS:
        os.environ.setdefault(name, iface)
    return iface
