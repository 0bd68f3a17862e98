"""The CONNECT probe: is a proxy usable end to end, right now?

One probe does what a client does: TCP to the proxy, `CONNECT host:port` with
basic auth, TLS to the origin through the tunnel, `HEAD` and its status line.
Any HTTP status from the origin means the tunnel works. Each stage is timed,
and a failure is classified, so a dashboard can tell a dead proxy (refused,
timeout) from a misconfigured one (407, 403) from a broken upstream (5xx,
TLS).

It is plain asyncio without temporalio, and cheap enough for one worker to
probe 1,000 proxies every 10 s: no thread per probe, one shared default TLS
context, every socket closed on every path. Pass the proxy as an IP address;
a hostname would be resolved on the event loop's resolver thread.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import ssl
import time
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

REFUSED: Final = "refused"
TIMEOUT: Final = "timeout"
PROXY_AUTH_REQUIRED: Final = "proxy_auth_required"
FORBIDDEN: Final = "forbidden"
UPSTREAM_ERROR: Final = "upstream_error"
TLS_ERROR: Final = "tls_error"
OTHER: Final = "other"
FAILURES: Final = (
    REFUSED,
    TIMEOUT,
    PROXY_AUTH_REQUIRED,
    FORBIDDEN,
    UPSTREAM_ERROR,
    TLS_ERROR,
    OTHER,
)

# A response head larger than this is not one the probe needs to read.
MAX_HEAD_BYTES = 16 * 1024


@dataclass(frozen=True)
class ProbeResult:
    """One probe, JSON-friendly. Times are milliseconds; None where not reached.

    `connect_ms`: TCP to the proxy. `connect_reply_ms`: CONNECT sent to the
    proxy's reply read. `tls_ms`: TLS handshake with the origin through the
    tunnel. `total_ms`: the whole probe, failed or not, up to the HEAD's
    status line. `status_code` is the proxy's reply to CONNECT. `error` is a
    short message for humans and never contains the password.
    """

    ok: bool
    failure: str | None = None
    error: str | None = None
    status_code: int | None = None
    connect_ms: float | None = None
    connect_reply_ms: float | None = None
    tls_ms: float | None = None
    total_ms: float | None = None


class ProbeFailed(Exception):
    """A probe step failed: `failure` classifies it, `error` says what happened."""

    def __init__(self, failure: str, error: str) -> None:
        super().__init__(error)
        self.failure = failure
        self.error = error


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    # Building a context loads the whole CA bundle (milliseconds of CPU);
    # doing that per probe would cost more than the probe itself.
    return ssl.create_default_context()


async def probe_connect(
    proxy_host: str,
    proxy_port: int,
    username: str,
    password: str,
    target_url: str,
    *,
    # The caller passes one number per probe; wrapping every call site in
    # asyncio.timeout would repeat it and lose the "timeout" classification.
    timeout: float = 5.0,  # noqa: ASYNC109
    ssl_context: ssl.SSLContext | None = None,
) -> ProbeResult:
    """Tunnel to `target_url` (https) through the proxy; never raises for a failed probe.

    `timeout` bounds the whole probe, not each step: a probe loop on a fixed
    interval must be able to rely on it.
    """
    timings: dict[str, float] = {}
    status_code: int | None = None
    start = time.monotonic()
    writer: asyncio.StreamWriter | None = None

    def elapsed_ms(since: float) -> float:
        return (time.monotonic() - since) * 1000

    try:
        host, port, path = parse_https_target(target_url)
        async with asyncio.timeout(timeout):
            try:
                reader, writer = await asyncio.open_connection(
                    proxy_host, proxy_port, limit=MAX_HEAD_BYTES
                )
            except ConnectionRefusedError:
                raise ProbeFailed(
                    REFUSED, f"{proxy_host}:{proxy_port} refused the connection"
                ) from None
            timings["connect_ms"] = elapsed_ms(start)

            sent = time.monotonic()
            authority = send_connect(writer, host, port, username, password)
            status_code = await read_status(reader, "proxy")
            timings["connect_reply_ms"] = elapsed_ms(sent)
            if status_code != 200:
                raise ProbeFailed(
                    _classify_proxy_status(status_code),
                    f"proxy answered CONNECT {authority} with {status_code}",
                )

            handshake = time.monotonic()
            try:
                await writer.start_tls(ssl_context or _default_ssl_context(), server_hostname=host)
            except (ssl.SSLError, ConnectionError) as exc:
                raise ProbeFailed(TLS_ERROR, f"TLS with {authority}: {_reason(exc)}") from exc
            timings["tls_ms"] = elapsed_ms(handshake)

            writer.write(
                f"HEAD {path} HTTP/1.1\r\nHost: {authority}\r\n"
                "User-Agent: proxy-operator-probe\r\nConnection: close\r\n\r\n".encode()
            )
            await read_status(reader, "origin")
    except ProbeFailed as failed:
        return _result(start, timings, failed.failure, failed.error, status_code)
    except TimeoutError:
        error = f"{_pending_stage(timings)} took over {timeout:g} s"
        return _result(start, timings, TIMEOUT, error, status_code)
    except ssl.SSLError as exc:
        return _result(start, timings, TLS_ERROR, _reason(exc), status_code)
    except OSError as exc:
        return _result(start, timings, OTHER, _reason(exc), status_code)
    finally:
        if writer is not None:
            # abort, not close: no TLS close_notify exchange to wait for, and
            # the socket is released now even when the peer has gone silent.
            writer.transport.abort()
    return _result(start, timings, None, None, status_code)


def _pending_stage(timings: dict[str, float]) -> str:
    """The stage a probe was in when its deadline passed: where to look first."""
    for key, stage in (
        ("connect_ms", "TCP connect to the proxy"),
        ("connect_reply_ms", "the proxy's CONNECT reply"),
        ("tls_ms", "the TLS handshake with the origin"),
    ):
        if key not in timings:
            return stage
    return "the origin's response"


def parse_https_target(target_url: str) -> tuple[str, int, str]:
    """Host, port and path of an https:// URL; ProbeFailed if it is not one."""
    parts = urlsplit(target_url)
    try:
        port = parts.port or 443
    except ValueError:
        port = 0
    if parts.scheme != "https" or not parts.hostname or not port:
        raise ProbeFailed(OTHER, f"target {target_url!r} is not an https:// URL with a host")
    path = parts.path or "/"
    if parts.query:
        path += f"?{parts.query}"
    return parts.hostname, port, path


def send_connect(
    writer: asyncio.StreamWriter, host: str, port: int, username: str, password: str
) -> str:
    """Ask the proxy for a tunnel to host:port with Basic credentials; returns host:port."""
    credentials = base64.b64encode(f"{username}:{password}".encode()).decode()
    authority = host_port(host, port)
    writer.write(
        f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
        f"Proxy-Authorization: Basic {credentials}\r\n\r\n".encode()
    )
    return authority


def host_port(host: str, port: int) -> str:
    """`host:port` as a CONNECT names it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def read_status(reader: asyncio.StreamReader, peer: str) -> int:
    """Read a response head and return its status code."""
    return (await read_response_head(reader, peer))[0]


async def read_response_head(reader: asyncio.StreamReader, peer: str) -> tuple[int, bytes]:
    """Read a response head: its status code, and the head itself.

    A head that is not HTTP is described, never quoted: the peer may be any
    server a namespace user names (a probe's target, an exit echo service),
    and what it sent would reach the workflow's status.
    """
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise ProbeFailed(OTHER, f"{peer} closed the connection before answering") from exc
    except asyncio.LimitOverrunError as exc:
        raise ProbeFailed(OTHER, f"{peer} sent an oversized response head") from exc
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/") or not code.isdigit():
        raise ProbeFailed(
            OTHER, f"{peer} sent no HTTP status line (a first line of {len(status_line)} bytes)"
        )
    return int(code), head


def _classify_proxy_status(status: int) -> str:
    if status == 407:
        return PROXY_AUTH_REQUIRED
    if status == 403:
        return FORBIDDEN
    if 500 <= status <= 599:
        return UPSTREAM_ERROR
    return OTHER


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or type(exc).__name__
    return f"{type(exc).__name__}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)


def _result(
    start: float,
    timings: dict[str, float],
    failure: str | None,
    error: str | None,
    status_code: int | None,
) -> ProbeResult:
    return ProbeResult(
        ok=failure is None,
        failure=failure,
        error=error,
        status_code=status_code,
        connect_ms=timings.get("connect_ms"),
        connect_reply_ms=timings.get("connect_reply_ms"),
        tls_ms=timings.get("tls_ms"),
        total_ms=(time.monotonic() - start) * 1000,
    )
