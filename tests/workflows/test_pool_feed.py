"""A gateway follows a real ProxyPool with one `endpoints` query per change of them.

The pool keeps a digest of its `endpoints` in its memo (workflows/pool_feed.py),
which the gateway's free describe reads; its history moves at every report,
timer and signal, its digest only when `endpoints` changed. Queries are
counted on the gateway loop's own client (Temporal Cloud bills each).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.client import WorkflowHandle

from contract import ENDPOINTS_DIGEST_MEMO, MEMBER_CHANGED_SIGNAL
from tests.helpers.membership import Following, counted_client
from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

POLL_SECONDS = 0.5
HISTORY_MOVES = 3


async def _endpoints(pool: WorkflowHandle[Any, Any]) -> dict[str, str]:
    return {e["member"]: e["endpoint"] for e in await pool.query("endpoints")}


async def _polls_pass(following: Following, polls: int) -> None:
    """Until the loop has described the pool `polls` more times (each poll starts with one)."""
    seen = len(following.described)
    await wait_for(lambda: len(following.described) >= seen + polls, f"{polls} more polls")


async def test_a_gateway_queries_a_pool_once_per_change_of_its_endpoints(stack: Stack) -> None:
    pool = await stack.start_pool(2)

    async def both_listed() -> bool:
        return len(await _endpoints(pool)) == 2

    await wait_for(both_listed, "2 members in endpoints", deadline=90)
    client, counter = counted_client(stack.client)
    following = Following(client, pool.id, counter)
    loop = asyncio.create_task(following.run(poll_seconds=POLL_SECONDS, refresh_seconds=3600))
    try:
        await wait_for(lambda: counter.queries >= 2, "the first poll's query")
        await _polls_pass(following, 2)
        digest = following.described[-1].endpoints_digest
        assert digest is not None, "the pool keeps no digest in its memo"
        before = counter.queries

        # Refused reports: the pool's history moves, its endpoints do not.
        for _ in range(HISTORY_MOVES):
            moved_from = (await pool.describe()).history_length
            await pool.signal(MEMBER_CHANGED_SIGNAL, {"member": "nobody"})
            await wait_for(
                lambda moved_from=moved_from: following.described[-1].history_length > moved_from,
                "the gateway describing the moved history",
            )
            await _polls_pass(following, 1)
        assert (await pool.query("status"))["rejected_reports"] == HISTORY_MOVES
        assert following.described[-1].endpoints_digest == digest
        assert counter.queries == before

        # A rotation: the member's new instance takes its old one's place in `endpoints`.
        old = await _endpoints(pool)
        member = sorted(old)[0]
        await pool.execute_update("rotate", {"member": member})

        async def served_anew() -> bool:
            now = await _endpoints(pool)
            served = {m.member: f"{m.host}:{m.port}" for m in following.serving}
            return now[member] != old[member] and served == now

        await wait_for(served_anew, "the gateway serving the rotated member's new endpoint", 90)
        assert following.errors == []
        assert counter.queries == before + 1
        described = await pool.describe()
        assert await described.memo_value(ENDPOINTS_DIGEST_MEMO) not in (None, digest)
    finally:
        loop.cancel()
        await pool.signal("terminate")
        await pool.result()
