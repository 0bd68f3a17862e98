"""A parent proxy on loopback, so a real Squid's decisions can be tested without leaving it.

A test that asks whether Squid lets a CONNECT to a public address through
must not send traffic to that address. Squid configured with this peer as
its only parent and `never_direct allow all` forwards every CONNECT it
allows here, to 127.0.0.1, instead of connecting anywhere itself: the peer
records the request line and answers 200. What Squid refuses never reaches
the peer. So even a broken access rule keeps the test's traffic on loopback.
"""

from __future__ import annotations

import base64
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from tests.helpers.network import raw_status


@dataclass
class LoopbackPeer:
    port: int
    # The request lines Squid forwarded, e.g. "CONNECT 1.1.1.1:443 HTTP/1.1".
    requests: list[str] = field(default_factory=list)

    def squid_conf(self) -> str:
        """The lines that make a Squid send everything it allows to this peer only."""
        return (
            f"cache_peer 127.0.0.1 parent {self.port} 0 no-query no-digest name=loopback_peer\n"
            "never_direct allow all\n"
        )


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        line = self.rfile.readline().decode(errors="replace").strip()
        if not line:
            return  # Squid's own connection checks
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        self.server.peer.requests.append(line)
        self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    peer: LoopbackPeer


@contextmanager
def loopback_peer() -> Iterator[LoopbackPeer]:
    with _Server(("127.0.0.1", 0), _Handler) as server:
        server.peer = LoopbackPeer(port=server.server_address[1])
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.peer
        finally:
            server.shutdown()


def connect_status(port: int, target: str, credentials: tuple[str, str] | None) -> int:
    """The status of a proxy on 127.0.0.1:`port` answering `CONNECT target`."""
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if credentials is not None:
        token = base64.b64encode(":".join(credentials).encode()).decode()
        head += f"Proxy-Authorization: Basic {token}\r\n"
    return raw_status("127.0.0.1", port, head + "\r\n", timeout=10)
