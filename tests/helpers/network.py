"""Loopback ports for servers a test or benchmark starts."""

from __future__ import annotations

import itertools
import os
import random
import socket

from tests.helpers.xdist import worker_number

# Where free_port looks: below the kernel's ephemeral range (32768.. by default),
# so only an explicit bind can take a port between the check and the server's
# own bind. A port the kernel hands out for port 0 can meanwhile become the
# local end of any outgoing connection (the server then fails "address in
# use": seen in a loaded run). Clear of the local Squids' 21000..23999
# (tests/helpers/xdist.py), the benchmarks' 25000.. and the gateway's routers'
# 26000.. (gateway/squid.py).
LISTEN_PORTS = range(24000, 25000)
# Each test process walks the range from a place of its own (xdist worker N of
# M from N/M in), so a port comes round again in a process only after every
# other one has, and two processes meet only after hundreds of ports.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "6"))
_WORKER = worker_number()
_cursor = itertools.count(
    (random.randrange(_WORKERS) if _WORKER is None else _WORKER % _WORKERS)
    * len(LISTEN_PORTS)
    // _WORKERS
)


def free_port() -> int:
    """A TCP port on loopback that nothing holds right now, from LISTEN_PORTS.

    Not one this process was given lately (several may be taken before any
    is bound); a port still in TIME_WAIT does not bind here, so it is passed
    over.
    """
    for _ in LISTEN_PORTS:
        port = LISTEN_PORTS[next(_cursor) % len(LISTEN_PORTS)]
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {LISTEN_PORTS.start}..{LISTEN_PORTS.stop - 1}")


def accepts_connections(port: int, host: str = "127.0.0.1") -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        return False
    return True


def raw_status(
    host: str, port: int, head: str, source: str | None = None, timeout: float = 5
) -> int:
    """Send a request head to the proxy and return the status code of its reply."""
    bind_to = (source, 0) if source else None
    with socket.create_connection((host, port), timeout=timeout, source_address=bind_to) as sock:
        sock.sendall(head.encode())
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            assert chunk, f"proxy closed the connection after {reply!r}"
            reply += chunk
    return int(reply.split()[1])


def read_head(sock: socket.socket) -> bytes:
    """An HTTP response head (through its blank line), or what came before the peer closed."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    return head


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed `sock` (whatever it sent first is read past).

    Leaves `sock` non-blocking: for a socket that is only watched for its end.
    """
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset
    return True
