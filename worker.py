"""The composition root: config -> providers -> Temporal worker.

    python worker.py --providers-config deploy/local/providers.yaml

Validates the providers config before connecting anywhere (every problem
printed, exit code 2), builds the providers through the registry, connects
with Temporal's standard environment configuration (TEMPORAL_ADDRESS,
TEMPORAL_NAMESPACE, TLS, API key, profiles), serves /metrics and /healthz, and
drains gracefully on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterable
from datetime import timedelta
from socketserver import ThreadingMixIn
from typing import Any, NoReturn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from temporalio.client import Client
from temporalio.envconfig import ClientConfig
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.worker import Worker

from activities.gc import GcActivities
from activities.pool import PoolActivities
from activities.provider import ProviderActivities
from contract import ORPHAN_GC_SCHEDULE_ID, TASK_QUEUE
from providers.config import Config, ConfigError, load_config
from providers.registry import build_providers
from startup.schedule import DEFAULT_INTERVAL, ensure_orphan_gc_schedule, parse_duration
from startup.search_attributes import SearchAttributesMissing, ensure_search_attributes
from workflows.lifecycle import ProxyLifecycle
from workflows.orphan_gc import OrphanGC
from workflows.payloads import with_input_payload_converter
from workflows.pool import ProxyPool

DEFAULT_METRICS_ADDRESS = "0.0.0.0:9464"
DEFAULT_TEMPORAL_ADDRESS = "localhost:7233"
# Each monitored proxy holds one activity slot for as long as it is Ready.
DEFAULT_MAX_ACTIVITIES = 2000
GRACEFUL_SHUTDOWN = timedelta(seconds=20)

log = logging.getLogger("proxy_operator.worker")


def env_argument(
    parser: argparse.ArgumentParser, flag: str, env: str, text: str, default: str | None = None
) -> None:
    """A string flag that defaults to environment variable `env`, then `default`; says both."""
    shown = f"env {env}" if default is None else f"env {env}, default %(default)s"
    parser.add_argument(flag, default=os.environ.get(env, default), help=f"{text} ({shown})")


def settings_arguments(
    parser: argparse.ArgumentParser, *, metrics_env: str, metrics_default: str
) -> None:
    """The flags every console script takes (the worker's, the gateway's).

    The Temporal connection is not among them: `connect` reads it from the
    environment (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TLS, API key, profiles).
    """
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


def configure_logging() -> None:
    """Log lines as every console script writes them, at PROXY_OPERATOR_LOG_LEVEL."""
    logging.basicConfig(
        level=os.environ.get("PROXY_OPERATOR_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="proxy-operator-worker", description=__doc__.split("\n")[0]
    )
    settings_arguments(
        parser,
        metrics_env="PROXY_OPERATOR_METRICS_ADDRESS",
        metrics_default=DEFAULT_METRICS_ADDRESS,
    )
    parser.add_argument("--task-queue", default=TASK_QUEUE, help="default %(default)s")
    parser.add_argument(
        "--max-concurrent-activities",
        type=int,
        default=DEFAULT_MAX_ACTIVITIES,
        help="one slot per monitored proxy; default %(default)s",
    )
    parser.add_argument(
        "--no-orphan-gc-schedule",
        dest="orphan_gc_schedule",
        action="store_false",
        default=os.environ.get("PROXY_OPERATOR_ORPHAN_GC_SCHEDULE", "on").lower() != "off",
        help=f"do not create or update the {ORPHAN_GC_SCHEDULE_ID} schedule at start "
        "(env PROXY_OPERATOR_ORPHAN_GC_SCHEDULE=off)",
    )
    parser.add_argument(
        "--orphan-gc-interval",
        type=parse_duration,
        default=DEFAULT_INTERVAL,
        help="how often the schedule runs OrphanGC, e.g. 10m or 1h; default 10m",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    args = parse_args(argv)
    if not args.providers_config:
        print("error: --providers-config (or PROXY_OPERATOR_CONFIG) is required", file=sys.stderr)
        return 2
    try:
        config = load_config(args.providers_config)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(config, args))
    except SearchAttributesMissing as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def serve(config: Config, args: argparse.Namespace) -> int:
    providers = build_providers(config)
    health = Health()
    runtime = _runtime_with_metrics(args.metrics_address, health)
    client = await connect(runtime)
    await ensure_search_attributes(client)
    activities = ProviderActivities(providers, config)
    gc = GcActivities(providers, config.installation, client)
    if args.orphan_gc_schedule:
        await ensure_orphan_gc_schedule(
            client, task_queue=args.task_queue, interval=args.orphan_gc_interval
        )
    worker = build_worker(
        client,
        activities,
        gc=gc,
        task_queue=args.task_queue,
        max_concurrent_activities=args.max_concurrent_activities,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "worker on task queue %s (namespace %s), providers: %s",
        args.task_queue,
        client.namespace,
        ", ".join(f"{e.name} ({e.type})" for e in config.providers),
    )
    async with worker:
        health.ready = True
        await stop.wait()
        log.info("draining: finishing tasks in flight (up to %s)", GRACEFUL_SHUTDOWN)
        health.ready = False
    activities.close()
    return 0


def build_worker(
    client: Client,
    activities: ProviderActivities,
    *,
    gc: GcActivities | None = None,
    task_queue: str = TASK_QUEUE,
    max_concurrent_activities: int = DEFAULT_MAX_ACTIVITIES,
) -> Worker:
    """The one place that says which workflows and activities a worker serves.

    OrphanGC is served when its activities are given, as every real worker does.
    ProxyPool always is: its one activity needs only the Temporal client.
    """
    gc_activities: list[Callable[..., Any]] = (
        [] if gc is None else [gc.providers, gc.survey, gc.confirm, gc.record_deleted]
    )
    return Worker(
        # Undecodable start arguments fail the workflow instead of wedging it.
        with_input_payload_converter(client),
        task_queue=task_queue,
        workflows=[ProxyLifecycle, ProxyPool] + ([] if gc is None else [OrphanGC]),
        activities=[
            activities.validate_target,
            activities.create_instance,
            activities.wait_running,
            activities.wait_healthy,
            activities.monitor,
            activities.delete_instance,
            activities.wait_gone,
            *_pool_activities(client),
            *gc_activities,
        ],
        max_concurrent_activities=max_concurrent_activities,
        # One cached workflow per monitored proxy, so the hourly monitor
        # report-back never has to replay an evicted history.
        max_cached_workflows=max_concurrent_activities,
        graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
    )


def _pool_activities(client: Client) -> list[Callable[..., Any]]:
    pool = PoolActivities(client)
    return [pool.closed_members, pool.end_orphaned_members]


async def connect(runtime: Runtime | None = None) -> Client:
    """Connect with the standard env config; a bare dev setup gets localhost:7233."""
    connect_config = ClientConfig.load_client_connect_config()
    connect_config.setdefault("target_host", DEFAULT_TEMPORAL_ADDRESS)
    return await Client.connect(**connect_config, runtime=runtime)


# ---- metrics and health ---------------------------------------------------------------


class Health:
    """Whether /healthz answers 200: set once the process serves."""

    ready = False


class _SdkMetrics(Collector):
    """Re-exports the Temporal SDK's own Prometheus metrics on our endpoint.

    The SDK's exporter listens on a private loopback port; one scrape of
    /metrics returns our series and the SDK's together.
    """

    def __init__(self, url: str) -> None:
        self._url = url

    def collect(self) -> Iterable[Metric]:
        try:
            with urllib.request.urlopen(self._url, timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return []
        return list(text_string_to_metric_families(text))


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _runtime_with_metrics(address: str, health: Health) -> Runtime | None:
    if not address:
        return None
    sdk_address = f"127.0.0.1:{_free_port()}"
    runtime = Runtime(
        telemetry=TelemetryConfig(
            metrics=PrometheusConfig(bind_address=sdk_address, durations_as_seconds=True)
        )
    )
    REGISTRY.register(_SdkMetrics(f"http://{sdk_address}/metrics"))
    serve_metrics(address, health)
    return runtime


def serve_metrics(address: str, health: Health) -> None:
    """Serve the default registry on /metrics and `health` on /healthz, in a thread.

    The gateway serves its own series the same way.
    """
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run(entry: Callable[[], int] = main) -> NoReturn:
    """The console entry point: `entry` (the worker's `main`), then exit without teardown.

    Tearing down the interpreter while the Temporal SDK's native runtime
    threads still exist can abort the process after a clean drain
    (temporalio/sdk-python#300). By the time `entry` returns everything worth
    doing is done, so flush and leave with its exit code. The gateway's
    console script leaves the same way.
    """
    code = entry()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
