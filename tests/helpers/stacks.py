"""A worker serving ProxyLifecycle, and what a test needs to drive it.

Both are the real worker's composition: `build_worker(client,
ProviderActivities(providers, config, ...))` on a task queue of their own.

- `Stack` (the `stack` and `stack_on` fixtures): the local provider, wrapped
  in FaultyProvider so a test can inject faults; without faults every call
  reaches real Squid processes.
- `ProviderStack` (the `provider_stack_on` fixture): providers the test
  builds, e.g. a KubernetesProvider on the fake API server or a GcpProvider
  on the fake Compute Engine. Its teardown terminates every workflow the test
  started that is still running (a test that failed half-way), then stops the
  worker, so nothing keeps creating instances or retrying activities after
  the test. On the shared time-skipping server, see
  tests/helpers/time_skipping.py for why a workflow should not end,
  terminated or not, with an activity still running.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from providers.base import Provider
from providers.config import Config
from tests.fakes.providers import FaultyProvider
from tests.helpers.tls_origin import TlsOrigin


@dataclass
class Stack:
    client: Client
    task_queue: str
    provider: FaultyProvider
    config: Config
    origin: TlsOrigin
    state_dir: Path
    # The provider's name in the worker's config, which the proxies' input names.
    provider_name: str = "local"

    def proxy_input(self, **overrides: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "provider": self.provider_name,
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

    async def start_pool(self, replicas: int) -> WorkflowHandle[Any, Any]:
        """A ProxyPool of `replicas` members, each a `proxy_input()` proxy."""
        return await self.client.start_workflow(
            "ProxyPool",
            {"replicas": replicas, "template": self.proxy_input()},
            id=f"pool-{uuid.uuid4().hex[:8]}",
            task_queue=self.task_queue,
        )

    def instances(self) -> list[str]:
        """Names of the instance directories that still exist."""
        return sorted(p.name for p in self.state_dir.iterdir() if p.is_dir())

    def pid_of(self, name: str) -> int:
        return int(json.loads((self.state_dir / name / "instance.json").read_text())["pid"])


@dataclass
class ProviderStack:
    env: WorkflowEnvironment
    client: Client
    task_queue: str
    config: Config
    origin: TlsOrigin
    handles: list[WorkflowHandle[Any, Any]] = field(default_factory=list)

    def proxy_input(self, provider: str, **overrides: Any) -> dict[str, Any]:
        """A ProxyLifecycle input probing the local TLS origin every second."""
        body: dict[str, Any] = {
            "provider": provider,
            "health": {"target": self.origin.url, "interval_seconds": 1, "failure_threshold": 2},
        }
        body.update(overrides)
        return body

    async def start(self, provider: str, **overrides: Any) -> WorkflowHandle[Any, Any]:
        handle = await self.client.start_workflow(
            "ProxyLifecycle",
            self.proxy_input(provider, **overrides),
            id=f"proxy-{uuid.uuid4().hex[:10]}",
            task_queue=self.task_queue,
        )
        self.handles.append(handle)
        return handle


StackFactory = Callable[
    [WorkflowEnvironment, Mapping[str, Provider], Config], Awaitable[ProviderStack]
]
# The `stack_on` fixture: a Stack on the given Temporal environment.
StackOn = Callable[[WorkflowEnvironment], Awaitable[Stack]]
