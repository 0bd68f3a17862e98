"""Requests to the gateway's control API (gateway/api.py), as a scraper's client sends them.

`call` goes through http.client, a real HTTP client; `raw` sends bytes as
they are, for what no well-behaved client would send; `connect_from` opens a
socket from another loopback address (127.0.0.2, ...), to be another client.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from dataclasses import dataclass
from typing import Any

TIMEOUT = 30.0


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    port: int,
    method: str,
    path: str,
    *,
    token: str | None = None,
    body: Any = None,
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
) -> Reply:
    """One request to the API on 127.0.0.1:`port`; `body` is sent as JSON unless bytes."""
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
    connection: http.client.HTTPConnection = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=TIMEOUT, context=context)
        if context is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    )
    try:
        connection.request(method, path, body=data, headers=sent)
        response = connection.getresponse()
        return Reply(
            response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        )
    finally:
        connection.close()


def raw(port: int, data: bytes) -> bytes:
    """Send `data` to the API and read what comes back until it closes (b"" if it says nothing)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        try:
            sock.sendall(data)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            return b""
    return reply


def connect_from(source: str, port: int) -> socket.socket:
    """A connection to the API on 127.0.0.1:`port` from address `source`, sending nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((source, 0))
        sock.settimeout(TIMEOUT)
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock
