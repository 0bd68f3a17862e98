"""worker.py as a process: config errors, crash recovery, metrics, draining, Worker Versioning.

These start `python worker.py` exactly as an operator would, against the
session's dev server, and kill it with SIGKILL to prove that all state is in
Temporal and on disk, not in the worker.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import RoutingConfigUpdateState
from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest,
    SetWorkerDeploymentCurrentVersionRequest,
)
from temporalio.client import Client, WorkflowHandle
from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

import worker
from contract import POOL_QUEUE_SUFFIX
from providers.base import CreateRequest
from providers.local import LocalProvider
from providers.naming import owner_tags
from squid.conf import ProxySettings
from tests.helpers.config import (
    LOOPBACK_ORIGIN_DENIED,
    PASSWORD,
    PASSWORD_ENV,
    local_entry,
    local_settings,
)
from tests.helpers.network import free_port
from tests.helpers.procfs import squid_pids
from tests.helpers.tls_origin import serve_tls_origin
from tests.helpers.waiting import status_of, wait_for, wait_status
from tests.helpers.worker_process import (  # noqa: F401 (a fixture)
    ROOT,
    LocalWorker,
    StartWorker,
    local_worker,
    origin,
    worker_process,
    write_worker_config,
)
from workflows.inputs import MIN_HEARTBEAT_TIMEOUT_SECONDS
from workflows.pool import REPORTS_REFUSED_METRIC

INSTALLATION = "worker-test"
DEPLOYMENT_NAME_ENV = "PROXY_OPERATOR_DEPLOYMENT_NAME"
BUILD_ID_ENV = "PROXY_OPERATOR_BUILD_ID"


def test_broken_config_exits_2_listing_every_problem(tmp_path: Path) -> None:
    config = tmp_path / "providers.yaml"
    config.write_text(
        "installation: Bad_Name\nproxy: {auth: {password_env: NOPE_NOT_SET}, allowed_cidrs: "
        "[10.0.0.0/33], allowed_connect_ports: [0]}\nproviders:\n  - {name: a, type: cloud}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NOPE_NOT_SET"}
    run = subprocess.run(
        [sys.executable, "worker.py", "--providers-config", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2
    for fragment in (
        "installation:",
        "proxy.allowed_cidrs:",
        "proxy.allowed_connect_ports[0]:",
        "providers[0].type: unknown type 'cloud'",
        "proxy.auth.password_env: environment variable NOPE_NOT_SET is not set",
    ):
        assert fragment in run.stderr
    assert "Traceback" not in run.stderr


def test_a_second_worker_on_a_taken_metrics_address_exits_2_naming_the_flag(
    tmp_path: Path,
) -> None:
    config = write_worker_config(
        tmp_path / "providers.yaml", local_entry(tmp_path / "state"), 443, INSTALLATION
    )
    # What holds the address could be another worker; any listener is the same to this one.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        run = subprocess.run(
            [sys.executable, "worker.py", "--providers-config", str(config)],
            cwd=ROOT,
            env={**os.environ, PASSWORD_ENV: PASSWORD, worker.METRICS_ENV: address},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    assert run.returncode == 2, run.stderr
    assert f"--metrics-address (or PROXY_OPERATOR_METRICS_ADDRESS): {address} is in use" in (
        run.stderr
    )
    assert "Traceback" not in run.stderr


def test_metrics_listen_on_loopback_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """/metrics and /healthz take no token: reaching them from elsewhere is asked for."""
    monkeypatch.delenv(worker.METRICS_ENV, raising=False)
    host, _, _ = worker.parse_args([]).metrics_address.rpartition(":")
    assert ipaddress.ip_address(host).is_loopback


async def healthy(metrics: str) -> bool:
    def get() -> bool:
        try:
            with urllib.request.urlopen(f"http://{metrics}/healthz", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    return await asyncio.to_thread(get)


@pytest.mark.slow
async def test_killed_workers_lose_nothing(
    temporal_env: WorkflowEnvironment,
    worker_process: StartWorker,  # noqa: F811
    state_dir: Path,
    tmp_path: Path,
) -> None:
    # The origin is not up yet, so the proxy stays Provisioning (first probe
    # failing) long enough to kill the worker mid-way.
    origin_port = free_port()
    config = write_worker_config(
        tmp_path / "providers.yaml", local_entry(state_dir), origin_port, INSTALLATION
    )
    task_queue = f"test-{uuid.uuid4().hex[:12]}"
    metrics = f"127.0.0.1:{free_port()}"

    with serve_tls_origin(origin_port) as served:
        ca_file = tmp_path / "ca.pem"
        served.ca.cert_pem.write_to_path(str(ca_file))
    env = {"SSL_CERT_FILE": str(ca_file), "PROXY_OPERATOR_METRICS_ADDRESS": metrics}

    first = worker_process(config, task_queue, env)
    # The shortest heartbeat timeout: a terminate waits that long for the
    # monitor of a worker killed below (270 s by default).
    heartbeat_timeout = MIN_HEARTBEAT_TIMEOUT_SECONDS
    health = {
        "target": f"https://127.0.0.1:{origin_port}/",
        "heartbeat_timeout_seconds": heartbeat_timeout,
    }
    handle = await temporal_env.client.start_workflow(
        "ProxyLifecycle",
        {"provider": "local", "health": health},
        id=f"proxy-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
    )
    provisioning = await wait_status(
        handle, lambda s: s.state == "Provisioning" and bool(s.endpoint), "a running instance"
    )
    first.kill()
    first.wait()

    # Same CA, same port: the origin comes up while no worker runs.
    with serve_tls_origin(origin_port) as served:
        served.ca.cert_pem.write_to_path(str(ca_file))
        second = worker_process(config, task_queue, env)
        ready = await wait_status(
            handle, lambda s: s.state == "Ready", "Ready on the second worker", deadline=120
        )
        assert ready.instance == provisioning.instance
        assert len(squid_pids(state_dir)) == 1
        await wait_for(lambda: healthy(metrics), "the worker's /healthz")
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
        )
        assert 'proxy_operator_probes_total{outcome="ok",provider="local"}' in body
        assert "temporal_request" in body  # the SDK's own metrics, same endpoint

        second.kill()
        second.wait()
        third = worker_process(config, task_queue, env)
        await handle.signal("terminate")
        # The instance is deleted at once; the workflow closes once its
        # monitor has ended, which, its worker dead, the server decides at the
        # monitor's heartbeat timeout.
        await wait_for(lambda: squid_pids(state_dir) == [], "the instance deleted", 60)
        result = await asyncio.wait_for(handle.result(), timeout=heartbeat_timeout + 120)
        assert result["state"] == "Terminated"
        assert squid_pids(state_dir) == []
        assert (await status_of(handle)).state == "Terminated"

        third.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(third.wait, 60) == 0
    assert not await asyncio.to_thread(lambda: [p for p in state_dir.iterdir() if p.is_dir()])


async def test_a_memory_provider_proxy_goes_ready_and_away_through_the_worker(
    temporal_env: WorkflowEnvironment,
    worker_process: StartWorker,  # noqa: F811
    state_dir: Path,
    tmp_path: Path,
) -> None:
    # A memory instance claims 127.0.0.1 at the requested port: a real Squid
    # listens there, so the worker's probes through it are real.
    with serve_tls_origin() as served:
        ca_file = tmp_path / "ca.pem"
        served.ca.cert_pem.write_to_path(str(ca_file))
        upstream = LocalProvider(local_settings(state_dir), "worker-test")
        squid = upstream.create(
            CreateRequest(
                name="upstream",
                proxy=ProxySettings(
                    3128,
                    "proxy",
                    PASSWORD,
                    ("127.0.0.0/8",),
                    (served.port,),
                    denied_destinations=LOOPBACK_ORIGIN_DENIED,
                ),
                tags=owner_tags(INSTALLATION, "upstream", 0),
            )
        )
        config = write_worker_config(
            tmp_path / "providers.yaml",
            {"name": "demo", "type": "memory"},
            served.port,
            INSTALLATION,
        )
        task_queue = f"test-{uuid.uuid4().hex[:12]}"
        worker_process(config, task_queue, {"SSL_CERT_FILE": str(ca_file)})
        handle = await temporal_env.client.start_workflow(
            "ProxyLifecycle",
            {
                "provider": "demo",
                "port": squid.port,
                "health": {"target": f"https://127.0.0.1:{served.port}/", "interval_seconds": 1},
            },
            id=f"proxy-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )
        ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready on memory")
        assert ready.endpoint == f"127.0.0.1:{squid.port}"
        await handle.signal("terminate")
        # A deleted instance stops serving; a memory one only claims the
        # upstream's address, which would go on answering, so the monitor
        # would hear of the terminate only with its next heartbeat. The
        # upstream stops as the instance's deletion would stop it.
        await asyncio.to_thread(upstream.delete, squid.provider_id)
        result = await asyncio.wait_for(handle.result(), timeout=60)
        assert result["state"] == "Terminated"


@pytest.mark.slow
async def test_a_pool_in_a_worker_of_its_own_keeps_its_members_in_the_proxies_worker(
    temporal_env: WorkflowEnvironment,
    worker_process: StartWorker,  # noqa: F811
    origin: tuple[int, dict[str, str]],  # noqa: F811
    state_dir: Path,
    tmp_path: Path,
) -> None:
    """`--serve proxies` and `--serve pools` (from the environment), one process each;
    the pools' worker counts the member reports its pools refuse in /metrics."""
    origin_port, env = origin
    config = write_worker_config(
        tmp_path / "providers.yaml", local_entry(state_dir), origin_port, INSTALLATION
    )
    task_queue = f"test-{uuid.uuid4().hex[:12]}"
    metrics = f"127.0.0.1:{free_port()}"
    worker_process(config, task_queue, {**env, "PROXY_OPERATOR_SERVE": "proxies"})
    pools_env = {**env, "PROXY_OPERATOR_SERVE": "pools", "PROXY_OPERATOR_METRICS_ADDRESS": metrics}
    worker_process(config, task_queue, pools_env)
    handle = await temporal_env.client.start_workflow(
        "ProxyPool",
        {
            "replicas": 1,
            "template": {
                "provider": "local",
                "health": {"target": f"https://127.0.0.1:{origin_port}/", "interval_seconds": 1},
            },
        },
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue + POOL_QUEUE_SUFFIX,
    )

    async def listed() -> bool:
        return len(await handle.query("endpoints")) == 1

    await wait_for(listed, "the member's endpoint listed", 90)
    # Two forged reports: one malformed, one stamped in the future.
    await handle.signal("member_changed", {"member": 7})
    await handle.signal(
        "member_changed",
        {"member": f"{handle.id}/0", "state": "Ready", "endpoint": "127.0.0.1:1",
         "provider": "local", "generation": 9, "at": "2099-01-01T00:00:00+00:00", "seq": 1},
    )  # fmt: skip

    async def refused() -> bool:
        return bool((await handle.query("status"))["rejected_reports"] == 2)

    await wait_for(refused, "both reports refused", 60)
    await wait_for(lambda: healthy(metrics), "the pools' worker's /healthz")
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    )
    [counted] = [
        line
        for line in body.splitlines()
        if line.startswith(REPORTS_REFUSED_METRIC) and 'workflow_type="ProxyPool"' in line
    ]
    assert float(counted.split()[-1]) == 2, counted
    await handle.signal("terminate")
    result = await asyncio.wait_for(handle.result(), timeout=90)
    assert result["state"] == "Terminated"
    assert squid_pids(state_dir) == []
    logs = [(tmp_path / f"worker-{n}.log").read_text() for n in range(2)]
    assert f"worker on task queue {task_queue} (" in logs[0]
    assert f"worker on task queue {task_queue}{POOL_QUEUE_SUFFIX} (" in logs[1]


# ---- Worker Versioning ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "error"),
    [
        (
            ["--deployment-name", "proxy.operator", "--build-id", "b1"],
            {},
            "argument --deployment-name: 'proxy.operator' contains '.'",
        ),
        (
            ["--build-id", "b1"],
            {DEPLOYMENT_NAME_ENV: "proxy.operator"},
            "argument --deployment-name: 'proxy.operator' contains '.'",
        ),
        (
            ["--deployment-name", "__proxy", "--build-id", "b1"],
            {},
            "argument --deployment-name: '__proxy' starts with '__'",
        ),
        (
            ["--deployment-name", "proxy-operator", "--build-id", "__b1"],
            {},
            "argument --build-id: '__b1' starts with '__'",
        ),
        (
            ["--deployment-name", "proxy-operator", "--build-id", "b" * 256],
            {},
            "argument --build-id: 256 characters, more than the 255",
        ),
        (
            ["--build-id", "b1"],
            {},
            "--deployment-name and --build-id (Worker Versioning) go together",
        ),
        ([], {DEPLOYMENT_NAME_ENV: "proxy-operator"}, "go together"),
    ],
)
def test_bad_deployment_versions_exit_2_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    error: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A version the server would refuse, or ignore and never give a task, stops the worker."""
    for name in (DEPLOYMENT_NAME_ENV, BUILD_ID_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        worker.parse_args(argv)
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("1", "argument --max-concurrent-workflow-tasks: 1: at least 2"),
        ("-8", "argument --max-concurrent-workflow-tasks: -8: at least 2"),
        ("many", "argument --max-concurrent-workflow-tasks: 'many' is not a whole number"),
        ("", "argument --max-concurrent-workflow-tasks: '' is not a whole number"),
    ],
)
def test_too_few_workflow_task_slots_exit_2_naming_the_flag(
    value: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The SDK needs two with a workflow cache (it polls the task queue and the
    # worker's sticky one) and would otherwise refuse only once the worker is
    # built, with a traceback.
    with pytest.raises(SystemExit) as exited:
        worker.parse_args(["--max-concurrent-workflow-tasks", value])
    assert exited.value.code == 2
    assert error in capsys.readouterr().err
    assert worker.parse_args([]).max_concurrent_workflow_tasks == worker.DEFAULT_MAX_WORKFLOW_TASKS
    assert (
        worker.parse_args(["--max-concurrent-workflow-tasks", "2"]).max_concurrent_workflow_tasks
        == 2
    )


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--serve", "pool"], {}),
        ([], {"PROXY_OPERATOR_SERVE": "everything"}),
        (["--serve", ""], {}),
    ],
)
def test_an_unknown_serve_choice_exits_2_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        worker.parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --serve: " in err
    assert "one of all, proxies, pools" in err
    monkeypatch.delenv("PROXY_OPERATOR_SERVE", raising=False)
    assert worker.parse_args([]).serve == worker.SERVE_ALL
    assert worker.parse_args(["--serve", "pools"]).serve == worker.SERVE_POOLS


def test_the_deployment_version_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEPLOYMENT_NAME_ENV, "proxy-operator")
    monkeypatch.setenv(BUILD_ID_ENV, "2026-12-02.1")
    assert worker.deployment_version(worker.parse_args([])) == WorkerDeploymentVersion(
        "proxy-operator", "2026-12-02.1"
    )
    monkeypatch.setenv(DEPLOYMENT_NAME_ENV, "")
    monkeypatch.setenv(BUILD_ID_ENV, "")
    assert worker.deployment_version(worker.parse_args([])) is None


async def make_current(client: Client, version: WorkerDeploymentVersion) -> bool:
    """`temporal worker deployment set-current-version`; False until the version's workers poll."""
    try:
        await client.workflow_service.set_worker_deployment_current_version(
            SetWorkerDeploymentCurrentVersionRequest(
                namespace=client.namespace,
                deployment_name=version.deployment_name,
                build_id=version.build_id,
            )
        )
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
        return False
    return True


async def routed(client: Client, version: WorkerDeploymentVersion) -> bool:
    """Whether the deployment's routing to its current version has reached every task queue.

    The server propagates a new current version to the task queues after
    `set-current-version` returns; until then a task may still go to an
    unversioned poller (`temporal worker deployment describe` shows the state).
    """
    described = await client.workflow_service.describe_worker_deployment(
        DescribeWorkerDeploymentRequest(
            namespace=client.namespace, deployment_name=version.deployment_name
        )
    )
    info = described.worker_deployment_info
    return (
        info.routing_config.current_deployment_version.build_id == version.build_id
        and info.routing_config_update_state
        == RoutingConfigUpdateState.ROUTING_CONFIG_UPDATE_STATE_COMPLETED
    )


async def version_of(
    handle: WorkflowHandle[object, object],
) -> tuple[WorkerDeploymentVersion, VersioningBehavior]:
    """The deployment version a workflow runs on, and its versioning behaviour, as described."""
    description = await handle.describe()
    info = description.raw_description.workflow_execution_info.versioning_info
    version = info.deployment_version
    return (
        WorkerDeploymentVersion(version.deployment_name, version.build_id),
        VersioningBehavior(info.behavior),
    )


async def test_a_fleet_moves_from_unversioned_workers_to_a_deployment_version(
    temporal_env: WorkflowEnvironment,
    local_worker: LocalWorker,  # noqa: F811
    state_dir: Path,
) -> None:
    """Without the flags a worker is unversioned; a version made current takes the new work."""
    client = temporal_env.client
    task_queue = local_worker.task_queue
    before = await client.start_workflow(
        "OrphanGC", {"dry_run": True}, id=f"gc-{uuid.uuid4().hex[:8]}", task_queue=task_queue
    )
    await asyncio.wait_for(before.result(), timeout=60)
    unversioned = (WorkerDeploymentVersion("", ""), VersioningBehavior.UNSPECIFIED)
    assert await version_of(before) == unversioned

    # A deployment of its own: the dev server is the whole session's.
    version = WorkerDeploymentVersion(f"proxy-operator-{uuid.uuid4().hex[:8]}", "build-1")
    deployment = {DEPLOYMENT_NAME_ENV: version.deployment_name, BUILD_ID_ENV: version.build_id}
    local_worker.start(local_worker.config, task_queue, {**local_worker.env, **deployment})
    # A version takes no task until it is made current, as in a rollout.
    await wait_for(lambda: make_current(client, version), "the new version's workers to poll")
    await wait_for(lambda: routed(client, version), "the current version to reach the task queue")

    proxy = await client.start_workflow(
        "ProxyLifecycle",
        {
            "provider": "local",
            "health": {"target": f"https://127.0.0.1:{local_worker.origin_port}/"},
        },
        id=f"proxy-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
    )
    await wait_status(proxy, lambda s: s.state == "Ready", "Ready on the versioned worker")
    assert await version_of(proxy) == (version, VersioningBehavior.AUTO_UPGRADE)
    sweep = await client.start_workflow(
        "OrphanGC", {"dry_run": True}, id=f"gc-{uuid.uuid4().hex[:8]}", task_queue=task_queue
    )
    await asyncio.wait_for(sweep.result(), timeout=60)
    assert await version_of(sweep) == (version, VersioningBehavior.PINNED)

    await proxy.signal("terminate")
    result = await asyncio.wait_for(proxy.result(), timeout=60)
    assert result["state"] == "Terminated"
    assert squid_pids(state_dir) == []
