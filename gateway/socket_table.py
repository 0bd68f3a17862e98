"""The kernel's table of TCP connections (/proc/net/tcp and tcp6), read for the gateway.

The demand meter counts the tunnels Squid holds open to the router with it
(gateway/demand.py): Squid writes a tunnel's access log line only when it
ends, so the kernel's table is what says which are open now.

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
    for local_field, remote_field in _rows(tables):
        local, remote = _end(local_field), _end(remote_field)
        if local is not None and remote is not None:
            yield (*local, *remote)


def _rows(tables: Iterable[Path]) -> Iterator[tuple[str, str]]:
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=4)
            if len(fields) > 3 and fields[3] == ESTABLISHED:
                yield fields[1], fields[2]


def _host_order(packed: bytes) -> bytes:
    """Each 32-bit word of `packed` swapped on a little-endian host (its own inverse)."""
    words = [packed[i : i + 4] for i in range(0, len(packed), 4)]
    return b"".join(w[::-1] if sys.byteorder == "little" else w for w in words)


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
    return unmapped(ipaddress.ip_address(_host_order(raw))), number


def unmapped(address: Address) -> Address:
    """An IPv4-mapped IPv6 address as the IPv4 address it maps; any other as it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
