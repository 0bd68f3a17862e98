"""The CONNECT probe against tiny real servers: each outcome it can report.

A small tunnelling proxy stands in for Squid here, so the probe's own logic
is tested fast and alone; tests/providers/test_local.py probes real Squid.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import trustme

from activities.probe import (
    FAILURES,
    FORBIDDEN,
    OTHER,
    PROXY_AUTH_REQUIRED,
    REFUSED,
    TIMEOUT,
    TLS_ERROR,
    UPSTREAM_ERROR,
    ProbeResult,
    probe_connect,
)
from tests.helpers.tls_origin import TlsOrigin

USERNAME = "probe"
PASSWORD = "probe-test-password"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[int]:
    """Run `handler` for every connection on a random port; yield the port."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def tunnelling_proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Just enough of a CONNECT proxy: check the credentials, then pipe bytes."""
    head = await reader.readuntil(b"\r\n\r\n")
    request_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines if line)
    expected = base64.b64encode(f"{USERNAME}:{PASSWORD}".encode()).decode()
    if headers.get("Proxy-Authorization") != f"Basic {expected}":
        writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
        writer.close()
        return
    host, port = request_line.split()[1].rsplit(":", 1)
    upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()

    await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


def answering(status: int) -> Handler:
    """A fake proxy that answers every CONNECT with `status`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(f"HTTP/1.1 {status} Whatever\r\nContent-Length: 0\r\n\r\n".encode())
        await writer.drain()
        writer.close()

    return handler


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accepts, reads, never answers: a hung proxy."""
    with contextlib.suppress(ConnectionError):
        await reader.read()
    writer.close()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port that refuses connections: bound, so nobody else takes it, but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def assert_consistent(result: ProbeResult) -> None:
    """What holds for every result: ok xor failure, no secret, JSON-friendly fields."""
    assert result.ok is (result.failure is None)
    assert result.failure is None or result.failure in FAILURES
    assert result.ok or result.error
    assert PASSWORD not in repr(result)
    assert result.total_ms is not None and result.total_ms >= 0


async def test_ok_through_a_tunnel(tls_origin: TlsOrigin) -> None:
    async with serve(tunnelling_proxy) as port:
        result = await probe_connect(
            "127.0.0.1",
            port,
            USERNAME,
            PASSWORD,
            tls_origin.url,
            ssl_context=tls_origin.client_ssl_context,
        )
    assert_consistent(result)
    assert result.ok, result
    assert (result.failure, result.error, result.status_code) == (None, None, 200)
    stages = (result.connect_ms, result.connect_reply_ms, result.tls_ms)
    assert all(stage is not None and stage >= 0 for stage in stages), result
    assert result.total_ms is not None
    assert result.total_ms >= sum(s for s in stages if s is not None)


async def test_refused(closed_port: int, tls_origin: TlsOrigin) -> None:
    result = await probe_connect("127.0.0.1", closed_port, USERNAME, PASSWORD, tls_origin.url)
    assert_consistent(result)
    assert result.failure == REFUSED
    assert result.connect_ms is None


async def test_timeout_bounds_the_whole_probe(tls_origin: TlsOrigin) -> None:
    async with serve(silent) as port:
        result = await probe_connect(
            "127.0.0.1", port, USERNAME, PASSWORD, tls_origin.url, timeout=0.2
        )
    assert_consistent(result)
    assert result.failure == TIMEOUT
    assert result.connect_ms is not None  # TCP worked; the reply never came
    assert result.connect_reply_ms is None


@pytest.mark.parametrize(
    ("status", "failure"),
    [
        (407, PROXY_AUTH_REQUIRED),
        (403, FORBIDDEN),
        (502, UPSTREAM_ERROR),
        (503, UPSTREAM_ERROR),
        (400, OTHER),
    ],
)
async def test_proxy_refusals(status: int, failure: str, tls_origin: TlsOrigin) -> None:
    async with serve(answering(status)) as port:
        result = await probe_connect("127.0.0.1", port, USERNAME, PASSWORD, tls_origin.url)
    assert_consistent(result)
    assert (result.failure, result.status_code) == (failure, status)
    assert result.connect_reply_ms is not None
    assert result.tls_ms is None


async def test_wrong_credentials_never_leak(tls_origin: TlsOrigin) -> None:
    async with serve(tunnelling_proxy) as port:
        result = await probe_connect("127.0.0.1", port, USERNAME, "not-the-one", tls_origin.url)
    assert result.failure == PROXY_AUTH_REQUIRED
    assert "not-the-one" not in repr(result)


async def test_untrusted_origin_is_a_tls_error(tls_origin: TlsOrigin) -> None:
    other_ca = ssl.create_default_context()
    trustme.CA().configure_trust(other_ca)  # trusts some CA, not the origin's
    async with serve(tunnelling_proxy) as port:
        result = await probe_connect(
            "127.0.0.1", port, USERNAME, PASSWORD, tls_origin.url, ssl_context=other_ca
        )
    assert_consistent(result)
    assert result.failure == TLS_ERROR
    assert result.status_code == 200  # the tunnel itself was fine
    assert result.error is not None and "certificate" in result.error


async def test_proxy_hanging_up_is_other(tls_origin: TlsOrigin) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async with serve(hang_up) as port:
        result = await probe_connect("127.0.0.1", port, USERNAME, PASSWORD, tls_origin.url)
    assert_consistent(result)
    assert result.failure == OTHER


async def test_bad_target_is_other_without_connecting() -> None:
    result = await probe_connect("127.0.0.1", 9, USERNAME, PASSWORD, "http://example.com/")
    assert_consistent(result)
    assert result.failure == OTHER
    assert result.connect_ms is None
