"""worker.py as a process: config errors, crash recovery, metrics, draining.

These start `python worker.py` exactly as an operator would, against the
session's dev server, and kill it with SIGKILL to prove that all state is in
Temporal and on disk, not in the worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from providers.base import CreateRequest
from providers.local import LocalProvider
from providers.naming import owner_tags
from providers.procfs import processes_under
from providers.squid import ProxySettings
from tests.helpers.config import LOOPBACK_ORIGIN_DENIED, PASSWORD, local_entry, local_settings
from tests.helpers.network import free_port
from tests.helpers.tls_origin import serve_tls_origin
from tests.helpers.waiting import status_of, wait_for, wait_status
from tests.helpers.worker_process import (  # noqa: F401 (a fixture)
    ROOT,
    StartWorker,
    worker_process,
    write_worker_config,
)

INSTALLATION = "worker-test"


def squid_pids(state_dir: Path) -> list[int]:
    """Squid main processes (not their auth helpers) serving from `state_dir`."""
    return [
        pid
        for pid in processes_under(state_dir)
        if Path(f"/proc/{pid}/comm").read_text().strip() == "squid"
    ]


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

    with serve_tls_origin(origin_port) as origin:
        ca_file = tmp_path / "ca.pem"
        origin.ca.cert_pem.write_to_path(str(ca_file))
    env = {"SSL_CERT_FILE": str(ca_file), "PROXY_OPERATOR_METRICS_ADDRESS": metrics}

    first = worker_process(config, task_queue, env)
    handle = await temporal_env.client.start_workflow(
        "ProxyLifecycle",
        {"provider": "local", "health": {"target": f"https://127.0.0.1:{origin_port}/"}},
        id=f"proxy-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
    )
    provisioning = await wait_status(
        handle, lambda s: s.state == "Provisioning" and bool(s.endpoint), "a running instance"
    )
    first.kill()
    first.wait()

    # Same CA, same port: the origin comes up while no worker runs.
    with serve_tls_origin(origin_port) as origin:
        origin.ca.cert_pem.write_to_path(str(ca_file))
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
        result = await asyncio.wait_for(handle.result(), timeout=120)
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
    with serve_tls_origin() as origin:
        ca_file = tmp_path / "ca.pem"
        origin.ca.cert_pem.write_to_path(str(ca_file))
        upstream = LocalProvider(local_settings(state_dir), "worker-test")
        squid = upstream.create(
            CreateRequest(
                name="upstream",
                proxy=ProxySettings(
                    3128,
                    "proxy",
                    PASSWORD,
                    ("127.0.0.0/8",),
                    (origin.port,),
                    denied_destinations=LOOPBACK_ORIGIN_DENIED,
                ),
                tags=owner_tags(INSTALLATION, "upstream", 0),
            )
        )
        config = write_worker_config(
            tmp_path / "providers.yaml",
            {"name": "demo", "type": "memory"},
            origin.port,
            INSTALLATION,
        )
        task_queue = f"test-{uuid.uuid4().hex[:12]}"
        worker_process(config, task_queue, {"SSL_CERT_FILE": str(ca_file)})
        handle = await temporal_env.client.start_workflow(
            "ProxyLifecycle",
            {
                "provider": "demo",
                "port": squid.port,
                "health": {"target": f"https://127.0.0.1:{origin.port}/", "interval_seconds": 1},
            },
            id=f"proxy-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )
        ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready on memory")
        assert ready.endpoint == f"127.0.0.1:{squid.port}"
        await handle.signal("terminate")
        # A deleted instance stops serving; a memory one only claims the
        # upstream's address, which would go on answering, so the monitor
        # would hear of the terminate only with its next heartbeat (throttled
        # to 48 s). The upstream stops as the instance's deletion would stop it.
        await asyncio.to_thread(upstream.delete, squid.provider_id)
        result = await asyncio.wait_for(handle.result(), timeout=60)
        assert result["state"] == "Terminated"
