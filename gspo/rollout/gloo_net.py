"""Which local address gloo binds to when its peer is on another machine.

gloo's default device binds to the address this machine's host name resolves to. Many hosts
map their own name to a loopback address (Debian and Ubuntu write ``127.0.1.1 HOSTNAME`` into
``/etc/hosts``; containers often ``127.0.0.1``). gloo then tells a peer on another machine to
connect to that loopback address, and the connection fails ("Connection refused", then
"Gloo connectFullMesh failed"). torch's own remedy is ``GLOO_SOCKET_IFNAME``: the interface to
bind to. The helpers here find the local address on the route to a peer and the interface that
holds it, so that gspo can bind there itself whenever the user has not named an interface:

- the link between a trainer and a ``gspo engine`` (:mod:`gspo.rollout.remote_engine`) builds
  its gloo groups on a device bound to that address (at a ``file://`` address, which names no
  peer, each end's address as other machines reach it);
- a torchrun trainer whose world spans machines sets ``GLOO_SOCKET_IFNAME`` to the interface
  on the route to ``MASTER_ADDR`` before it joins its process group
  (:func:`gspo.trainer.distributed.init_from_env`);
- where ``GLOO_SOCKET_IFNAME`` names one interface, the engine link binds to an address of
  that interface that it chooses itself, so that the other end can bind in the same family
  (:func:`bind_source`).

A name that resolves to loopback on this machine (the master's own name, with the line above)
names this machine as the others reach it: then the address is the source of the default
route (IPv4's, else IPv6's), or the one interface other than loopback (:func:`outward_address`).

Tested between network namespaces of one machine (separate network stacks joined by virtual
Ethernet links, each host's own name on 127.0.1.1), over IPv4, over IPv6 only, and on
hosts with both whose names resolve to IPv6: ``tests/trainer/test_network_hosts.py``.
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


def _names_loopback(host: str) -> bool:
    """Whether ``host`` itself says loopback (127.x, ::1, localhost), rather than resolving
    there on this machine (a host name that /etc/hosts maps to 127.0.1.1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() in ("localhost", "localhost.localdomain")


def is_this_machine(host: str) -> bool | None:
    """Whether ``host`` resolves to an address of this machine (one a socket can bind to,
    loopback included); None when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def interface_addresses() -> dict[str, str]:
    """Each network interface's IPv4 address (Linux; interfaces without one left out)."""
    import fcntl
    import struct

    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
            except OSError:
                continue
            out[name] = socket.inet_ntoa(got[20:24])
    return out


def interface_addresses6() -> dict[str, str]:
    """Each network interface's first global IPv6 address (Linux, from ``/proc/net/if_inet6``;
    link-local and loopback ones, which need a scope or stay on this machine, left out)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/net/if_inet6") as f:  # address, index, prefix, scope, flags, name
            for line in f:
                fields = line.split()
                if len(fields) == 6 and int(fields[3], 16) == 0:  # scope 0: global
                    out.setdefault(fields[5], str(ipaddress.IPv6Address(int(fields[0], 16))))
    except OSError:
        pass
    return out


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
    return next((n for n, a in interface_addresses().items() if a == str(ip)), None)


def outward_address() -> str | None:
    """This machine's address as other machines reach it, as far as can be told here: the
    source of the default route (IPv4's, else IPv6's on a host without an IPv4 one), else the
    address of the one interface other than loopback (its IPv4 address, else its global IPv6
    one); None when none of these settles it."""
    for probe in ("192.0.2.1", "2001:db8::1"):  # TEST-NET-1, IPv6's documentation prefix:
        source = route_source(probe)  # on no local network, so each family's default route
        if source is not None and not is_loopback(source):
            return source
    v4 = {n: a for n, a in interface_addresses().items() if not is_loopback(a)}
    v6 = interface_addresses6()
    names = set(v4) | set(v6)
    if len(names) != 1:
        return None
    name = names.pop()
    return v4.get(name) or v6[name]


def reachable_source(host: str) -> str | None:
    """The local address to bind to for a link to ``host``: the source of the route to it;
    when a name (not a loopback address) resolves to loopback here, as a machine's own name
    often does, this machine is the one other machines reach by that name, so its outward
    address (:func:`outward_address`)."""
    source = route_source(host)
    if source is not None and is_loopback(source) and not _names_loopback(host):
        return outward_address() or source
    return source


def bind_source(host: str) -> str | None:
    """The address a gloo device for a link to ``host`` binds to, or None to keep gloo's
    default device.

    - No ``GLOO_SOCKET_IFNAME``: :func:`reachable_source`.
    - ``GLOO_SOCKET_IFNAME`` naming one interface (the user's, or the one a torchrun trainer
      set for its world, :func:`interface_towards_master`): that interface's address in the
      family of the route to ``host``, else its other one. gloo's own device for the name
      binds to the interface's first address, usually its IPv4 one. A peer that binds towards
      this end's IPv6 address could then not connect (gloo needs one family at both ends),
      and a peer cannot tell which one gloo took.
    - None for a list of interfaces (gloo's default device uses them all), for an interface
      this machine does not have, or when no address is found.
    """
    named = os.environ.get(IFNAME)
    if not named:
        return reachable_source(host)
    if "," in named:
        return None
    v4, v6 = interface_addresses().get(named), interface_addresses6().get(named)
    source = route_source(host)
    six = source is not None and ipaddress.ip_address(source.split("%")[0]).version == 6
    return next((a for a in ((v6, v4) if six else (v4, v6)) if a), None)


def device_at(address: str | None) -> Any:
    """A gloo device bound to ``address``; None (gloo's default device) for None."""
    import torch.distributed as dist

    return None if address is None else dist.ProcessGroupGloo.create_device(hostname=address)


def device_towards(host: str) -> Any:
    """A gloo device bound to :func:`bind_source` of ``host`` (the peer's address, or this
    process's own listening address), or None to keep gloo's default device."""
    return device_at(bind_source(host))


def interface_towards_master(environ: dict[str, str] | None = None) -> str | None:
    """The interface a torchrun rank's gloo group should bind to when its world spans
    machines (``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``): the one holding
    :func:`reachable_source` of ``MASTER_ADDR`` (on the master's machine, its outward
    address). None when the user named one (``GLOO_SOCKET_IFNAME``), on one machine (gloo's
    default serves), or when no address is found."""
    env = os.environ if environ is None else environ
    master = env.get("MASTER_ADDR")
    world = int(env.get("WORLD_SIZE", "1"))
    if env.get(IFNAME) or not master or world <= int(env.get("LOCAL_WORLD_SIZE", world)):
        return None
    source = reachable_source(master)
    return None if source is None else interface_of(source)
