"""What every HTTP-level fake shares: its own loopback server on a thread, its URL, start and stop.

The fakes (tests/fakes/compute.py, tests/fakes/ec2.py) differ in what they
answer, not in how they are served, so that part is written once here.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


class ServedFake:
    """A fake API served on 127.0.0.1; `with fake:` starts it and stops it."""

    _server: ThreadingHTTPServer | None = None

    def start(self) -> Self:
        raise NotImplementedError

    def _serve_http(self, handler: type[BaseHTTPRequestHandler], name: str, port: int = 0) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._server.daemon_threads = True
        # A short poll interval makes stop() prompt: shutdown waits for a poll.
        threading.Thread(
            target=self._server.serve_forever, args=(0.01,), name=name, daemon=True
        ).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"
