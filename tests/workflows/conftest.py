"""Workflow-test fixtures: a worker on a real Temporal server, real Squids (tests/helpers)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.gc import GcActivities
from activities.provider import ProviderActivities
from providers.base import Provider
from providers.config import Config
from providers.local import LocalProvider
from tests.fakes.providers import FaultyProvider
from tests.helpers.config import local_settings, stack_config
from tests.helpers.squid_upstream import SquidUpstreams
from tests.helpers.stacks import ProviderStack, Stack, StackFactory
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.workers import stop_worker
from worker import build_worker


@pytest.fixture
async def stack_on(
    tls_origin: TlsOrigin, state_dir: Path
) -> AsyncIterator[Callable[[WorkflowEnvironment], Awaitable[Stack]]]:
    """Start a worker against a given environment (on its own task queue unless given one)."""
    workers: list[Any] = []
    activities: list[ProviderActivities] = []

    async def start(env: WorkflowEnvironment, task_queue: str | None = None) -> Stack:
        config = stack_config(tls_origin.port, str(state_dir))
        provider = FaultyProvider(LocalProvider(local_settings(state_dir), config.installation))
        acts = ProviderActivities(
            {"local": provider}, config, ssl_context=tls_origin.client_ssl_context
        )
        task_queue = task_queue or f"test-{uuid.uuid4().hex[:12]}"
        # OrphanGC too, as every real worker serves it (it runs only when started).
        gc = GcActivities({"local": provider}, config.installation, env.client)
        worker = build_worker(env.client, acts, gc=gc, task_queue=task_queue)
        workers.append(worker)
        activities.append(acts)
        asyncio.get_running_loop().create_task(worker.run())
        return Stack(env.client, task_queue, provider, config, tls_origin, state_dir)

    yield start
    for worker in workers:
        await stop_worker(worker)
    for acts in activities:
        acts.close()


@pytest.fixture
async def stack(
    temporal_env: WorkflowEnvironment,
    stack_on: Callable[[WorkflowEnvironment], Awaitable[Stack]],
) -> Stack:
    return await stack_on(temporal_env)


@pytest.fixture
async def provider_stack_on(tls_origin: TlsOrigin) -> AsyncIterator[StackFactory]:
    """`await provider_stack_on(env, {name: provider}, config)` starts a worker on `env`."""
    stacks: list[ProviderStack] = []
    workers: list[Worker] = []
    activities: list[ProviderActivities] = []
    runs: list[asyncio.Task[None]] = []

    async def start(
        env: WorkflowEnvironment, providers: Mapping[str, Provider], config: Config
    ) -> ProviderStack:
        acts = ProviderActivities(providers, config, ssl_context=tls_origin.client_ssl_context)
        activities.append(acts)
        task_queue = f"test-{uuid.uuid4().hex[:12]}"
        worker = build_worker(env.client, acts, task_queue=task_queue)
        workers.append(worker)
        runs.append(asyncio.get_running_loop().create_task(worker.run()))
        stack = ProviderStack(env, env.client, task_queue, config, tls_origin)
        stacks.append(stack)
        return stack

    yield start
    for stack in stacks:
        for handle in stack.handles:
            with contextlib.suppress(RPCError):
                if (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
                    await handle.terminate("test teardown")
    for worker in workers:
        await stop_worker(worker)
    for acts in activities:
        acts.close()
    for run in runs:
        if run.done():
            run.result()  # a worker that died: say so rather than only time out


@pytest.fixture
def squid_upstreams() -> Iterator[SquidUpstreams]:
    """Start real Squids from provider-rendered configs; all stopped after the test."""
    upstreams = SquidUpstreams()
    try:
        yield upstreams
    finally:
        upstreams.close()
