"""What every console script shares: the worker's (worker.py) and the gateway's (gateway/main.py).

Flags that fall back to environment variables, the log format (the
Temporal SDK's Core's lines included), the Temporal connection, /metrics,
/healthz and /readyz, and how the process leaves. Here, not in
worker.py, so the gateway takes the same settings without loading the
worker's workflows and activities.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import errno
import functools
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from temporalio.client import Client
from temporalio.envconfig import ClientConfig
from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    PrometheusConfig,
    Runtime,
    TelemetryConfig,
)

from providers.base import split_endpoint

DEFAULT_TEMPORAL_ADDRESS = "localhost:7233"
# The metrics listener's bounds (_MetricsListener says why each).
METRICS_HEAD_SECONDS = 5.0
METRICS_WRITE_SECONDS = 10.0
METRICS_MAX_HEAD_BYTES = 8192
METRICS_MAX_CONNECTIONS = 256
METRICS_MAX_PER_ADDRESS = 8
METRICS_RENDER_THREADS = 2
# The Temporal SDK's Core logs under this logger, and a kind of line (a
# retried call, say) at most once per CORE_LOG_WINDOW: with Temporal away,
# Core warns of every retry of every call, several a second.
CORE_LOGGER = "temporalio.core"
CORE_LOG_WINDOW = 60.0
CORE_LOG_KINDS = 256

log = logging.getLogger("proxy_operator.cli")


def env_argument(
    parser: argparse.ArgumentParser,
    flag: str,
    env: str,
    text: str,
    default: str | None = None,
    type: Callable[[str], Any] = str,
) -> None:
    """A flag that defaults to environment variable `env`, then `default`; says both.

    `type` checks and converts the value, the one from `env` included
    (argparse converts a string default too), and its ArgumentTypeError is
    printed after the flag's name.
    """
    shown = f"env {env}" if default is None else f"env {env}, default %(default)s"
    parser.add_argument(
        flag, default=os.environ.get(env, default), type=type, help=f"{text} ({shown})"
    )


def seconds_argument(
    parser: argparse.ArgumentParser, flag: str, default: float, text: str, note: str = ""
) -> None:
    """A flag of seconds, a float, whose help says its default, then `note` if any.

    One form for the gateway's intervals and timeouts, so each help reads the same way.
    """
    after = f"; {note}" if note else ""
    parser.add_argument(
        flag, type=float, default=default, help=f"{text} (default %(default)s{after})"
    )


def argument_parser(
    prog: str, doc: str, *, metrics_env: str, metrics_default: str
) -> argparse.ArgumentParser:
    """The parser every console script starts from, with the flags they all take.

    `doc` is the script's module docstring, whose first line describes it.
    The Temporal connection is not among the flags: `connect` reads it from
    the environment (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TLS, API key,
    profiles).
    """
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    env_argument(
        parser,
        "--providers-config",
        "PROXY_OPERATOR_CONFIG",
        "the providers YAML: credentials, access rules",
    )
    env_argument(
        parser,
        "--metrics-address",
        metrics_env,
        "host:port for /metrics, /healthz and /readyz; empty turns it off",
        metrics_default,
    )
    return parser


def configure_logging() -> None:
    """Log lines as every console script writes them, at PROXY_OPERATOR_LOG_LEVEL."""
    logging.basicConfig(
        level=os.environ.get("PROXY_OPERATOR_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


class OncePerWindow(logging.Filter):
    """One record of a kind per `seconds`; the next one says how many were left out.

    A kind is the logger, the level and the message with its numbers taken
    out: Core's "retried 5 times" and "retried 6 times" are one kind. At most
    CORE_LOG_KINDS kinds are remembered; past that the oldest is forgotten.
    """

    def __init__(self, seconds: float = CORE_LOG_WINDOW) -> None:
        super().__init__()
        self.seconds = seconds
        self._lock = threading.Lock()
        # kind -> (when its last record went through, how many were left out since)
        self._kinds: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        core = getattr(record, "temporal_log", None)
        text = core.message if core is not None else str(record.msg)
        kind = (record.name, record.levelno, re.sub(r"\d+", "#", text))
        now = time.monotonic()
        with self._lock:
            shown, left_out = self._kinds.pop(kind, (-self.seconds, 0))
            if now - shown < self.seconds:
                self._kinds[kind] = (shown, left_out + 1)
                return False
            self._kinds[kind] = (now, 0)
            while len(self._kinds) > CORE_LOG_KINDS:
                del self._kinds[next(iter(self._kinds))]
        if left_out:
            record.msg = f"{record.getMessage()} ({left_out} more like it left out)"
            record.args = ()
        return True


_CORE_FILTER = OncePerWindow()


def sdk_runtime(metrics: PrometheusConfig | None = None) -> Runtime:
    """The Temporal SDK's runtime for a console script, exporting `metrics` if given.

    Core writes its own lines to stderr unless forwarded, in colour codes
    and as often as it retries; forwarded, they are our log lines
    (CORE_LOGGER, at Core's default WARN), one of a kind per CORE_LOG_WINDOW.
    """
    core = logging.getLogger(CORE_LOGGER)
    core.addFilter(_CORE_FILTER)
    return Runtime(
        telemetry=TelemetryConfig(
            logging=LoggingConfig(
                filter=LoggingConfig.default.filter,
                forwarding=LogForwardingConfig(logger=core, append_target_to_name=False),
            ),
            metrics=metrics,
        )
    )


@functools.cache
def _plain_runtime() -> Runtime:
    """One runtime without metrics per process, however many times `connect` is called."""
    return sdk_runtime()


async def connect(runtime: Runtime | None = None) -> Client:
    """Connect with the standard env config; a bare dev setup gets localhost:7233.

    Without `runtime`, one from `sdk_runtime` (Core's lines into our log).
    """
    connect_config = ClientConfig.load_client_connect_config()
    connect_config.setdefault("target_host", DEFAULT_TEMPORAL_ADDRESS)
    return await Client.connect(**connect_config, runtime=runtime or _plain_runtime())


class Health:
    """What /healthz (liveness) and /readyz (readiness) answer.

    Set on the process's own loop and read on the metrics listener's thread:
    each is a plain attribute or a method that reads some, whole under the GIL.
    This class's readiness is its liveness (the worker's); the gateway's
    adds what it routes by (gateway/health.py).
    """

    ready = False

    def not_live(self) -> str | None:
        """Why /healthz answers 503, in one line; None while the process works."""
        return None if self.ready else "starting"

    def not_ready(self) -> str | None:
        """Why /readyz answers 503, in one line; None while it should be sent work."""
        return self.not_live()


class MetricsAddressError(ValueError):
    """`--metrics-address` names no address this process can listen on; the message says why."""


def serve_metrics(address: str, health: Health, registry: CollectorRegistry, env: str) -> None:
    """Serve `registry` on /metrics and `health` on /healthz and /readyz, on a thread of their own.

    The socket is bound here, before the thread starts, so an address in use
    or not host:port is a MetricsAddressError naming the flag and `env`, the
    variable that sets it, for the caller to print and exit 2.
    """
    flag = f"--metrics-address (or {env})"
    parsed = split_endpoint(address)
    if parsed is None:
        raise MetricsAddressError(f"{flag}: {address!r} is not host:port (e.g. 127.0.0.1:9464)")
    try:
        sock = socket.create_server(parsed, family=_family(parsed[0]))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise MetricsAddressError(
                f"{flag}: {address} is in use by another process (a second one on this "
                "host?); give this one another host:port, or an empty value for no metrics"
            ) from None
        raise MetricsAddressError(f"{flag}: cannot listen on {address}: {err.strerror}") from None
    listener = _MetricsListener(sock, health, registry)
    threading.Thread(target=listener.run, name="metrics", daemon=True).start()
    log.info("serving /metrics, /healthz and /readyz on %s", address)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _MetricsListener:
    """/metrics, /healthz and /readyz on an event loop of their own: no thread per connection.

    Whoever reaches the port costs a coroutine for at most METRICS_HEAD_SECONDS
    unless it sends a request; at most METRICS_MAX_CONNECTIONS are open at
    once, METRICS_MAX_PER_ADDRESS of them from one address, so one client's
    idle sockets leave room for the kubelet's probes and Prometheus's scrape.
    /healthz and /readyz are answered on the loop; a scrape is rendered on one
    of METRICS_RENDER_THREADS threads (the worker's collects the Temporal
    SDK's series over HTTP), so a slow scrape never holds a probe up.
    """

    def __init__(self, sock: socket.socket, health: Health, registry: CollectorRegistry) -> None:
        self._sock = sock
        self._health = health
        self._registry = registry
        self._open: collections.Counter[str] = collections.Counter()
        self._render = ThreadPoolExecutor(METRICS_RENDER_THREADS, thread_name_prefix="metrics")

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        server = await asyncio.start_server(
            self._connection, sock=self._sock, limit=METRICS_MAX_HEAD_BYTES
        )
        async with server:
            await server.serve_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else ""
        if (
            self._open.total() >= METRICS_MAX_CONNECTIONS
            or self._open[address] >= METRICS_MAX_PER_ADDRESS
        ):
            writer.transport.abort()  # over the bound: refused at once
            return
        self._open[address] += 1
        try:
            async with asyncio.timeout(METRICS_HEAD_SECONDS):
                head = await reader.readuntil(b"\r\n\r\n")
            status, content_type, body = await self._answer(head)
            head_out = (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head_out.encode() + body)
            async with asyncio.timeout(METRICS_WRITE_SECONDS):
                await writer.drain()
            writer.close()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.transport.abort()  # gone, stalled, or a head over the bound: cut
        finally:
            self._open[address] -= 1
            if not self._open[address]:
                del self._open[address]

    async def _answer(self, head: bytes) -> tuple[str, str, bytes]:
        """Status line's tail, Content-Type and body for one request head."""
        request_line, *lines = head.decode("latin-1").split("\r\n")
        method, _, rest = request_line.partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        text = "text/plain; charset=utf-8"
        if path not in ("/healthz", "/readyz", "/metrics"):
            return (
                "404 Not Found",
                text,
                b"not found: /metrics, /healthz and /readyz are served here\n",
            )
        if method != "GET":
            return "405 Method Not Allowed", text, b"GET only\n"
        if path in ("/healthz", "/readyz"):
            live = path == "/healthz"
            problem = self._health.not_live() if live else self._health.not_ready()
            if problem is None:
                return "200 OK", text, b"ok\n" if live else b"ready\n"
            return "503 Service Unavailable", text, f"{' '.join(problem.split())}\n".encode()
        accept = next(
            (v for k, _, v in (line.partition(":") for line in lines) if k.lower() == "accept"),
            "",
        )
        encoder, content_type = choose_encoder(accept.strip())
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(self._render, encoder, self._registry)
        return "200 OK", content_type, body


def run(entry: Callable[[], int]) -> NoReturn:
    """A console entry point: `entry` (a script's `main`), then exit without teardown.

    Tearing down the interpreter while the Temporal SDK's native runtime
    threads still exist can abort the process after a clean drain
    (temporalio/sdk-python#300). By the time `entry` returns everything worth
    doing is done, so flush and leave with its exit code.
    """
    code = entry()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
