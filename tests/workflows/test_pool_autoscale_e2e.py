"""Autoscaled pools end to end: the local provider's real Squids, a real gateway reporting.

Short delays in the pool's `autoscale` input (seconds, not minutes) and a
gateway reporting every 5 s let a load ramp run its course in a test: the
load is tunnels held open through the gateway, which counts them in its
socket table and reports them (gateway/demand.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment

from tests.helpers.config import PASSWORD, USERNAME
from tests.helpers.gateway import GatewayProcess, pool_gateway
from tests.helpers.network import closed_by_peer, read_head
from tests.helpers.stacks import Stack
from tests.helpers.tunnel import TIMEOUT, HeldTunnels, connect_request
from tests.helpers.waiting import wait_for
from workflows.pool_autoscale import MAX_TUNNELS

pytestmark = pytest.mark.slow

QUIET_HEALTH = {"interval_seconds": 3600, "failure_threshold": 2}
REPORT_SECONDS = 5
DEADLINE = 240


async def start_pool(
    stack: Stack, replicas: int | None, **autoscale: int
) -> WorkflowHandle[Any, Any]:
    """An autoscaled pool of local members; without `replicas` when it is None."""
    first_size = {} if replicas is None else {"replicas": replicas}
    return await stack.client.start_workflow(
        "ProxyPool",
        {
            **first_size,
            "template": stack.proxy_input(
                health=QUIET_HEALTH | {"target": stack.origin.url}, drain_seconds=2
            ),
            "autoscale": autoscale,
        },
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )


async def settled_at(handle: WorkflowHandle[Any, Any], size: int, what: str) -> dict[str, Any]:
    """Wait until the pool keeps `size` members, all serving; its status then."""
    seen: list[dict[str, Any]] = []

    async def settled() -> bool:
        seen.append(await handle.query("status"))
        status = seen[-1]
        return bool(
            status["replicas"] == size
            and status["ready"] == size
            and len(status["members"]) == size
        )

    try:
        await wait_for(settled, what, deadline=DEADLINE)
    except AssertionError as timed_out:
        last = seen[-1] if seen else {}
        shown = {key: last.get(key) for key in ("replicas", "ready", "scaling")}
        raise AssertionError(f"{timed_out}; the pool's last status: {shown}") from None
    return seen[-1]


def gateway_for(
    env: WorkflowEnvironment, stack: Stack, pool: str, extra_args: Sequence[str] = ()
) -> contextlib.AbstractAsyncContextManager[GatewayProcess]:
    """A gateway over `pool` that reports demand every REPORT_SECONDS."""
    flags = ("--report-interval", str(REPORT_SECONDS), "--gateway-name", "gw-test", *extra_args)
    return pool_gateway(env, stack, pool, lambda _directory: flags)


def held_tunnels(
    gateway: GatewayProcess, stack: Stack, timeout: float = TIMEOUT, username: str = USERNAME
) -> HeldTunnels:
    origin = stack.origin
    return HeldTunnels(
        ("127.0.0.1", gateway.port),
        (origin.host, origin.port),
        origin.client_ssl_context,
        (username, PASSWORD),
        timeout,
    )


async def test_an_autoscaled_pool_without_replicas_starts_at_min_replicas(stack: Stack) -> None:
    handle = await start_pool(stack, None, min_replicas=1, max_replicas=2)
    status = await settled_at(handle, 1, "the pool at min_replicas, its first size")
    assert status["scaling"]["mode"] == "autoscaled"
    assert len(stack.instances()) == 1
    await handle.signal("terminate")
    await wait_for(lambda: not stack.instances(), "every member's Squid gone", deadline=DEADLINE)


async def test_a_load_ramp_scales_up_to_the_bound_and_back_down_after_it_stops(
    temporal_env: WorkflowEnvironment, stack: Stack
) -> None:
    handle = await start_pool(
        stack,
        1,
        min_replicas=1,
        max_replicas=3,
        target_tunnels_per_member=2,
        scale_up_after_seconds=2,
        scale_down_after_seconds=6,
    )
    await settled_at(handle, 1, "the pool's first member")
    async with gateway_for(temporal_env, stack, handle.id) as gateway:
        # 10 tunnels want 5 members: the pool stops at its bound, 3. Opened
        # off the event loop: the worker in this process serves the pool.
        held = held_tunnels(gateway, stack)
        try:
            await asyncio.to_thread(held.open, 10)
            status = await settled_at(handle, 3, "the pool scaled up to max_replicas")
            scaling = status["scaling"]
            assert scaling["mode"] == "autoscaled"
            assert scaling["open_tunnels"] >= 10
            assert scaling["last_decision"].startswith("scale up 1 -> 3")
            assert held.failures == 0
        finally:
            await asyncio.to_thread(held.close)
        status = await settled_at(handle, 1, "the pool back at min_replicas after the load")
    scaling = status["scaling"]
    assert scaling["last_decision"].startswith("scale down 2 -> 1")
    assert scaling["member_hours"] > 0
    await handle.signal("terminate")
    await wait_for(lambda: not stack.instances(), "every member's Squid gone", deadline=DEADLINE)


async def test_an_idle_pool_reaches_zero_and_forged_reports_stay_in_bounds(
    stack: Stack,
) -> None:
    handle = await start_pool(
        stack, 1, max_replicas=2, scale_up_after_seconds=2, scale_down_after_seconds=3
    )
    await settled_at(handle, 1, "the pool's first member")
    # No gateway reports: no demand, and after the delay no member.
    status = await settled_at(handle, 0, "the idle pool at zero")
    assert not stack.instances()
    assert status["state"] == "Ready"
    assert status["scaling"]["last_decision"].startswith("scale down 1 -> 0")
    # Anyone may send an update: the most a report may say, as a forger would.
    forged = {"gateway": "forged", "open_tunnels": MAX_TUNNELS}
    await handle.execute_update("report_demand", forged)
    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await handle.execute_update("report_demand", {"gateway": "x", "open_tunnels": 10**9})
    assert "open_tunnels: input should be less" in str(refused.value.cause)
    status = await settled_at(handle, 2, "the forged demand's pool at max_replicas")
    assert "scale up 0 -> 2" in status["scaling"]["last_decision"]
    # `scale` on an autoscaled pool changes its bounds, at once.
    for body, problem in (
        ({"replicas": 2}, "this pool is autoscaled: give min_replicas"),
        ({"min_replicas": 3}, "min_replicas (3) must not exceed max_replicas (2)"),
    ):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update("scale", body)
        assert problem in str(refused.value.cause)
    assert await handle.execute_update("scale", {"max_replicas": 1}) == {
        "min_replicas": 0,
        "max_replicas": 1,
        "previous": [0, 2],
    }
    status = await settled_at(handle, 1, "the pool within its new bound")
    assert status["scaling"]["last_decision"].startswith("bounds are now 0..1: 2 -> 1")
    await handle.signal("terminate")
    await wait_for(lambda: not stack.instances(), "every member's Squid gone", deadline=DEADLINE)


def costless_connections(gateway: GatewayProcess, stack: Stack, each: int) -> list[socket.socket]:
    """`each` connections of every kind a client without the fleet's consent can open:
    silent, half a request head, a wrong password (407), a port not allowed (403)."""
    origin = (stack.origin.host, stack.origin.port)
    sent = [
        b"",
        f"CONNECT {origin[0]}:{origin[1]} HTTP/1.1\r\n".encode(),
        connect_request(USERNAME, "not-the-password", origin),
        connect_request(USERNAME, PASSWORD, (origin[0], 25)),
    ]
    opened = []
    for request in sent * each:
        sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=5)
        sock.sendall(request)
        opened.append(sock)
    return opened


async def test_sockets_without_a_granted_tunnel_are_cut_and_wake_no_pool(
    temporal_env: WorkflowEnvironment, stack: Stack
) -> None:
    handle = await start_pool(
        stack,
        0,
        max_replicas=3,
        target_tunnels_per_member=2,
        scale_up_after_seconds=2,
        scale_down_after_seconds=3600,
    )
    # A report window long enough to open every connection in: the first
    # report then gives the most seen open during it.
    flags = ["--report-interval", "10", "--wake-timeout", "180"]
    async with gateway_for(temporal_env, stack, handle.id, flags) as gateway:
        costless = await asyncio.to_thread(costless_connections, gateway, stack, 15)
        try:

            async def reported() -> bool:
                status = await handle.query("status")
                return bool(status["scaling"]["gateways"])

            await wait_for(reported, "the gateway's first demand report", deadline=DEADLINE)
            status = await handle.query("status")
            assert status["scaling"]["open_tunnels"] == 0, status["scaling"]
            assert status["replicas"] == 0 and not stack.instances()
            # The front cuts each within seconds, whatever it answered first.
            await wait_for(
                lambda: all(closed_by_peer(sock) for sock in costless),
                "every connection without a tunnel cut by the gateway",
                deadline=60,
            )
        finally:
            for sock in costless:
                sock.close()
        assert (await handle.query("status"))["replicas"] == 0
        # Granted tunnels are demand: the first wakes the pool, all five size it.
        held = held_tunnels(gateway, stack, timeout=210)  # the first waits for the wake
        try:
            await asyncio.to_thread(held.open, 5)
            status = await settled_at(handle, 3, "the pool sized by five tunnels")
            assert status["scaling"]["open_tunnels"] >= 5
        finally:
            await asyncio.to_thread(held.close)
    await handle.signal("terminate")
    await wait_for(lambda: not stack.instances(), "every member's Squid gone", deadline=DEADLINE)


def request_through(
    gateway: GatewayProcess, stack: Stack, timeout: float, username: str = USERNAME
) -> tuple[bytes, bool]:
    """(the gateway's answer head to a CONNECT, whether a GET through the tunnel then got 200)."""
    origin = stack.origin
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=timeout) as sock:
        sock.sendall(connect_request(username, PASSWORD, (origin.host, origin.port)))
        head = read_head(sock)
        if not head.startswith(b"HTTP/1.1 200"):
            return head, False
        with origin.client_ssl_context.wrap_socket(sock, server_hostname=origin.host) as tls:
            tls.sendall(
                f"GET / HTTP/1.1\r\nHost: {origin.host}\r\nConnection: close\r\n\r\n".encode()
            )
            return head, read_head(tls).startswith(b"HTTP/1.1 200")


async def test_connects_at_zero_on_two_gateways_wake_one_member_and_are_tunnelled(
    temporal_env: WorkflowEnvironment, stack: Stack
) -> None:
    handle = await start_pool(stack, 0, max_replicas=2, scale_down_after_seconds=3600)
    # Generous: a member's Squid starts in seconds, slower on a loaded machine.
    wake = ["--wake-timeout", "180"]
    async with (
        gateway_for(temporal_env, stack, handle.id, wake) as first,
        gateway_for(temporal_env, stack, handle.id, [*wake, "--gateway-name", "gw-2"]) as second,
    ):
        assert not stack.instances()
        answers = await asyncio.gather(
            *(asyncio.to_thread(request_through, g, stack, 210) for g in (first, second))
        )
        for head, served in answers:
            assert head.startswith(b"HTTP/1.1 200") and served, head
        status = await handle.query("status")
        # Both gateways held a client and woke the pool: one member started.
        assert status["replicas"] == 1 and len(status["members"]) == 1
        assert status["members"][0]["member"] == f"{handle.id}/0"
        assert status["scaling"]["last_decision"].startswith("woken by gateway gw-")
        served_metric = ("proxy_operator_gateway_held_connects_total", (("outcome", "served"),))
        assert all(g.metrics()[served_metric] == 1 for g in (first, second))
        # Once the router has the member, CONNECTs go to it directly.
        await settled_at(handle, 1, "the woken member serving")

        async def member_in_router() -> bool:
            found = await asyncio.to_thread(first.metrics)
            return found[("proxy_operator_gateway_members", ())] == 1

        await wait_for(member_in_router, "the gateway's router on the member", deadline=DEADLINE)
        head, served = await asyncio.to_thread(request_through, first, stack, 60)
        assert served, head
        assert first.metrics()[served_metric] == 1
    await handle.signal("terminate")
    await wait_for(lambda: not stack.instances(), "every member's Squid gone", deadline=DEADLINE)


async def test_a_pool_that_cannot_wake_answers_503_with_retry_after_past_the_wake_timeout(
    temporal_env: WorkflowEnvironment, stack: Stack
) -> None:
    handle = await start_pool(stack, 0, max_replicas=0)
    async with gateway_for(temporal_env, stack, handle.id, ["--wake-timeout", "2"]) as gateway:
        head, served = await asyncio.to_thread(request_through, gateway, stack, 60)
        held = gateway.metrics()
    assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 2\r\n" in head, head
    assert not served
    # Held once: Squid passed the answer on rather than trying the holder again.
    timed_out = ("proxy_operator_gateway_held_connects_total", (("outcome", "timed_out"),))
    assert held[timed_out] == 1
    await handle.signal("terminate")
