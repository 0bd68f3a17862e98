"""The kernel's table of TCP connections (/proc/net/tcp and tcp6), read for the gateway.

Two readers: the demand meter counts the client connections the front holds
(gateway/demand.py), and the tunnel-limit helper checks which tunnels it
admitted are still open (gateway/tunnel_helper.py). Standard library only:
the helper runs under Squid's user with whatever python3 the system has.

Each row gives its local and remote ends as hex (an IPv4 address as one
32-bit word, an IPv6 address as four, each word in the host's byte order),
then the state; ESTABLISHED is "01".
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
ESTABLISHED = "01"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# A connection's (local address, local port, remote address, remote port).
Connection = tuple[Address, int, Address, int]


def established(tables: Iterable[Path] = TCP_TABLES) -> Iterator[Connection]:
    """Every ESTABLISHED connection of this network namespace, as this end sees it.

    An IPv4 client of an IPv6 socket (`::ffff:a.b.c.d`) is given as IPv4, as
    are both ends of its connection, so one connection reads the same from
    either table. A table that cannot be read (no IPv6 here, say) is skipped.
    """
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == ESTABLISHED:
                local, remote = _end(fields[1]), _end(fields[2])
                if local is not None and remote is not None:
                    yield (*local, *remote)


def _end(field: str) -> tuple[Address, int] | None:
    """`ADDRESS:PORT` as the kernel writes it, decoded; None if it is not one."""
    address, _, port = field.rpartition(":")
    try:
        raw = bytes.fromhex(address)
        number = int(port, 16)
    except ValueError:
        return None
    if len(raw) not in (4, 16):
        return None
    # Each 32-bit word is in host order: swap it on a little-endian host.
    words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    packed = b"".join(w[::-1] if sys.byteorder == "little" else w for w in words)
    return unmapped(ipaddress.ip_address(packed)), number


def unmapped(address: Address) -> Address:
    """An IPv4-mapped IPv6 address as the IPv4 address it maps; any other as it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def local_address(host: str) -> Address | None:
    """The address `host` names, to match a connection's local end by; None for any:
    no host, a wildcard, or not an address."""
    try:
        address = unmapped(ipaddress.ip_address(host))
    except ValueError:
        return None
    return None if address.is_unspecified else address
