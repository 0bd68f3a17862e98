"""A site that bans an exit after N requests, as a scraper's target does, on loopback.

A real site bans the address a request came from. Every member of a pool on
the local provider leaves from 127.0.0.1, so the origin tells exits apart
the way the kernel does: the TCP connection it accepted has a twin socket in
the member's Squid, and /proc names the process holding it (the member's
instance directory under the provider's state directory). One instance is
one exit: a banned member's replacement is a new instance, and a new exit.
Reading another user's /proc/<pid>/fd takes root, as the local provider's
Squids (which run as `proxy`) do anyway.

A banned exit gets, in turn, 403 or a 200 whose body is a captcha page, so
a crawler must detect bans by status and by body alike.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.tls_origin import TlsOrigin, TlsRequestHandler, serve_tls_origin

CAPTCHA = b"<html><body>Please solve this captcha to continue</body></html>"
# "/", the docs examples' stand-in for https://example.com/: a browser prints its title.
HOME_TITLE = "Example Domain"
HOME_PAGE = f"<html><head><title>{HOME_TITLE}</title></head><body>ok</body></html>".encode()
# Only pages count towards a ban: the members' health probes (HEAD /) do not.
PAGES_PREFIX = "/page/"
TCP_TABLE = Path("/proc/net/tcp")
LOOPBACK_HEX = "0100007F"


@dataclass
class BanningOrigin:
    """The origin's record: what each exit was served, and which exits it banned."""

    state_dir: Path
    allowed: int  # requests an exit is served before it is banned
    tls: TlsOrigin | None = None
    served: collections.Counter[str] = field(default_factory=collections.Counter)
    pages: dict[str, str] = field(default_factory=dict)  # path -> the exit that got its page
    banned: list[str] = field(default_factory=list)  # in the order they were banned
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    unknown: int = 0  # requests from a connection no member's Squid holds
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, exit_name: str | None, path: str) -> tuple[int, bytes]:
        """The status and body for `path` asked by `exit_name`; bans it once it has had enough."""
        if not path.startswith(PAGES_PREFIX):
            return 200, HOME_PAGE if path == "/" else b"ok"
        with self.lock:
            if exit_name is None:
                self.unknown += 1
                return 400, b"not from a member"
            if exit_name not in self.banned and self.served[exit_name] >= self.allowed:
                self.banned.append(exit_name)
            if exit_name in self.banned:
                self.refused[exit_name] += 1
                if self.banned.index(exit_name) % 2 == 0:
                    return 403, b"Forbidden"
                return 200, CAPTCHA
            self.served[exit_name] += 1
            self.pages[path] = exit_name
            return 200, f"page {path}".encode()


def exit_of(state_dir: Path, peer_port: int, origin_port: int) -> str | None:
    """The instance (directory name under `state_dir`) whose Squid holds the connection's other end.

    The socket connected from 127.0.0.1:`peer_port` to the origin's port is
    found in the kernel's TCP table; its inode is then looked for among the
    open files of each instance's Squid (pid from its instance.json).
    """
    inode = _socket_inode(peer_port, origin_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for directory in state_dir.iterdir():
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = int(json.loads((directory / "instance.json").read_text())["pid"])
            fds = Path(f"/proc/{pid}/fd")
            for fd in fds.iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        return directory.name
    return None


def _socket_inode(local_port: int, remote_port: int) -> str | None:
    local = f"{LOOPBACK_HEX}:{local_port:04X}"
    remote = f"{LOOPBACK_HEX}:{remote_port:04X}"
    for line in TCP_TABLE.read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return fields[9]
    return None


@contextlib.contextmanager
def serve_banning_origin(state_dir: Path, allowed: int) -> Iterator[BanningOrigin]:
    """The banning origin over HTTPS on 127.0.0.1, for exits of instances under `state_dir`."""
    origin = BanningOrigin(state_dir, allowed)

    class Handler(TlsRequestHandler):
        def do_GET(self) -> None:
            assert origin.tls is not None
            peer_port = self.client_address[1]
            status, body = origin.answer(exit_of(state_dir, peer_port, origin.tls.port), self.path)
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_HEAD = do_GET

    with serve_tls_origin(handler=Handler) as tls:
        origin.tls = tls
        yield origin
