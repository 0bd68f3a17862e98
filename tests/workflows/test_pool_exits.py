"""Exit addresses end to end: a pool of real local Squids checks each member's exit
through an echo service, reports it, and replaces members that share one.

All local members leave from 127.0.0.1, so with `distinct_exits` every
member but the first shares an exit: each is replaced once, and then kept
(its new instance shares the exit again; the pool does not churn for ever).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.client import WorkflowHandle

from tests.helpers.stacks import Stack
from tests.helpers.tls_origin import ECHO_PATH
from tests.helpers.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LOOPBACK = "127.0.0.1"


async def test_members_report_their_exit_and_shared_exits_are_replaced_once(stack: Stack) -> None:
    pool = await stack.client.start_workflow(
        "ProxyPool",
        {
            "replicas": 3,
            "max_surge": 3,
            "template": stack.proxy_input(),
            "exit_echo_url": f"{stack.origin.url.rstrip('/')}{ECHO_PATH}",
            "distinct_exits": True,
        },
        id=f"pool-exits-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )
    # With whichever member held the exit when the check ran: /0, or for /2
    # also /1 when /1's check came first (on a busy machine it can).
    shared = f"exit shared: {LOOPBACK} with {pool.id}/"

    seen: list[Any] = []

    async def settled() -> bool:
        status = await pool.query("status")
        seen[:] = [status]
        members = {m["member"]: m for m in status["members"]}
        return (
            status["ready"] == 3
            and all(m["exit_address"] == LOOPBACK for m in members.values())
            and all(
                (members[f"{pool.id}/{n}"]["last_rotation"] or "").startswith(shared)
                for n in (1, 2)
            )
        )

    try:
        await wait_for(settled, "both younger members replaced once for their shared exit", 300)
    except AssertionError as err:
        raise AssertionError(f"{err}; last status: {seen}") from None
    status = await pool.query("status")
    assert status["distinct_exits"] == 1
    assert status["last_exit_problem"] is None
    first = next(m for m in status["members"] if m["member"] == f"{pool.id}/0")
    assert first["generation"] == 0 and first["last_rotation"] is None
    endpoints = await pool.query("endpoints")
    assert [e["exit_address"] for e in endpoints] == [LOOPBACK] * 3
    # Kept now: no member is queued or rotating again.
    assert not any(m["rotating"] for m in status["members"])
    await end(pool)


async def test_an_echo_service_that_fails_keeps_the_member_serving_and_says_why(
    stack: Stack,
) -> None:
    pool = await stack.client.start_workflow(
        "ProxyPool",
        {
            "replicas": 1,
            "template": stack.proxy_input(),
            # The origin answers "ok" here, not an address.
            "exit_echo_url": stack.origin.url,
        },
        id=f"pool-echo-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )

    async def serving() -> bool:
        return bool((await pool.query("status"))["ready"] == 1)

    await wait_for(serving, "the member serving despite the failed exit check", 120)
    status = await pool.query("status")
    assert status["members"][0]["exit_address"] is None  # the local provider knows none
    # Described, never quoted: any https URL can be named as the echo service.
    assert status["last_exit_problem"].endswith(
        "not one IP address (plain text, or JSON with `ip` or `origin`): 2 bytes, no content type"
    )
    await end(pool)


async def end(pool: WorkflowHandle[Any, Any]) -> None:
    await pool.signal("terminate")
    assert (await pool.result())["state"] == "Terminated"
