"""The composition root: config -> providers -> Temporal worker.

    python worker.py --providers-config deploy/local/providers.yaml

Validates the providers config before connecting anywhere (every problem
printed, exit code 2), builds the providers through the registry, connects
with Temporal's standard environment configuration (TEMPORAL_ADDRESS,
TEMPORAL_NAMESPACE, TLS, API key, profiles), serves /metrics and /healthz, and
drains gracefully on SIGTERM. With `--deployment-name` and `--build-id` it
joins a Worker Deployment as that version (Worker Versioning, off by
default; docs/upgrades.md).

It serves two task queues: proxies (and pools started there) on
`--task-queue`, and pools on the same name ending "-pools". `--serve
proxies` or `--serve pools` takes one of them, so a large fleet's pools run
in a process of their own (docs/operations.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, NoReturn

from prometheus_client import REGISTRY
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from temporalio.client import Client
from temporalio.common import WorkerDeploymentVersion
from temporalio.runtime import PrometheusConfig, Runtime
from temporalio.worker import Worker, WorkerDeploymentConfig

import cli
from activities.gc import GcActivities
from activities.pool import PoolActivities
from activities.provider import ProviderActivities
from contract import ORPHAN_GC_SCHEDULE_ID, POOL_QUEUE_SUFFIX, POOL_TASK_QUEUE, TASK_QUEUE
from providers.config import Config, ConfigError, load_config
from providers.registry import build_providers
from startup.schedule import DEFAULT_INTERVAL, ensure_orphan_gc_schedule, parse_duration
from startup.search_attributes import SearchAttributesMissing, ensure_search_attributes
from workflows.lifecycle import ProxyLifecycle
from workflows.orphan_gc import OrphanGC
from workflows.payloads import with_input_payload_converter
from workflows.pool import ProxyPool
from workflows.upgrade_check import check_upgrade, report
from workflows.versioned import VersionedOrphanGC, VersionedProxyLifecycle, VersionedProxyPool

DEFAULT_METRICS_ADDRESS = "127.0.0.1:9464"
METRICS_ENV = "PROXY_OPERATOR_METRICS_ADDRESS"
# A proxy of its own holds one activity slot for its monitor as long as it
# is Ready; a pool's members hold one per shard (policies.POOL_MONITOR_SHARD).
DEFAULT_MAX_ACTIVITIES = 2000
# Workflow tasks are pure CPU under one GIL: a worker given 100 at once (the
# SDK's default) runs each at 1/100th of a core, so a burst (a 1,000-member
# pool starting) makes every task, the pool's included, take seconds and
# some time out. A few slots keep a task's start-to-close short; the rest
# wait on the server, where waiting costs nothing (docs/operations.md).
DEFAULT_MAX_WORKFLOW_TASKS = 8
MIN_WORKFLOW_TASKS = 2
GRACEFUL_SHUTDOWN = timedelta(seconds=20)
# What the server (1.32) refuses in a deployment version, or ignores without
# a word: its workers would poll and never be given a task. Names starting
# with "__" are Temporal's; "." separates a version's deployment name from
# its build id ("<deployment>.<build id>").
RESERVED_PREFIX = "__"
VERSION_SEPARATOR = "."
MAX_BUILD_ID_LENGTH = 255
# What `--serve` takes: both task queues, or one of them.
SERVE_ALL, SERVE_PROXIES, SERVE_POOLS = "all", "proxies", "pools"
SERVE_CHOICES = (SERVE_ALL, SERVE_PROXIES, SERVE_POOLS)

log = logging.getLogger("proxy_operator.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.argument_parser(
        "proxy-operator-worker",
        __doc__,
        metrics_env=METRICS_ENV,
        metrics_default=DEFAULT_METRICS_ADDRESS,
    )
    parser.add_argument(
        "--check-upgrade",
        action="store_true",
        help="replay every running workflow of the namespace against this build, list "
        "those started before the release it upgrades from, and exit: 0 if it may take "
        "them over, 1 if not (docs/upgrades.md)",
    )
    parser.add_argument(
        "--task-queue",
        default=TASK_QUEUE,
        help=f"proxies' task queue; pools' is its name + {POOL_QUEUE_SUFFIX!r}; "
        "default %(default)s",
    )
    cli.env_argument(
        parser,
        "--serve",
        "PROXY_OPERATOR_SERVE",
        f"which task queues to poll: both ({SERVE_ALL}), the proxies' with OrphanGC "
        f"({SERVE_PROXIES}) or the pools' ({SERVE_POOLS})",
        default=SERVE_ALL,
        type=serve_choice,
    )
    parser.add_argument(
        "--max-concurrent-activities",
        type=int,
        default=DEFAULT_MAX_ACTIVITIES,
        help="one slot per standalone proxy's monitor, one per pool shard; default %(default)s",
    )
    parser.add_argument(
        "--max-concurrent-workflow-tasks",
        type=workflow_task_slots,
        default=DEFAULT_MAX_WORKFLOW_TASKS,
        help="workflow tasks this worker runs at once (CPU-bound: a few per core); "
        "default %(default)s",
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
    cli.env_argument(
        parser,
        "--deployment-name",
        "PROXY_OPERATOR_DEPLOYMENT_NAME",
        "Worker Versioning: the Worker Deployment this worker is a version of, "
        "with --build-id; unset, the worker is unversioned",
        type=deployment_name,
    )
    cli.env_argument(
        parser,
        "--build-id",
        "PROXY_OPERATOR_BUILD_ID",
        "Worker Versioning: this worker's version within --deployment-name",
        type=build_id,
    )
    args = parser.parse_args(argv)
    if bool(args.deployment_name) != bool(args.build_id):
        parser.error("--deployment-name and --build-id (Worker Versioning) go together")
    return args


def deployment_name(value: str) -> str:
    """A Worker Deployment's name the server accepts; empty leaves the worker unversioned."""
    if VERSION_SEPARATOR in value:
        raise argparse.ArgumentTypeError(
            f"{value!r} contains {VERSION_SEPARATOR!r}, which separates it from the build id"
        )
    return _not_reserved(value)


def build_id(value: str) -> str:
    """A build id the server accepts."""
    if len(value) > MAX_BUILD_ID_LENGTH:
        raise argparse.ArgumentTypeError(
            f"{len(value)} characters, more than the {MAX_BUILD_ID_LENGTH} a build id may have"
        )
    return _not_reserved(value)


def serve_choice(value: str) -> str:
    """One of the `--serve` choices, also when it comes from the environment (which
    argparse's own `choices` would not check)."""
    if value not in SERVE_CHOICES:
        raise argparse.ArgumentTypeError(f"{value!r}: one of {', '.join(SERVE_CHOICES)}")
    return value


def workflow_task_slots(value: str) -> int:
    """At least 2: with a workflow cache the SDK refuses fewer (it polls two queues, the
    task queue and this worker's sticky one)."""
    try:
        slots = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if slots < MIN_WORKFLOW_TASKS:
        raise argparse.ArgumentTypeError(f"{slots}: at least {MIN_WORKFLOW_TASKS}")
    return slots


def _not_reserved(value: str) -> str:
    if value.startswith(RESERVED_PREFIX):
        raise argparse.ArgumentTypeError(
            f"{value!r} starts with {RESERVED_PREFIX!r}, which Temporal keeps for itself"
        )
    return value


def deployment_version(args: argparse.Namespace) -> WorkerDeploymentVersion | None:
    """The Worker Deployment version the flags ask for; None for an unversioned worker."""
    if not args.deployment_name:
        return None
    return WorkerDeploymentVersion(args.deployment_name, args.build_id)


def main(argv: list[str] | None = None) -> int:
    cli.configure_logging()
    args = parse_args(argv)
    if args.check_upgrade:
        return asyncio.run(_check_upgrade())
    if not args.providers_config:
        print("error: --providers-config (or PROXY_OPERATOR_CONFIG) is required", file=sys.stderr)
        return 2
    try:
        config = load_config(args.providers_config)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    health = cli.Health()
    try:
        runtime = _runtime_with_metrics(args.metrics_address, health)
    except cli.MetricsAddressError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(config, args, health, runtime))
    except SearchAttributesMissing as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def _check_upgrade() -> int:
    found = await check_upgrade(await cli.connect())
    report(found, sys.stdout)
    return 0 if found.ok else 1


async def serve(
    config: Config, args: argparse.Namespace, health: cli.Health, runtime: Runtime | None
) -> int:
    providers = build_providers(config)
    client = await cli.connect(runtime)
    await ensure_search_attributes(client)
    activities = ProviderActivities(providers, config)
    serves_proxies = args.serve != SERVE_POOLS
    if serves_proxies and args.orphan_gc_schedule:
        await ensure_orphan_gc_schedule(
            client, task_queue=args.task_queue, interval=args.orphan_gc_interval
        )
    version = deployment_version(args)
    workers: list[Worker] = []
    if serves_proxies:
        workers.append(
            build_worker(
                client,
                activities,
                gc=GcActivities(providers, config.installation, client),
                task_queue=args.task_queue,
                max_concurrent_activities=args.max_concurrent_activities,
                max_concurrent_workflow_tasks=args.max_concurrent_workflow_tasks,
                deployment=version,
            )
        )
    if args.serve != SERVE_PROXIES:
        workers.append(
            build_pool_worker(
                client,
                activities,
                task_queue=args.task_queue + POOL_QUEUE_SUFFIX,
                max_concurrent_workflow_tasks=args.max_concurrent_workflow_tasks,
                deployment=version,
            )
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "worker on task queue %s (namespace %s, %s), providers: %s",
        ", ".join(w.task_queue for w in workers),
        client.namespace,
        "unversioned" if version is None else f"version {version.to_canonical_string()}",
        ", ".join(f"{e.name} ({e.type})" for e in config.providers),
    )
    async with contextlib.AsyncExitStack() as running:
        for worker in workers:
            await running.enter_async_context(worker)
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
    max_concurrent_workflow_tasks: int = DEFAULT_MAX_WORKFLOW_TASKS,
    deployment: WorkerDeploymentVersion | None = None,
) -> Worker:
    """The one place that says which workflows and activities a worker serves.

    OrphanGC is served when its activities are given, as every real worker does.
    ProxyPool always is: its one activity needs only the Temporal client.
    A worker given a `deployment` version serves the same workflows with
    their versioning behaviours (workflows/versioned.py says which and why).
    """
    gc_activities: list[Callable[..., Any]] = (
        [] if gc is None else [gc.providers, gc.survey, gc.confirm, gc.record_deleted]
    )
    lifecycle, pool, orphan_gc = (
        (ProxyLifecycle, ProxyPool, OrphanGC)
        if deployment is None
        else (VersionedProxyLifecycle, VersionedProxyPool, VersionedOrphanGC)
    )
    return Worker(
        # Undecodable start arguments fail the workflow instead of wedging it.
        with_input_payload_converter(client),
        task_queue=task_queue,
        workflows=[lifecycle, pool] + ([] if gc is None else [orphan_gc]),
        activities=[
            activities.validate_target,
            activities.create_instance,
            activities.wait_running,
            activities.wait_healthy,
            activities.monitor,
            activities.monitor_members,
            activities.delete_instance,
            activities.wait_gone,
            activities.verify_endpoint,
            *_pool_activities(client),
            *gc_activities,
        ],
        max_concurrent_activities=max_concurrent_activities,
        max_concurrent_workflow_tasks=max_concurrent_workflow_tasks,
        # One cached workflow per activity slot, so a monitor's report-back
        # (every MONITOR_PERIOD) never has to replay an evicted history.
        max_cached_workflows=max_concurrent_activities,
        **_common_settings(deployment),
    )


def build_pool_worker(
    client: Client,
    activities: ProviderActivities,
    *,
    task_queue: str = POOL_TASK_QUEUE,
    max_concurrent_workflow_tasks: int = DEFAULT_MAX_WORKFLOW_TASKS,
    deployment: WorkerDeploymentVersion | None = None,
) -> Worker:
    """A worker for pools alone, on the pools' task queue.

    Its pools run their members and activities on the proxies' queue
    (contract.members_task_queue), so it serves no activity but the input
    check every workflow runs locally, and spends its CPU on pool tasks only.
    """
    return Worker(
        with_input_payload_converter(client),
        task_queue=task_queue,
        workflows=[ProxyPool if deployment is None else VersionedProxyPool],
        activities=[activities.validate_target],
        max_concurrent_workflow_tasks=max_concurrent_workflow_tasks,
        **_common_settings(deployment),
    )


def _common_settings(deployment: WorkerDeploymentVersion | None) -> dict[str, Any]:
    """What every worker of this process shares: how it drains, which version it is."""
    return {
        "graceful_shutdown_timeout": GRACEFUL_SHUTDOWN,
        "deployment_config": (
            None
            if deployment is None
            else WorkerDeploymentConfig(version=deployment, use_worker_versioning=True)
        ),
    }


def _pool_activities(client: Client) -> list[Callable[..., Any]]:
    pool = PoolActivities(client)
    return [pool.closed_members, pool.end_orphaned_members]


# ---- metrics and health ---------------------------------------------------------------


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


def _runtime_with_metrics(address: str, health: cli.Health) -> Runtime | None:
    """The SDK's runtime exporting to our listener on `address`; MetricsAddressError if taken.

    Our listener is bound first, so a second worker on one host stops there,
    before the SDK's runtime exists.
    """
    if not address:
        return None
    cli.serve_metrics(address, health, REGISTRY, METRICS_ENV)
    sdk_address = f"127.0.0.1:{_free_port()}"
    runtime = cli.sdk_runtime(PrometheusConfig(bind_address=sdk_address, durations_as_seconds=True))
    REGISTRY.register(_SdkMetrics(f"http://{sdk_address}/metrics"))
    return runtime


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run() -> NoReturn:
    """The console entry point; leaves as the gateway's does (cli.run says why)."""
    cli.run(main)


if __name__ == "__main__":
    run()
