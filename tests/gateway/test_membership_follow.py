"""The gateway's membership poll: describe the pool, query `endpoints` only on a change.

The pool here is a workflow that answers `endpoints` with what it was last
signalled, on the real dev server, so what the gateway's loop sees is what
Temporal answers: the describe's run id and history length, and the query.
It keeps no digest of its endpoints in its memo, as a pool run started
before `publish-endpoints-digest` (workflows/pool_feed.py): the gateway
follows it by its history's length. A real pool's digest is followed in
tests/workflows/test_pool_feed.py. Counts of queries are the behaviour
under test (Temporal Cloud bills each), not a timing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from temporalio import workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from gateway import membership
from tests.helpers.membership import Following, counted_client
from tests.helpers.waiting import wait_for

POLL_SECONDS = 0.2
POLLS_WATCHED = 15


@workflow.defn(name="ScriptedPool", sandboxed=False)
class ScriptedPool:
    """Answers `endpoints` with what its `set` signal last said, as a pool would."""

    def __init__(self) -> None:
        self._endpoints: list[dict[str, str]] = []

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.signal
    def set(self, endpoints: list[dict[str, str]]) -> None:
        self._endpoints = endpoints

    @workflow.query
    def endpoints(self) -> list[dict[str, str]]:
        return self._endpoints


def endpoint(n: int) -> dict[str, str]:
    return {"member": f"scripted/{n}", "endpoint": f"127.0.0.1:{20000 + n}"}


@pytest.fixture
async def following(temporal_env: WorkflowEnvironment) -> AsyncIterator[Following]:
    client, counter = counted_client(temporal_env.client)
    task_queue = f"scripted-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=task_queue, workflows=[ScriptedPool]):
        handle = await client.start_workflow(
            ScriptedPool.run, id=f"scripted-pool-{uuid.uuid4().hex[:8]}", task_queue=task_queue
        )
        await handle.signal(ScriptedPool.set, [endpoint(0)])
        yield Following(client, handle.id, counter)
        await handle.terminate()


async def polls_pass(count: int) -> None:
    await asyncio.sleep(count * POLL_SECONDS)


async def test_an_unchanged_pool_is_described_not_queried(following: Following) -> None:
    loop = asyncio.create_task(following.run(poll_seconds=POLL_SECONDS, refresh_seconds=3600))
    try:
        await wait_for(lambda: following.counter.queries >= 2, "the first poll's query", 30)
        before = following.counter.queries
        await polls_pass(POLLS_WATCHED)
        assert following.counter.queries == before
        assert following.applied == [] and following.errors == []
    finally:
        loop.cancel()


async def test_a_change_is_applied(following: Following) -> None:
    loop = asyncio.create_task(following.run(poll_seconds=POLL_SECONDS, refresh_seconds=3600))
    try:
        await wait_for(lambda: following.counter.queries >= 2, "the first poll's query", 30)
        handle = following.client.get_workflow_handle(following.pool)
        await handle.signal(ScriptedPool.set, [endpoint(0), endpoint(1)])
        await wait_for(
            lambda: ["scripted/0", "scripted/1"] in following.applied, "the new member applied", 60
        )
    finally:
        loop.cancel()


async def test_a_pool_without_a_digest_is_queried_when_its_history_moves(
    following: Following,
) -> None:
    loop = asyncio.create_task(following.run(poll_seconds=POLL_SECONDS, refresh_seconds=3600))
    try:
        await wait_for(lambda: following.counter.queries >= 2, "the first poll's query", 30)
        before = following.counter.queries
        handle = following.client.get_workflow_handle(following.pool)
        await handle.signal(ScriptedPool.set, [endpoint(0)])  # the same members: history only
        await wait_for(
            lambda: following.counter.queries > before, "a query after the history moved", 60
        )
        assert following.applied == [] and following.errors == []
        assert all(p.endpoints_digest is None for p in following.described)
    finally:
        loop.cancel()


async def test_a_failed_change_is_tried_again_though_the_pool_is_unchanged(
    following: Following,
) -> None:
    following.refuse = True
    loop = asyncio.create_task(following.run(poll_seconds=POLL_SECONDS, refresh_seconds=3600))
    try:
        await wait_for(lambda: following.counter.queries >= 2, "the first poll's query", 30)
        handle = following.client.get_workflow_handle(following.pool)
        await handle.signal(ScriptedPool.set, [endpoint(2)])
        await wait_for(lambda: len(following.applied) >= 2, "a second attempt at the change", 60)
        following.refuse = False
        attempts = len(following.applied)
        await wait_for(lambda: len(following.applied) > attempts, "the change that works", 60)
        served = len(following.applied)
        await polls_pass(POLLS_WATCHED)
        assert len(following.applied) == served  # applied: no more attempts
    finally:
        loop.cancel()


async def test_the_refresh_queries_a_still_pool_now_and_then(following: Following) -> None:
    loop = asyncio.create_task(
        following.run(poll_seconds=POLL_SECONDS, refresh_seconds=POLL_SECONDS)
    )
    try:
        await wait_for(lambda: following.counter.queries >= 2, "the first poll's query", 30)
        before = following.counter.queries
        await wait_for(
            lambda: following.counter.queries >= before + 3, "queries on the refresh alone", 60
        )
        assert following.applied == []
    finally:
        loop.cancel()


async def test_a_pool_that_does_not_exist_is_reported_not_raised(
    temporal_env: WorkflowEnvironment,
) -> None:
    with pytest.raises(membership.PoolNotFound, match="no-such-pool"):
        await membership.pool_position(temporal_env.client, f"no-such-pool-{uuid.uuid4().hex}")
