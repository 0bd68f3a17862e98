"""The gateway's health as a load balancer and an operator see it.

`proxy-operator-gateway` in its own process over a real ProxyPool (real
Squids, a real Temporal dev server). /healthz says the gateway works;
/readyz, whether it can learn its membership and has a member to route to:
with its Temporal server stopped the gateway turns not ready, stays live,
and is ready again once the server is back, and the SDK's retry warnings
reach its log plain and rate-limited. A gateway whose pool closes says so
once and exits 1, and one started over a closed pool stops at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from gateway.health import stale_after
from tests.helpers.gateway import GatewayProcess, pool_gateway, stack_gateway
from tests.helpers.network import free_port
from tests.helpers.stacks import Stack
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import start_dev_server
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

QUIET_HEALTH = {"interval_seconds": 3600, "failure_threshold": 2}
# The test gateway polls every 0.5 s (tests/helpers/gateway.py): it turns
# not ready this long after its last answer; the deadline leaves room for
# a busy machine.
STALE = stale_after(0.5, 0.5)
DEADLINE = STALE + 60


@contextlib.asynccontextmanager
async def one_member_pool(stack: Stack) -> AsyncIterator[WorkflowHandle[Any, Any]]:
    """A pool of one quiet member, listed in endpoints; its Squid gone afterwards."""
    handle = await stack.client.start_workflow(
        "ProxyPool",
        {
            "replicas": 1,
            "template": stack.proxy_input(health=QUIET_HEALTH | {"target": stack.origin.url}),
        },
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )

    async def listed() -> bool:
        return len(await handle.query("endpoints")) == 1

    await wait_for(listed, "the member in endpoints", deadline=120)
    try:
        yield handle
    finally:
        with contextlib.suppress(Exception):  # a pool that closed already
            await handle.signal("terminate")
        await wait_for(lambda: not stack.instances(), "the member's Squid gone", deadline=120)


def answers(gateway: GatewayProcess, path: str, status: int, text: str) -> Callable[[], bool]:
    def check() -> bool:
        code, body = gateway.probe(path)
        return code == status and text in body

    return check


async def test_a_gateway_without_temporal_is_unready_but_live_and_ready_again_when_it_returns(
    stack_on: Callable[[WorkflowEnvironment], Awaitable[Stack]], tmp_path: Path
) -> None:
    # A dev server of this test's own, which it stops and starts again on
    # the same port and database: the pool and its member outlive it.
    port, database = free_port(), tmp_path / "temporal.db"
    env = await start_dev_server(port=port, database=database)
    try:
        stack = await stack_on(env)
        async with (
            one_member_pool(stack) as pool,
            pool_gateway(env, stack, pool.id) as gateway,
        ):
            assert gateway.probe("/readyz") == (200, "ready\n")

            await env.shutdown()
            await wait_for(
                lambda: asyncio.to_thread(
                    answers(gateway, "/readyz", 503, f"cannot learn pool {pool.id}'s members")
                ),
                "/readyz 503 with Temporal stopped",
                DEADLINE,
            )
            assert gateway.probe("/healthz") == (200, "ok\n")
            code, reason = gateway.probe("/readyz")
            assert code == 503 and reason.count("\n") == 1, reason

            env = await start_dev_server(port=port, database=database)
            await wait_for(
                lambda: asyncio.to_thread(answers(gateway, "/readyz", 200, "ready")),
                "/readyz 200 with Temporal back",
                DEADLINE,
            )
            assert gateway.probe("/healthz") == (200, "ok\n")
            log = gateway.output.read_text(errors="replace")
    finally:
        await env.shutdown()

    assert "\x1b[" not in log
    # Core's retry warnings are there, as log lines, each kind once a minute at most.
    retried = re.findall(r"gRPC call (\w+) retried \d+ times", log)
    assert retried, log[-3000:]
    assert max(collections.Counter(retried).values()) <= 2, log[-3000:]


async def test_a_gateway_whose_pool_closes_says_so_once_and_exits_1(
    temporal_env: WorkflowEnvironment, stack: Stack
) -> None:
    async with one_member_pool(stack) as pool:
        with local_state_dir("proxy-operator-gateway-test-") as directory:
            gateway = stack_gateway(temporal_env, stack, pool.id, directory / "first")
            try:
                await asyncio.to_thread(gateway.start)
                assert gateway.probe("/readyz") == (200, "ready\n")
                await pool.signal("terminate")
                assert gateway.process is not None
                code = await asyncio.to_thread(gateway.process.wait, 120)
            finally:
                await asyncio.to_thread(gateway.stop)
            log = gateway.output.read_text(errors="replace")
            assert code == 1, log[-3000:]
            assert log.count(f"pool {pool.id!r} has closed (completed") == 1, log[-3000:]

            # Started over the closed pool, a gateway stops before it serves.
            late = stack_gateway(temporal_env, stack, pool.id, directory / "late")
            with pytest.raises(AssertionError, match=f"pool {pool.id!r} has closed"):
                await asyncio.to_thread(late.start)
            assert late.stop() == 1
