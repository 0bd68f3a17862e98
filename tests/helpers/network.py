"""Loopback ports for servers a test or benchmark starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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
