"""A proxy-operator stack for workflow tests: real Temporal, real Squid, one worker.

Each test gets its own task queue and state directory. The local provider is
wrapped in FaultyProvider so a test can inject faults; without faults every
call reaches real Squid processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.provider import ProviderActivities
from providers.config import Config, parse_config
from providers.local import LocalConfig, LocalProvider
from tests.fakes.providers import FaultyProvider
from tests.fixtures.tls_origin import TlsOrigin
from worker import build_worker
from workflows.lifecycle import ProxyLifecycle, ProxyStatus

PASSWORD = "test-password-7f3a"
USERNAME = "proxy"
DEADLINE = 60.0


def proxy_config(origin_port: int, provider: dict[str, Any], *, password: str = PASSWORD) -> Config:
    """A worker config with one provider entry, allowing CONNECT to the test origin."""
    raw = {
        "installation": "test",
        "proxy": {
            "auth": {"username": USERNAME, "password_env": "PROXY_PASSWORD"},
            "allowed_cidrs": ["127.0.0.0/8"],
            "allowed_connect_ports": [443, origin_port],
        },
        "providers": [provider],
    }
    return parse_config(raw, environ={"PROXY_PASSWORD": password})


def stack_config(origin_port: int, state_dir: str) -> Config:
    return proxy_config(
        origin_port, {"name": "local", "type": "local", "local": {"state_dir": state_dir}}
    )


@dataclass
class Stack:
    client: Client
    task_queue: str
    provider: FaultyProvider
    config: Config
    origin: TlsOrigin
    state_dir: Path

    def proxy_input(self, **overrides: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "provider": "local",
            "health": {"target": self.origin.url, "interval_seconds": 1, "failure_threshold": 2},
        }
        body.update(overrides)
        return body

    async def start(self, **overrides: Any) -> WorkflowHandle[Any, Any]:
        return await self.client.start_workflow(
            "ProxyLifecycle",
            self.proxy_input(**overrides),
            id=f"proxy-{uuid.uuid4().hex[:10]}",
            task_queue=self.task_queue,
        )

    def instances(self) -> list[str]:
        """Names of the instance directories that still exist."""
        return sorted(p.name for p in self.state_dir.iterdir() if p.is_dir())

    def pid_of(self, name: str) -> int:
        return int(json.loads((self.state_dir / name / "instance.json").read_text())["pid"])


HISTORIES = Path(__file__).resolve().parent.parent / "histories"


async def record_history(handle: WorkflowHandle[Any, Any], name: str) -> None:
    """Save the history for the replay test when PROXY_OPERATOR_RECORD_HISTORIES=1.

    Run `PROXY_OPERATOR_RECORD_HISTORIES=1 make test` after a deliberate change
    to the workflow's commands, and commit the refreshed tests/histories/.
    """
    if os.environ.get("PROXY_OPERATOR_RECORD_HISTORIES") != "1":
        return
    history = await handle.fetch_history()
    HISTORIES.mkdir(exist_ok=True)
    # The workflow id is part of what the workflow computed (instance names),
    # and a history alone does not carry it.
    recorded = {"workflow_id": handle.id, "history": json.loads(history.to_json())}
    (HISTORIES / f"{name}.json").write_text(json.dumps(recorded))


async def status_of(handle: WorkflowHandle[Any, Any]) -> ProxyStatus:
    return await handle.query(ProxyLifecycle.status, result_type=ProxyStatus)


async def wait_for(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    what: str,
    deadline: float = DEADLINE,
) -> None:
    """Poll `check` until it is true; fail naming `what` after `deadline` seconds."""
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > until:
            raise AssertionError(f"timed out after {deadline:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


async def wait_status(
    handle: WorkflowHandle[Any, Any],
    predicate: Callable[[ProxyStatus], bool],
    what: str,
    deadline: float = DEADLINE,
) -> ProxyStatus:
    seen: list[ProxyStatus] = []

    async def check() -> bool:
        seen.append(await status_of(handle))
        return predicate(seen[-1])

    try:
        await wait_for(check, what, deadline)
    except AssertionError as err:
        raise AssertionError(f"{err}; last status: {seen[-1] if seen else None}") from None
    return seen[-1]


@pytest.fixture
async def stack_on(
    tls_origin: TlsOrigin, state_dir: Path
) -> AsyncIterator[Callable[[WorkflowEnvironment], Awaitable[Stack]]]:
    """Start a worker against a given environment; stopped after the test."""
    workers: list[Any] = []
    activities: list[ProviderActivities] = []

    async def start(env: WorkflowEnvironment) -> Stack:
        config = stack_config(tls_origin.port, str(state_dir))
        provider = FaultyProvider(LocalProvider(LocalConfig(state_dir=str(state_dir))))
        acts = ProviderActivities(
            {"local": provider}, config, ssl_context=tls_origin.client_ssl_context
        )
        task_queue = f"test-{uuid.uuid4().hex[:12]}"
        worker = build_worker(env.client, acts, task_queue=task_queue)
        workers.append(worker)
        activities.append(acts)
        asyncio.get_running_loop().create_task(worker.run())
        return Stack(env.client, task_queue, provider, config, tls_origin, state_dir)

    yield start
    for worker in workers:
        await worker.shutdown()
    for acts in activities:
        acts.close()


@pytest.fixture
async def stack(
    temporal_env: WorkflowEnvironment,
    stack_on: Callable[[WorkflowEnvironment], Awaitable[Stack]],
) -> Stack:
    return await stack_on(temporal_env)


def squid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
