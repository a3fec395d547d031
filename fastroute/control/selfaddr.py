"""The addresses the router itself listens on, so a worker that is the router is refused.

A worker URL that points back at the router (its ``--port``, ``--prometheus-port``,
``--health-check-port`` or the supervisor's control listener) would make every request it is
picked for loop through the router again, each hop booking a lease, until the connections run
out. The registry asks :meth:`OwnAddresses.owner` before it queues a worker (IP literals and
``localhost``) and again when its handshake resolves a host name.

An address matches a listener when the ports are equal and the address reaches that socket: the
listener's own address, or any address of this host when the listener is bound to the
unspecified address (``0.0.0.0`` / ``::``). "This host" is loopback (127.0.0.0/8, ``::1``), the
unspecified address itself (connecting to ``0.0.0.0`` reaches the local host) and every
address of the host's interfaces, found by binding a UDP socket to it (only local addresses
bind). IPv4-mapped IPv6 addresses count as their IPv4 address.
"""

from __future__ import annotations

import ipaddress
import socket

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class SelfWorker(ValueError):
    """A worker URL that names one of the router's own listeners."""


def _canonical(ip: str) -> Address | None:
    try:
        a = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def is_local(a: Address) -> bool:
    """True when ``a`` is an address of this host (see the module docstring)."""
    if a.is_loopback or a.is_unspecified:
        return True
    family = socket.AF_INET6 if a.version == 6 else socket.AF_INET
    try:
        s = socket.socket(family, socket.SOCK_DGRAM)
    except OSError:
        return False
    try:
        s.bind((str(a), 0))
        return True
    except OSError:
        return False
    finally:
        s.close()


class OwnAddresses:
    """The router's listeners: (bound address, port, what it is)."""

    def __init__(self) -> None:
        self._listeners: list[tuple[Address, int, str]] = []

    def add(self, host: str, port: int, what: str) -> None:
        """Record a listener bound to ``host`` (as given to bind: a literal or a name) on ``port``."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            infos = []
        addrs = {_canonical(str(i[4][0])) for i in infos} - {None}
        if not addrs:  # could not resolve what we bound: assume every local address
            addrs = {ipaddress.IPv4Address("0.0.0.0")}
        for a in addrs:
            assert a is not None
            self._listeners.append((a, int(port), what))

    def owner(self, ip: str, port: int) -> str | None:
        """Which listener ``ip:port`` reaches (e.g. ``"--port 30000"``), or None."""
        a = _canonical(ip)
        if a is None:
            return None
        local: bool | None = None
        for bound, bport, what in self._listeners:
            if bport != port:
                continue
            if a == bound or (a.is_unspecified and is_local(bound)):
                return what
            if bound.is_unspecified:
                if local is None:
                    local = is_local(a)
                if local:
                    return what
        return None

    def check(self, url: str, addr: tuple[str, int] | None) -> None:
        """Raise :class:`SelfWorker` when ``addr`` (a worker's resolved address) is the router."""
        if addr is None:
            return
        what = self.owner(*addr)
        if what is not None:
            raise SelfWorker(
                f"worker URL {url} is this router itself ({what}, "
                f"reached at {addr[0]}:{addr[1]}); a worker must be another server"
            )
