"""The control API's `/v1/members` reads every page of a large pool's `status`.

A pool answers `status` a page of members at a time (workflows/pool_status.py),
200 unless asked. Bringing up a real pool of over 200 members takes minutes,
so the pool here is a stand-in workflow on a real server whose `status` is
the pool's own paging code over members it holds; the real pool's paging
through the Temporal CLI is tested in tests/workflows/test_pool.py.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio import workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from contract import ProxyState
    from gateway.api_pool import PoolControl
    from gateway.sessions import SessionMap
    from workflows.pool_input import DEFAULT_PAGE, StatusRequest
    from workflows.pool_plan import Member
    from workflows.pool_status import member_page

pytestmark = pytest.mark.slow

MEMBERS = 2 * DEFAULT_PAGE + 7


@workflow.defn(name="PagedPoolStandIn")
class PagedPool:
    """Holds `count` Ready members and answers `status` as ProxyPool pages it."""

    def __init__(self) -> None:
        self._members: list[Member] = []

    @workflow.run
    async def run(self, pool_id: str, count: int) -> None:
        self._members = [
            Member(f"{pool_id}/{n}", n, "local", {"zone": "z-a"}, "2026-01-01T00:00:00+00:00")
            for n in range(count)
        ]
        for member in self._members:
            member.state = ProxyState.READY
        await workflow.wait_condition(lambda: False)

    @workflow.query(name="status")
    def status(self, request: dict[str, Any] | None = None) -> dict[str, Any]:
        page = StatusRequest() if request is None else StatusRequest.model_validate(request)
        members, next_page = member_page(self._members, page)
        return {"members": members, "next_page": next_page, "members_total": len(self._members)}


async def test_members_lists_every_page_of_a_pool_larger_than_one(
    temporal_env: WorkflowEnvironment,
) -> None:
    client = temporal_env.client
    queue, pool_id = f"paged-{uuid.uuid4().hex[:8]}", f"pool-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[PagedPool]):
        handle = await client.start_workflow(
            PagedPool.run, args=[pool_id, MEMBERS], id=pool_id, task_queue=queue
        )
        control = PoolControl(client, lambda: [pool_id], "fleet", SessionMap(), list)
        listing = await control.members()
        await handle.terminate()
    assert [m["member"] for m in listing["members"]] == [f"{pool_id}/{n}" for n in range(MEMBERS)]
    assert {m["state"] for m in listing["members"]} == {"Ready"}
    # A gateway of one pool answers as it always has, and says it again in `pools`.
    assert (listing["pool"], listing["pools"]) == (pool_id, [pool_id])


async def test_members_lists_every_pool_each_member_with_its_own(
    temporal_env: WorkflowEnvironment,
) -> None:
    client = temporal_env.client
    queue = f"paged-{uuid.uuid4().hex[:8]}"
    sizes = {f"eu-{uuid.uuid4().hex[:8]}": MEMBERS, f"us-{uuid.uuid4().hex[:8]}": 3}
    async with Worker(client, task_queue=queue, workflows=[PagedPool]):
        handles = [
            await client.start_workflow(
                PagedPool.run, args=[pool_id, count], id=pool_id, task_queue=queue
            )
            for pool_id, count in sizes.items()
        ]
        control = PoolControl(client, lambda: list(sizes), "fleet", SessionMap(), list)
        listing = await control.members()
        for handle in handles:
            await handle.terminate()
    assert "pool" not in listing
    assert listing["pools"] == list(sizes)
    assert [(m["pool"], m["member"]) for m in listing["members"]] == [
        (pool_id, f"{pool_id}/{n}") for pool_id, count in sizes.items() for n in range(count)
    ]
