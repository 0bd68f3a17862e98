"""`python worker.py` as a process, started exactly as an operator would.

For the tests that kill, drain or read the log of a real worker process: the
`worker_process` and `origin` fixtures (import them into the test module)
and the config such a worker reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.testing import WorkflowEnvironment

from tests.helpers.config import PASSWORD, local_entry, raw_config
from tests.helpers.network import free_port
from tests.helpers.tls_origin import serve_tls_origin

ROOT = Path(__file__).resolve().parent.parent.parent
# The installation `local_worker` writes into its config.
WORKER_INSTALLATION = "worker-log-test"
# worker_process(config, task_queue, extra_env) -> the running process.
StartWorker = Callable[[Path, str, dict[str, str]], subprocess.Popen[bytes]]


def write_worker_config(
    path: Path, provider: dict[str, Any], connect_port: int, installation: str
) -> Path:
    """A providers config with one provider entry whose proxies may CONNECT to `connect_port`."""
    raw = raw_config(provider, connect_ports=[connect_port], installation=installation)
    path.write_text(yaml.safe_dump(raw))
    return path


@dataclass
class LocalWorker:
    """A worker process with the local provider, on a task queue of its own (`local_worker`)."""

    config: Path
    task_queue: str
    env: dict[str, str]
    # The TLS origin the proxies' health checks reach.
    origin_port: int
    start: StartWorker
    process: subprocess.Popen[bytes] | None = None

    def restart(self) -> subprocess.Popen[bytes]:
        """Start a worker process on this config and queue (another replica, or a replacement)."""
        self.process = self.start(self.config, self.task_queue, self.env)
        return self.process


@pytest.fixture
def local_worker(
    worker_process: StartWorker,
    origin: tuple[int, dict[str, str]],
    state_dir: Path,
    tmp_path: Path,
) -> LocalWorker:
    """A running worker process whose proxies may CONNECT to the `origin` fixture's port."""
    origin_port, env = origin
    config = write_worker_config(
        tmp_path / "providers.yaml", local_entry(state_dir), origin_port, WORKER_INSTALLATION
    )
    worker = LocalWorker(config, f"test-{uuid.uuid4().hex[:12]}", env, origin_port, worker_process)
    worker.restart()
    return worker


@pytest.fixture
def worker_process(temporal_env: WorkflowEnvironment, tmp_path: Path) -> Iterator[StartWorker]:
    """Start `python worker.py` processes; every one still alive is killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def start(config: Path, task_queue: str, extra_env: dict[str, str]) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
            "TEMPORAL_NAMESPACE": temporal_env.client.namespace,
            "PROXY_PASSWORD": PASSWORD,
            # Orphan GC's schedule has tests of its own; here it would only
            # add sweeps of the shared dev server.
            "PROXY_OPERATOR_ORPHAN_GC_SCHEDULE": "off",
            **extra_env,
        }
        log = open(tmp_path / f"worker-{len(started)}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(
            [
                sys.executable,
                "worker.py",
                "--providers-config",
                str(config),
                "--task-queue",
                task_queue,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """A TLS origin for the probes, and the worker environment that trusts it."""
    port = free_port()
    with serve_tls_origin(port) as served:
        ca_file = tmp_path / "ca.pem"
        served.ca.cert_pem.write_to_path(str(ca_file))
        yield port, {"SSL_CERT_FILE": str(ca_file), "PROXY_OPERATOR_METRICS_ADDRESS": ""}
