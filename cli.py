"""What every console script shares: the worker's (worker.py) and the gateway's (gateway/main.py).

Flags that fall back to environment variables, the log format, the Temporal
connection, /metrics and /healthz, and how the process leaves. Here, not in
worker.py, so the gateway takes the same settings without loading the
worker's workflows and activities.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any, NoReturn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app
from temporalio.client import Client
from temporalio.envconfig import ClientConfig
from temporalio.runtime import Runtime

DEFAULT_TEMPORAL_ADDRESS = "localhost:7233"

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
        "host:port for /metrics and /healthz; empty turns it off",
        metrics_default,
    )
    return parser


def configure_logging() -> None:
    """Log lines as every console script writes them, at PROXY_OPERATOR_LOG_LEVEL."""
    logging.basicConfig(
        level=os.environ.get("PROXY_OPERATOR_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


async def connect(runtime: Runtime | None = None) -> Client:
    """Connect with the standard env config; a bare dev setup gets localhost:7233."""
    connect_config = ClientConfig.load_client_connect_config()
    connect_config.setdefault("target_host", DEFAULT_TEMPORAL_ADDRESS)
    return await Client.connect(**connect_config, runtime=runtime)


class Health:
    """Whether /healthz answers 200: set once the process serves."""

    ready = False


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics(address: str, health: Health) -> None:
    """Serve the default registry on /metrics and `health` on /healthz, in a thread."""
    metrics_app = make_wsgi_app(REGISTRY)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            status = "200 OK" if health.ready else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [b"ok\n" if health.ready else b"starting\n"]
        return metrics_app(environ, start_response)  # type: ignore[no-any-return]

    host, _, port = address.rpartition(":")
    server = make_server(
        host or "0.0.0.0", int(port), app, _ThreadingWSGIServer, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("serving /metrics and /healthz on %s", address)


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
