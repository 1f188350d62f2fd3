"""The network interface an EP group's gloo sockets use on CPU.

gloo binds its pair sockets to one interface (``GLOO_SOCKET_IFNAME``). Ranks on one host meet
on loopback; ranks on several hosts must use the interface that holds the address the
cluster knows the host by (Ray's node IP), which ``interface_of`` finds. Linux only
(``SIOCGIFADDR``), as the engine is.
"""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR = 0x8915


def interface_of(ip: str) -> str | None:
    """The name of the interface whose IPv4 address is ``ip``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(res[20:24]) == ip:
                return name
    return None


def gloo_interface(node_ip: str | None) -> str:
    """Where this rank's gloo sockets go: the interface of ``node_ip`` (the host's address in
    its cluster), loopback when there is none or it is not found."""
    return (interface_of(node_ip) if node_ip else None) or "lo"
