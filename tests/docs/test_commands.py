"""Every `temporal` command in README.md, docs/operations.md and docs/upgrades.md, run as written.

The commands come out of the Markdown (tests/docs/markdown.py says how), so a
doc change that breaks one fails here. They run in bash, against a dev server
of this module's own, with the real worker
(`worker.py --no-orphan-gc-schedule`, as the schedule section assumes) and
real local Squids. A workspace stands in for the repository: `.venv/bin/temporal`
is the pip CLI and `.data/proxy-password` the proxy password.

Nothing may leave this machine, so the one substitution made to the text is
the docs' health target and test URL, https://example.com: it becomes a local
TLS origin, which the worker's probes and curl trust through SSL_CERT_FILE
and CURL_CA_BUNDLE. The README's first proxy needs no such help: it uses the
demo site `make run` serves (devenv's own, here on a port of this module's),
trusted by the CA `make run` writes. The worker's config is `make run`'s
(deploy/local/providers.yaml), whose only way to loopback is the demo site;
the origin is let through the same way.

The examples about one workflow run in document order, as a reader runs
them; those about different workflows run side by side, as a reader's
proxies and pools run at once (the pool examples wait minutes of drains and
rotations between them). An example that names no workflow, or several
being run apart, or that checks what it prints, runs alone, after
everything before it and before anything after it.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from tests.docs.markdown import Example, console_commands, examples
from tests.helpers.config import INSTALLATION, PASSWORD, PASSWORD_ENV
from tests.helpers.devenv import DEMO_SITE, demo_config, load_devenv
from tests.helpers.network import free_port
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import BIN, TEMPORAL_CLI, start_dev_server
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import wait_for, wait_status

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/operations.md", "docs/upgrades.md")
DOCS_TARGET = "https://example.com"
COMMAND_TIMEOUT = 120
TASK_QUEUE = "proxy-operator"
# A URL's host; not the user of `http://user:$(cat password-file)@$ENDPOINT`.
URL_HOST = re.compile(r"\bhttps?://([A-Za-z0-9.-]+)\b(?!:\$\()")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost"}
# The workflows a command names: by id, or a pool by its search attribute.
WORKFLOW_NAMED = re.compile(r"--workflow-id[ =]([A-Za-z0-9_./-]+)|ProxyPool = '([^']+)'")


@dataclass
class Reader:
    """Where the commands run: a workspace, a shell environment, a client to check on them."""

    workspace: Path
    env: dict[str, str]
    client: Client
    origin: TlsOrigin
    demo_site: str

    @property
    def target(self) -> str:
        return f"https://{self.origin.host}:{self.origin.port}"

    async def run(self, script: str) -> subprocess.CompletedProcess[str]:
        script = script.replace(DOCS_TARGET, self.target).replace(DEMO_SITE, self.demo_site)
        # A new URL in the docs must not send the suite onto the internet.
        beyond = [host for host in URL_HOST.findall(script) if host not in LOOPBACK_HOSTS]
        assert not beyond, f"a docs command reaches beyond loopback: {beyond}"
        return await asyncio.to_thread(
            subprocess.run,
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=self.workspace,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )

    async def wait_state(self, workflow_id: str, state: str) -> None:
        handle = self.client.get_workflow_handle(workflow_id)
        await wait_status(handle, lambda s: s.state == state, f"{workflow_id} {state}")

    async def fresh_proxy(self, workflow_id: str) -> None:
        """`workflow_id` running and Ready, started now unless a run already is."""
        handle = self.client.get_workflow_handle(workflow_id)
        try:
            running = (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
        except RPCError:
            running = False
        if not running:
            await self.client.start_workflow(
                "ProxyLifecycle",
                {"provider": "local", "health": {"target": self.target}},
                id=workflow_id,
                task_queue=TASK_QUEUE,
            )
        await self.wait_state(workflow_id, "Ready")

    async def wait_closed(self, workflow_id: str) -> None:
        handle = self.client.get_workflow_handle(workflow_id)

        async def closed() -> bool:
            return (await handle.describe()).status != WorkflowExecutionStatus.RUNNING

        await wait_for(closed, f"{workflow_id} to end")


def _worker(config: Path, address: str, ca_file: Path, metrics: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "worker.py", "--providers-config", str(config), "--no-orphan-gc-schedule"],
        cwd=ROOT,
        env={
            **os.environ,
            PASSWORD_ENV: PASSWORD,
            "TEMPORAL_ADDRESS": address,
            "PROXY_OPERATOR_METRICS_ADDRESS": metrics,
            "SSL_CERT_FILE": str(ca_file),
        },
    )


def _polling(worker: subprocess.Popen[bytes], metrics: str) -> bool:
    assert worker.poll() is None, f"the worker exited with {worker.returncode}"
    try:
        with urllib.request.urlopen(f"http://{metrics}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def state_dir_for_docs() -> Iterator[Path]:
    with local_state_dir() as path:
        yield path


@pytest.fixture(scope="module")
async def reader(
    tls_origin: TlsOrigin, state_dir_for_docs: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Reader]:
    # `proxies` is the namespace the search-attribute commands name.
    env = await start_dev_server("--namespace", "proxies")
    address = env.client.service_client.config.target_host
    home = tmp_path_factory.mktemp("docs")
    ca_file = home / "ca.pem"
    tls_origin.ca.cert_pem.write_to_path(str(ca_file))
    workspace = home / "workspace"
    (workspace / ".venv" / "bin").mkdir(parents=True)
    (workspace / ".venv" / "bin" / "temporal").symlink_to(TEMPORAL_CLI)
    (workspace / ".data").mkdir()
    (workspace / ".data" / "proxy-password").write_text(PASSWORD + "\n")
    devenv = load_devenv()
    site = devenv.demo_site_files(workspace / ".data" / "demo-site", "127.0.0.1", free_port())
    demo_site = f"{site.host}:{site.port}"
    config = home / "providers.yaml"
    origin = f"{tls_origin.host}:{tls_origin.port}"
    raw = demo_config(state_dir_for_docs, INSTALLATION, demo_site, more_exceptions=(origin,))
    config.write_text(yaml.safe_dump(raw))
    shell_env = {
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "HOME": str(home),
        "TEMPORAL_ADDRESS": address,
        "CURL_CA_BUNDLE": str(ca_file),
    }
    metrics = f"127.0.0.1:{free_port()}"
    server = devenv.serve_demo_site(site)
    worker = _worker(config, address, devenv.trust_file(site, str(ca_file)), metrics)
    try:
        await wait_for(lambda: _polling(worker, metrics), "the worker to poll its task queue")
        yield Reader(workspace, shell_env, env.client, tls_origin, demo_site)
    finally:
        server.shutdown()
        server.server_close()
        worker.terminate()
        try:
            await asyncio.to_thread(worker.wait, 60)
        except subprocess.TimeoutExpired:
            worker.kill()
            await asyncio.to_thread(worker.wait)
        await env.shutdown()


def _each_command(example: Example, workflow_id: str) -> list[str]:
    return [
        re.sub(r"(?<=\s)\.\.\.(?=\s)", f"--workflow-id {workflow_id}", command)
        for command in example.text.splitlines()
    ]


async def _failure(reader: Reader, example: Example) -> str | None:
    """Run one example; what went wrong, or None."""
    if example.directive("skip") is not None:
        return None
    if wait := example.directive("wait"):
        await reader.wait_state(*wait)
    if example.kind == "sh":
        run = await reader.run(example.text)
        if run.returncode != 0:
            return f"exit {run.returncode}:\n{example.text}{run.stdout}{run.stderr}"
    elif example.kind == "console":
        for command, expected in console_commands(example.text):
            run = await reader.run(command)
            missing = _missing_in_order(expected, run.stdout + run.stderr)
            if missing:
                return f"$ {command}\nprinted:\n{run.stdout}{run.stderr}\nnot shown: {missing!r}"
    else:
        (workflow_id,) = example.directive("each-on-fresh") or [""]
        for command in _each_command(example, workflow_id):
            await reader.fresh_proxy(workflow_id)
            run = await reader.run(command)
            if run.returncode != 0:
                return f"exit {run.returncode}: {command}\n{run.stdout}{run.stderr}"
            await reader.wait_closed(workflow_id)
    return None


def _workflows(example: Example) -> set[str]:
    """The workflows an example is about; none for a console transcript, which checks
    what it prints, so nothing else may run meanwhile."""
    if example.kind == "console":
        return set()
    named = {by_id or pool for by_id, pool in WORKFLOW_NAMED.findall(example.text)}
    for directive in ("wait", "each-on-fresh"):
        if words := example.directive(directive):
            named.add(words[0])
    return named


def _waves(found: list[Example]) -> list[list[list[Example]]]:
    """`found` as waves run one after another, each of chains run side by side.

    A chain holds the examples about the same workflows, in document order;
    an example about no workflow, or about workflows of two chains, is a wave
    of its own.
    """
    waves: list[list[list[Example]]] = []
    chains: list[tuple[set[str], list[Example]]] = []
    for example in found:
        named = _workflows(example)
        joins = [chain for chain in chains if chain[0] & named]
        if named and len(joins) <= 1:
            if joins:
                joins[0][0].update(named)
                joins[0][1].append(example)
            else:
                chains.append((named, [example]))
            continue
        if chains:
            waves.append([chain for _, chain in chains])
            chains = []
        waves.append([[example]])
    if chains:
        waves.append([chain for _, chain in chains])
    return waves


async def _chain_failures(reader: Reader, chain: list[Example]) -> list[str]:
    """Run a chain's examples in order; what went wrong in each that failed."""
    failures = []
    for example in chain:
        failure = await _failure(reader, example)
        if failure is not None:
            failures.append(f"--- {example.source}\n{failure}")
    return failures


def _missing_in_order(expected: list[str], printed: str) -> str | None:
    """The first expected line not printed after the previous one (whitespace-insensitive)."""
    lines = [" ".join(line.split()) for line in printed.splitlines()]
    at = 0
    for want in expected:
        want = " ".join(want.split())
        while at < len(lines) and lines[at] != want:
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


@pytest.mark.parametrize("doc", DOCS)
async def test_every_temporal_command_in_the_doc_works(reader: Reader, doc: str) -> None:
    found = examples(ROOT / doc, ROOT)
    assert found, f"no temporal commands found in {doc}: has the Markdown convention changed?"
    failures = []
    for wave in _waves(found):
        chains = await asyncio.gather(*(_chain_failures(reader, chain) for chain in wave))
        failures += [failure for chain in chains for failure in chain]
    assert not failures, "\n".join(failures)
