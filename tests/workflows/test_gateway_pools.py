"""One gateway over two real ProxyPools: `--pool` given twice, one endpoint for both.

The worker has two local providers, `eu` and `us` (each its own state
directory and ports, as a Compute Engine and an EC2 entry would be), and
each pool takes its members from one. Which member carried a request is read
from the members' own access logs, not the gateway's word.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from activities.provider import ProviderActivities
from providers.config import parse_config
from providers.local import LocalConfig, LocalProvider
from tests.fakes.providers import FaultyProvider
from tests.helpers.api import call
from tests.helpers.config import PASSWORD, PASSWORD_ENV, USERNAME, local_entry, raw_config
from tests.helpers.gateway import GatewayProcess, pool_gateway, through
from tests.helpers.stacks import Stack
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import wait_for
from tests.helpers.workers import stop_worker
from tests.helpers.xdist import local_ports
from tests.workflows.test_gateway import REPLICAS, Pool, running_pool
from tests.workflows.test_pool_autoscale_e2e import (
    held_tunnels,
    request_through,
    settled_at,
    start_pool,
)
from worker import build_worker

pytestmark = pytest.mark.slow

REGIONS = ("eu", "us")
# The local provider's default range, outside xdist.
DEFAULT_PORTS = {"first_port": 20000, "last_port": 20999}


@pytest.fixture
async def regions(
    temporal_env: WorkflowEnvironment, tls_origin: TlsOrigin, state_dir: Path
) -> AsyncIterator[dict[str, Stack]]:
    """One worker with a local provider per region, and a Stack naming each."""
    ports = local_ports() or DEFAULT_PORTS
    half = (ports["last_port"] - ports["first_port"] + 1) // len(REGIONS)
    entries = []
    for n, name in enumerate(REGIONS):
        first = ports["first_port"] + n * half
        entry = local_entry(state_dir / name, name)
        entry["local"] |= {"first_port": first, "last_port": first + half - 1}
        entries.append(entry)
    raw = raw_config(entries[0], connect_ports=[443, tls_origin.port])
    raw["providers"] = entries
    config = parse_config(raw, environ={PASSWORD_ENV: PASSWORD})
    providers = {}
    for entry in entries:
        settings = LocalConfig(**entry["local"])
        providers[entry["name"]] = FaultyProvider(LocalProvider(settings, config.installation))
    activities = ProviderActivities(providers, config, ssl_context=tls_origin.client_ssl_context)
    task_queue = f"test-{uuid.uuid4().hex[:12]}"
    worker = build_worker(temporal_env.client, activities, task_queue=task_queue)
    run = asyncio.get_running_loop().create_task(worker.run())
    yield {
        name: Stack(
            temporal_env.client,
            task_queue,
            providers[name],
            config,
            tls_origin,
            state_dir / name,
            provider_name=name,
        )
        for name in REGIONS
    }
    await stop_worker(worker)
    activities.close()
    if run.done():
        run.result()  # a worker that died: say so rather than only time out


@contextlib.asynccontextmanager
async def two_pools(
    env: WorkflowEnvironment, regions: dict[str, Stack]
) -> AsyncIterator[tuple[dict[str, Pool], GatewayProcess]]:
    """A pool per region, and one gateway (`--pool eu --pool us`, API on) over both."""
    async with running_pool(regions["eu"]) as eu, running_pool(regions["us"]) as us:
        pools = {"eu": eu, "us": us}
        async with pool_gateway(
            env,
            regions["eu"],
            eu.handle.id,
            lambda _: ("--pool", us.handle.id),
            api=True,
        ) as gateway:
            await wait_for(
                lambda: (
                    gateway.metrics().get(("proxy_operator_gateway_members", ())) == 2 * REPLICAS
                ),
                "both pools' members in rotation",
            )
            yield pools, gateway


Snapshot = dict[str, tuple[collections.Counter[str], dict[str, str]]]


async def snapshot(pools: dict[str, Pool]) -> Snapshot:
    """Each pool's tunnels per instance now, and its endpoints (member id -> endpoint)."""
    return {name: (pool.tunnels(), await pool.endpoints()) for name, pool in pools.items()}


def carried(pools: dict[str, Pool], before: Snapshot) -> set[str]:
    """The members that carried a tunnel since `before`, by the instances' own logs: member
    ids, or the instance's name for one no member is at any more."""
    found = set()
    for name, pool in pools.items():
        tunnels, endpoints = before[name]
        member_at = {e: m for m, e in endpoints.items()}
        instance_at = pool.instance_by_endpoint()
        member_of = {i: member_at.get(e, i) for e, i in instance_at.items()}
        found |= {member_of.get(i, i) for i in pool.tunnels() - tunnels}
    return found


async def tunnel(gateway: GatewayProcess, stack: Stack, username: str) -> None:
    answer = await asyncio.to_thread(through, gateway, stack, username)
    assert answer.ok, (username, answer)


async def test_one_gateway_routes_sessions_pins_and_bans_across_two_pools(
    temporal_env: WorkflowEnvironment, regions: dict[str, Stack]
) -> None:
    stack = regions["eu"]
    async with two_pools(temporal_env, regions) as (pools, gateway):
        assert gateway.api is not None
        port, token = gateway.api
        endpoints = {name: await pool.endpoints() for name, pool in pools.items()}
        everyone = {m for listed in endpoints.values() for m in listed}
        ids = {pool.handle.id for pool in pools.values()}

        # Rotation reaches every member of both pools.
        before = await snapshot(pools)
        for _ in range(4 * len(everyone)):
            await tunnel(gateway, stack, USERNAME)
        assert carried(pools, before) == everyone

        # A provider filter reaches only the pool whose members it names.
        before = await snapshot(pools)
        for _ in range(2 * REPLICAS):
            await tunnel(gateway, stack, f"{USERNAME}-provider-us")
        assert carried(pools, before) == set(endpoints["us"])
        refused = await asyncio.to_thread(through, gateway, stack, f"{USERNAME}-provider-ap")
        assert refused.connect_status == 503

        # A pin to a member of the second pool goes to that member alone.
        pinned = sorted(endpoints["us"])[1]
        before = await snapshot(pools)
        await tunnel(gateway, stack, f"{USERNAME}-proxy-{pinned}")
        assert carried(pools, before) == {pinned}

        # Sessions spread over both pools, and /v1/sessions names each key's member.
        sessions: dict[str, str] = {}
        for n in range(40):
            key = f"basket-{n}"
            before = await snapshot(pools)
            await tunnel(gateway, stack, f"{USERNAME}-session-{key}")
            (member,) = carried(pools, before)
            reply = await asyncio.to_thread(call, port, "GET", f"/v1/sessions/{key}", token=token)
            assert reply.json() == {"session": key, "member": member}
            sessions[key] = member
            if {m.rpartition("/")[0] for m in sessions.values()} == ids:
                break
        assert {m.rpartition("/")[0] for m in sessions.values()} == ids, sessions

        # /v1/members lists both pools' members, each with its pool.
        reply = await asyncio.to_thread(call, port, "GET", "/v1/members", token=token)
        listing = reply.json()
        assert listing["pools"] == [pools["eu"].handle.id, pools["us"].handle.id]
        assert {(m["pool"], m["member"]) for m in listing["members"]} == {
            (pools[name].handle.id, member) for name in pools for member in endpoints[name]
        }

        # A ban of a member of pool B goes to pool B, which replaces it; pool A is untouched.
        banned = sorted(endpoints["us"])[0]
        reply = await asyncio.to_thread(
            call, port, "POST", "/v1/bans", token=token, body={"member": banned, "reason": "403"}
        )
        assert (reply.status, reply.json()) == (202, {"member": banned, "accepted": True})

        async def replaced() -> bool:
            now = await pools["us"].endpoints()
            return banned in now and now[banned] != endpoints["us"][banned]

        await wait_for(replaced, f"{banned} replaced by pool B", deadline=120)
        assert await pools["eu"].endpoints() == endpoints["eu"]

        # A new member in either pool is served once the gateway sees the change: the
        # banned member's replacement in B, and a member A scales up to.
        await pools["eu"].handle.execute_update("scale", {"replicas": REPLICAS + 1})

        async def grown() -> bool:
            return len(await pools["eu"].endpoints()) == REPLICAS + 1

        await wait_for(grown, "pool A's new member in its endpoints", deadline=120)
        (added,) = set(await pools["eu"].endpoints()) - set(endpoints["eu"])
        for member in (banned, added):

            async def served(member: str = member) -> bool:
                before = await snapshot(pools)
                answer = await asyncio.to_thread(
                    through, gateway, stack, f"{USERNAME}-proxy-{member}"
                )
                return answer.ok and carried(pools, before) == {member}

            await wait_for(served, f"a pin to {member} carried by its new instance")


async def test_a_gateway_over_two_pools_at_zero_wakes_only_the_pool_a_request_can_reach(
    temporal_env: WorkflowEnvironment, regions: dict[str, Stack]
) -> None:
    handles = {
        name: await start_pool(regions[name], 0, max_replicas=1, scale_down_after_seconds=3600)
        for name in REGIONS
    }
    eu, us = handles["eu"].id, handles["us"].id
    flags = ("--pool", us, "--wake-timeout", "180", "--report-interval", "5")

    async def replicas(name: str) -> int:
        status = await handles[name].query("status")
        return int(status["replicas"])

    try:
        async with pool_gateway(
            temporal_env, regions["eu"], eu, lambda _: (*flags, "--gateway-name", "gw-test")
        ) as gateway:
            # A request no pool could ever serve is refused at once, not held.
            refused = await asyncio.to_thread(
                through, gateway, regions["eu"], f"{USERNAME}-provider-ap"
            )
            assert refused.connect_status == 503

            # Every pool at zero: a plain request wakes the first pool given, alone.
            head, served = await asyncio.to_thread(request_through, gateway, regions["eu"], 210)
            assert head.startswith(b"HTTP/1.1 200") and served, head
            status = await settled_at(handles["eu"], 1, "pool A woken to one member")
            assert status["scaling"]["last_decision"].startswith("woken by gateway gw-test")
            assert await replicas("us") == 0

            # A request only pool B can serve, B at zero, A serving: it wakes B alone.
            only_us = f"{USERNAME}-provider-us"
            head, served = await asyncio.to_thread(
                request_through, gateway, regions["eu"], 210, only_us
            )
            assert head.startswith(b"HTTP/1.1 200") and served, head
            status = await settled_at(handles["us"], 1, "pool B woken to one member")
            assert status["scaling"]["last_decision"].startswith("woken by gateway gw-test")
            assert await replicas("eu") == 1

            # A tunnel held open through pool B is B's demand, not A's.
            held = held_tunnels(gateway, regions["eu"], username=only_us)
            try:
                await asyncio.to_thread(held.open, 1)

                async def told_apart() -> bool:
                    eu_status, us_status = [
                        (await handles[name].query("status"))["scaling"] for name in REGIONS
                    ]
                    return bool(
                        us_status["open_tunnels"] >= 1
                        and eu_status["gateways"] >= 1
                        and eu_status["open_tunnels"] == 0
                    )

                await wait_for(told_apart, "B told of its tunnel, A of none", deadline=120)
                assert held.failures == 0
            finally:
                await asyncio.to_thread(held.close)
    finally:
        for handle in handles.values():
            await handle.signal("terminate")
    await wait_for(
        lambda: not any(stack.instances() for stack in regions.values()),
        "every member's Squid gone",
        deadline=120,
    )
