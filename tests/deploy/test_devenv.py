"""`make run` (deploy/local/devenv.py) as a newcomer meets it, on ports of its own.

The real script runs: a dev server, a worker and local Squids on loopback,
with a health target that is the local TLS origin or devenv's own demo site.
The reachability warning is checked against a loopback port that refuses,
so nothing here reaches beyond this machine: as on a machine without
internet, where the README's first proxy must still work.
"""

from __future__ import annotations

import asyncio
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
from typing import Any

import pytest
import yaml
from temporalio.client import Client

from squid.procfs import running
from tests.docs.markdown import examples
from tests.helpers.config import PASSWORD, PASSWORD_ENV, local_entry, raw_config
from tests.helpers.devenv import DEMO_SITE, DEVENV, demo_config, load_devenv
from tests.helpers.network import accepts_connections, free_port
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import BIN, TEMPORAL_CLI
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import wait_for, wait_status

ROOT = Path(__file__).resolve().parents[2]
PROXIES = 3


def refusing_url() -> str:
    """An https URL on loopback where nothing listens: connections are refused."""
    return f"https://127.0.0.1:{free_port()}/"


def test_unreachable_health_target_warns_saying_how_to_set_it(
    capsys: pytest.CaptureFixture[str], tls_origin: TlsOrigin
) -> None:
    devenv = load_devenv()
    assert devenv._warn_if_unreachable(tls_origin.url, None)
    assert capsys.readouterr().out == ""

    target = refusing_url()
    assert not devenv._warn_if_unreachable(target, None)
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
    env = {**os.environ, PASSWORD_ENV: PASSWORD, "SSL_CERT_FILE": str(ca_file)}
    process = start_devenv(data, config, target, (port, ui_port, metrics_port), env)
    output = _Output(process)
    try:
        await wait_for_guide(process, output)
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
    data: Path, config: Path, target: str, ports: tuple[int, int, int], env: dict[str, str]
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
        env=env,
        # Its own process group, like a terminal's foreground job, so that
        # Ctrl-C can be sent to all of it (and only to it).
        start_new_session=True,
    )


async def wait_for_guide(process: subprocess.Popen[bytes], output: _Output) -> None:
    """Until devenv has printed its commands: everything is up."""
    await wait_for(
        lambda: "proxy-operator is running." in output.text or process.poll() is not None,
        "devenv to print its guide",
        deadline=120,
    )
    assert process.poll() is None, output.text


async def wait_for_exit(process: subprocess.Popen[bytes]) -> int:
    await wait_for(lambda: process.poll() is not None, "devenv to stop everything", deadline=120)
    return process.returncode


def _pid_of(state_dir: Path, name: str) -> int:
    meta = json.loads((state_dir / name / "instance.json").read_text())
    return int(meta["pid"])


@pytest.mark.slow
async def test_offline_the_readmes_first_proxy_gets_ready_and_fetches_the_demo_page(
    tmp_path: Path, devenv_dirs: tuple[Path, Path]
) -> None:
    """README.md's "Your first proxy", as written, against `make run` with no internet.

    A clone of the repository, as the README's relative paths see it: its
    `.data` is devenv's, its `.venv/bin/temporal` the CLI. The environment
    has no proxy password and no CA bundle: devenv makes both, as for a
    newcomer. Only the demo site's port differs from the shipped config's, so
    that runs beside a developer's own `make run` cannot collide.
    """
    _, state_dir = devenv_dirs
    clone = tmp_path / "clone"
    (clone / ".venv" / "bin").mkdir(parents=True)
    (clone / ".venv" / "bin" / "temporal").symlink_to(TEMPORAL_CLI)
    site = f"127.0.0.1:{free_port()}"
    config = tmp_path / "providers.yaml"
    installation = f"devenv-{uuid.uuid4().hex[:8]}"
    config.write_text(yaml.safe_dump(demo_config(state_dir, installation, site)))
    port, ui_port, metrics_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in (PASSWORD_ENV, "SSL_CERT_FILE")}
    target = refusing_url()  # the internet, unreachable
    process = start_devenv(clone / ".data", config, target, (port, ui_port, metrics_port), env)
    output = _Output(process)
    try:
        await wait_for_guide(process, output)
        assert f"The commands below use the demo site https://{site} instead" in output.text
        assert f".data/demo-site/ca.pem https://{site}" in output.text

        client = await Client.connect(f"127.0.0.1:{port}")
        shell = {**env, "PATH": f"{BIN}:{env['PATH']}", "TEMPORAL_ADDRESS": f"127.0.0.1:{port}"}
        first_proxy = [e for e in examples(ROOT / "README.md", ROOT) if "proxy-demo" in e.text]
        printed = []
        for example in first_proxy:
            if wait := example.directive("wait"):
                workflow_id, state = wait
                handle = client.get_workflow_handle(workflow_id)
                await wait_status(handle, lambda s, at=state: s.state == at, " ".join(wait))
            run = await asyncio.to_thread(
                subprocess.run,
                ["bash", "-e", "-o", "pipefail", "-c", example.text.replace(DEMO_SITE, site)],
                cwd=clone,
                env=shell,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert run.returncode == 0, f"{example.source}:\n{run.stdout}{run.stderr}"
            printed.append(run.stdout)
        assert len(first_proxy) == 4, "README.md's first proxy: start, query, use, end"
        assert "<h1>proxy-operator demo site</h1>" in printed[2]
    finally:
        output.close()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            await wait_for_exit(process)
