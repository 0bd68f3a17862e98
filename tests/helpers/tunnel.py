"""One HTTPS request through a forward proxy, as a scraper makes it: CONNECT, TLS, GET.

Shared by the gateway tests and bench/gateway.py, so both count a request as
failed for the same reasons: no 200 to the CONNECT, or no answer from the
origin through the tunnel.
"""

from __future__ import annotations

import base64
import re
import socket
import ssl
import threading
from dataclasses import dataclass

from tests.helpers.network import read_head

TIMEOUT = 10.0
# How often a held tunnel sends a request: well inside the origin's idle timeout.
KEEP_BUSY = 3.0


@dataclass(frozen=True)
class Answer:
    """The proxy's status for the CONNECT (0 if it never answered) and, on 200, the origin's."""

    connect_status: int
    origin_status: int = 0

    @property
    def ok(self) -> bool:
        return self.connect_status == 200 and self.origin_status == 200


def request(
    proxy: tuple[str, int],
    username: str,
    password: str,
    target: tuple[str, int],
    context: ssl.SSLContext,
    timeout: float = TIMEOUT,
) -> Answer:
    """CONNECT to `target` through `proxy` with basic auth, then GET / over TLS.

    Raises OSError (refused, reset, timed out, TLS failure): the caller
    counts that as a failed request too.
    """
    host = target[0]
    with socket.create_connection(proxy, timeout=timeout) as sock:
        sock.sendall(connect_request(username, password, target))
        head = read_head(sock)
        status = int(head.split(b" ", 2)[1]) if head.count(b" ") >= 2 else 0
        if status != 200:
            return Answer(status)
        with context.wrap_socket(sock, server_hostname=host) as tls:
            tls.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            reply = b""
            while chunk := tls.recv(4096):
                reply += chunk
        origin = int(reply.split(b" ", 2)[1]) if reply.count(b" ") >= 2 else 0
        return Answer(status, origin)


def hold_tunnel(
    proxy: tuple[str, int],
    target: tuple[str, int],
    context: ssl.SSLContext,
    credentials: tuple[str, str],
    timeout: float = TIMEOUT,
) -> ssl.SSLSocket:
    """CONNECT to `target` through `proxy`, TLS up, and the tunnel left open: one unit of load.

    Raises OSError, or AssertionError if the proxy does not answer 200.
    """
    host, port = target
    sock = socket.create_connection(proxy, timeout=timeout)
    try:
        sock.sendall(connect_request(*credentials, target))
        head = read_head(sock)
        if not head.startswith(b"HTTP/1.1 200"):
            raise AssertionError(f"CONNECT {host}:{port} answered {head[:100]!r}")
        return context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def connect_request(username: str, password: str, target: tuple[str, int]) -> bytes:
    """A CONNECT to `target` with basic auth, as a scraper sends it."""
    host, port = target
    credentials = base64.b64encode(f"{username}:{password}".encode()).decode()
    return (
        f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Proxy-Authorization: Basic {credentials}\r\n\r\n"
    ).encode()


class HeldTunnels:
    """`count` tunnels held open through a proxy, each kept busy: a steady load of open tunnels.

    Each tunnel sends a request every KEEP_BUSY seconds (an idle one would be
    closed by the origin's timeout, tests/helpers/tls_origin.py) from a
    thread of its own, until `close`.
    """

    def __init__(
        self,
        proxy: tuple[str, int],
        target: tuple[str, int],
        context: ssl.SSLContext,
        credentials: tuple[str, str],
        timeout: float = TIMEOUT,
    ) -> None:
        self._args = (proxy, target, context, credentials, timeout)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failures = 0

    def open(self, count: int) -> HeldTunnels:
        """Opens `count` tunnels (raising as `hold_tunnel` does), each then kept busy."""
        for _ in range(count):
            tunnel = hold_tunnel(*self._args)
            thread = threading.Thread(target=self._keep_busy, args=(tunnel,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _keep_busy(self, tunnel: ssl.SSLSocket) -> None:
        host = self._args[1][0]
        with tunnel:
            while not self._stop.wait(KEEP_BUSY):
                try:
                    tunnel.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                    head = read_head(tunnel)
                    length = re.search(rb"(?i)content-length: *(\d+)", head)
                    tunnel.recv(int(length.group(1)) if length else 0)
                except OSError:
                    self.failures += 1
                    return

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
