"""A pool in a worker of its own: started on "<queue>-pools", its members on "<queue>".

The pools' worker (worker.build_pool_worker) serves ProxyPool and nothing
else but its local input check, so anything the pool asked for on its own
queue (a member, a monitor shard, an endpoint check, a reconcile) would
never run there and the pool would never list an endpoint.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.provider import ProviderActivities
from contract import POOL_QUEUE_SUFFIX
from tests.helpers.histories import record_history
from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for
from tests.helpers.workers import stop_worker
from worker import build_pool_worker

pytestmark = pytest.mark.slow


async def _ready_endpoints(handle: WorkflowHandle[Any, Any], count: int) -> list[dict[str, Any]]:
    endpoints: list[dict[str, Any]] = []

    async def listed() -> bool:
        endpoints[:] = await handle.query("endpoints")
        return len(endpoints) == count

    await wait_for(listed, f"{count} verified endpoints", deadline=90)
    return endpoints


async def test_a_pool_on_the_pools_queue_runs_its_members_and_activities_on_the_proxies_queue(
    temporal_env: WorkflowEnvironment, stack: Stack
) -> None:
    pools_queue = stack.task_queue + POOL_QUEUE_SUFFIX
    acts = ProviderActivities({"local": stack.provider}, stack.config)
    pools_worker = build_pool_worker(stack.client, acts, task_queue=pools_queue)
    running = asyncio.get_running_loop().create_task(pools_worker.run())
    try:
        handle = await stack.client.start_workflow(
            "ProxyPool",
            {"replicas": 2, "template": stack.proxy_input()},
            id=f"pool-{uuid.uuid4().hex[:8]}",
            task_queue=pools_queue,
        )
        endpoints = await _ready_endpoints(handle, 2)
        assert len(stack.instances()) == 2
        for entry in endpoints:
            member = await stack.client.get_workflow_handle(entry["member"]).describe()
            assert member.raw_description.execution_config.task_queue.name == stack.task_queue
        described = await handle.describe()
        assert described.raw_description.execution_config.task_queue.name == pools_queue

        await handle.signal("terminate")
        result = await asyncio.wait_for(handle.result(), timeout=90)
        assert result["state"] == "Terminated"
        assert stack.instances() == []
        await record_history(handle, "pool_on_the_pools_queue")

        scheduled: list[str] = []
        async for event in handle.fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                attributes = event.activity_task_scheduled_event_attributes
                scheduled.append(f"{attributes.activity_type.name} on {attributes.task_queue.name}")
        # The shards, the endpoint checks and the reconcile all ran on the proxies' queue.
        assert {s.split(" on ")[0] for s in scheduled} >= {"monitor_members", "verify_endpoint"}
        assert all(s.endswith(f" on {stack.task_queue}") for s in scheduled), scheduled
    finally:
        await stop_worker(pools_worker)
        acts.close()
        if running.done():
            running.result()
