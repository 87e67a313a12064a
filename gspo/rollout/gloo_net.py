"""Which local address gloo binds to when its peer is on another machine.

gloo's default device binds to the address this machine's host name resolves to. Many hosts
map their own name to a loopback address (Debian and Ubuntu write ``127.0.1.1 HOSTNAME`` into
``/etc/hosts``; containers often ``127.0.0.1``). gloo then tells a peer on another machine to
connect to that loopback address, and the connection fails ("Connection refused", then
"Gloo connectFullMesh failed"). torch's own remedy is ``GLOO_SOCKET_IFNAME``: the interface to
bind to. The helpers here find the local address on the route to a peer and the interface that
holds it, so that gspo can bind there itself whenever the user has not named an interface:

- the link between a trainer and a ``gspo engine`` (:mod:`gspo.rollout.remote_engine`) builds
  its gloo groups on a device bound to that address;
- a torchrun trainer whose ``MASTER_ADDR`` is another machine sets ``GLOO_SOCKET_IFNAME`` to
  the interface on the route to it before it joins its process group
  (:func:`gspo.trainer.distributed.init_from_env`).

Tested between network namespaces of one machine (separate network stacks joined by virtual
Ethernet links, host name resolving to 127.0.0.1 in each): ``tests/trainer/test_network_hosts.py``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

IFNAME = "GLOO_SOCKET_IFNAME"


def route_source(host: str) -> str | None:
    """This machine's address on the route to ``host`` (a name or an address), or None when
    ``host`` does not resolve or no route leads there. A UDP socket connected to it picks the
    route; nothing is sent."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` on this machine (Linux), or
    None."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:  # address (32 hex digits) ... name
                for line in f:
                    fields = line.split()
                    if fields and int(fields[0], 16) == int(ip):
                        return fields[-1]
        except OSError:
            return None
        return None
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR: the interface's IPv4
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(got[20:24]) == str(ip):
                return name
    return None


def device_towards(host: str) -> Any:
    """A gloo device bound to this machine's address on the route to ``host`` (the peer's
    address, or this process's own listening address), or None to keep gloo's default device:
    when ``GLOO_SOCKET_IFNAME`` names the interface, or when no route to ``host`` is found."""
    import torch.distributed as dist

    if os.environ.get(IFNAME):
        return None
    source = route_source(host)
    if source is None:
        return None
    return dist.ProcessGroupGloo.create_device(hostname=source)


def interface_towards_master(environ: dict[str, str] | None = None) -> str | None:
    """The interface a torchrun rank's gloo group should bind to, when gloo's default may not
    reach the other machines: the one on the route to ``MASTER_ADDR``. None when the user named
    one (``GLOO_SOCKET_IFNAME``), when there is no ``MASTER_ADDR``, or when it lies on this
    machine's loopback (one machine: gloo's default serves)."""
    env = os.environ if environ is None else environ
    master = env.get("MASTER_ADDR")
    if env.get(IFNAME) or not master:
        return None
    source = route_source(master)
    if source is None or is_loopback(source):
        return None
    return interface_of(source)
