"""`make run` (deploy/local/devenv.py) as a newcomer meets it, on ports of its own.

The real script runs: a dev server, a worker and local Squids on loopback,
with a health target that is the local TLS origin. The reachability warning
is checked against a loopback port that refuses, so nothing here reaches
beyond this machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from temporalio.client import Client

from providers.procfs import running
from tests.helpers.config import PASSWORD, PASSWORD_ENV, local_entry, raw_config
from tests.helpers.network import accepts_connections, free_port
from tests.helpers.state_dir import local_state_dir
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import wait_for, wait_status

ROOT = Path(__file__).resolve().parents[2]
DEVENV = ROOT / "deploy" / "local" / "devenv.py"
PROXIES = 3


def _load_devenv() -> ModuleType:
    spec = importlib.util.spec_from_file_location("devenv", DEVENV)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refusing_url() -> str:
    """An https URL on loopback where nothing listens: connections are refused."""
    return f"https://127.0.0.1:{free_port()}/"


def test_unreachable_health_target_warns_saying_how_to_set_it(
    capsys: pytest.CaptureFixture[str], tls_origin: TlsOrigin
) -> None:
    devenv = _load_devenv()
    devenv._warn_if_unreachable(tls_origin.url)
    assert capsys.readouterr().out == ""

    target = refusing_url()
    devenv._warn_if_unreachable(target)
    warning = capsys.readouterr().out
    assert f"{target} is not reachable from this machine" in warning
    assert "Connection refused" in warning
    assert '"health": {"target": "https://<a reachable host>"}' in warning


class _Output:
    """devenv's merged stdout and stderr, read until the test closes the pipe."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        self._pipe = process.stdout
        self._chunks: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._pipe], [], [], 0.1)
            if ready:
                chunk = os.read(self._pipe.fileno(), 65536)
                if not chunk:
                    return
                self._chunks.append(chunk)

    @property
    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def close(self) -> None:
        """What `tee` dying on Ctrl-C does to devenv: its stdout is a pipe nobody reads."""
        self._stop.set()
        self._thread.join()
        self._pipe.close()


@pytest.fixture
def devenv_dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    with local_state_dir() as state_dir:
        yield tmp_path / "data", state_dir


@pytest.mark.slow
async def test_ctrl_c_with_stdout_closed_stops_every_squid(
    tls_origin: TlsOrigin, devenv_dirs: tuple[Path, Path]
) -> None:
    data, state_dir = devenv_dirs
    config = data.parent / "providers.yaml"
    raw = raw_config(
        local_entry(state_dir),
        connect_ports=[tls_origin.port],
        installation=f"devenv-{uuid.uuid4().hex[:8]}",
    )
    config.write_text(yaml.safe_dump(raw))
    # The worker's probes trust the origin's throwaway CA, as test_worker.py's do.
    ca_file = data.parent / "ca.pem"
    tls_origin.ca.cert_pem.write_to_path(str(ca_file))
    port, ui_port, metrics_port = free_port(), free_port(), free_port()
    target = refusing_url()
    process = start_devenv(data, config, ca_file, target, (port, ui_port, metrics_port))
    output = _Output(process)
    try:
        await wait_for(
            lambda: "proxy-operator is running." in output.text or process.poll() is not None,
            "devenv to print its guide",
            deadline=120,
        )
        assert process.poll() is None, output.text
        assert f"{target} is not reachable from this machine" in output.text

        client = await Client.connect(f"127.0.0.1:{port}")
        handles: list[Any] = []
        for n in range(PROXIES):
            handles.append(
                await client.start_workflow(
                    "ProxyLifecycle",
                    {"provider": "local", "health": {"target": tls_origin.url}},
                    id=f"proxy-devenv-{n}",
                    task_queue="proxy-operator",
                )
            )
        pids = []
        for handle in handles:
            status = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
            pids.append(_pid_of(state_dir, status.instance))
        assert all(running(pid) for pid in pids)

        output.close()
        os.killpg(process.pid, signal.SIGINT)
        returncode = await wait_for_exit(process)
        assert [pid for pid in pids if running(pid)] == [], "Squids left running"
        assert [p.name for p in state_dir.iterdir() if p.is_dir()] == []
        assert not accepts_connections(port), "the dev server is still running"
        assert returncode == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def start_devenv(
    data: Path, config: Path, ca_file: Path, target: str, ports: tuple[int, int, int]
) -> subprocess.Popen[bytes]:
    """`make run`'s command, with its output (stdout and stderr) on a pipe, as under `| tee`."""
    port, ui_port, metrics_port = ports
    command = [sys.executable, str(DEVENV), "--data-dir", str(data)]
    command += ["--providers-config", str(config), "--check-target", target]
    command += ["--port", str(port), "--ui-port", str(ui_port)]
    command += ["--metrics-port", str(metrics_port)]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, PASSWORD_ENV: PASSWORD, "SSL_CERT_FILE": str(ca_file)},
        # Its own process group, like a terminal's foreground job, so that
        # Ctrl-C can be sent to all of it (and only to it).
        start_new_session=True,
    )


async def wait_for_exit(process: subprocess.Popen[bytes]) -> int:
    await wait_for(lambda: process.poll() is not None, "devenv to stop everything", deadline=120)
    return process.returncode


def _pid_of(state_dir: Path, name: str) -> int:
    meta = json.loads((state_dir / name / "instance.json").read_text())
    return int(meta["pid"])
