"""A ProxyPool spread over two availability zones on the AWS fake (moto behind tests/fakes/ec2.py).

Each spread entry pins one subnet (one zone); the pool puts one member in
each. Every instance the fake launches has the public IP 127.0.0.1 and the
members share one port, so one real Squid, run from the first member's user
data, serves both; each member's own console line says when it is ready.

A spot member whose instance EC2 recommends rebalancing is rotated make
before break by its pool's monitor; an on-demand member is never asked about.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from providers.aws import NAME_TAG, SQUID_CONF, STARTUP_READY, AwsConfig, AwsProvider
from providers.config import Config
from tests.fakes.ec2 import FakeEc2
from tests.helpers.config import lifecycle_instance_name, proxy_config
from tests.helpers.network import free_port
from tests.helpers.squid_upstream import SquidUpstreams, requires_squid, script_files
from tests.helpers.stacks import StackFactory
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import status_of, wait_for, wait_status
from tests.workflows.test_lifecycle_aws import (  # noqa: F401 (the fake EC2's fixture)
    PASSWORD,
    PROVIDER,
    VM_IP,
    fake,
    live_instance,
)

pytestmark = [pytest.mark.slow, requires_squid]

SPOT = "aws-spot"


def providers_of(fake: FakeEc2, config: Config) -> dict[str, AwsProvider]:  # noqa: F811 (fake)
    """An AwsProvider per entry of `config` on the fake, reading consoles unpaced."""
    made = {}
    for entry in config.providers:
        assert isinstance(entry.settings, AwsConfig)
        made[entry.name] = AwsProvider(
            entry.settings,
            config.installation,
            ec2=fake.client(),
            console_interval=0,
            advice_interval=0,
        )
    return made


def launched(fake: FakeEc2) -> list[Any]:  # noqa: F811 (fake)
    """moto's instances not shutting down or terminated."""
    return [i for i in fake.instances() if i.state not in ("shutting-down", "terminated")]


async def test_a_pool_spread_over_two_zones_puts_a_member_in_each(
    fake: FakeEc2,  # noqa: F811 (the fixture imported above)
    tls_origin: TlsOrigin,
    provider_stack_on: StackFactory,
    temporal_env: WorkflowEnvironment,
    squid_upstreams: SquidUpstreams,
) -> None:
    (subnet_a, zone_a), (subnet_b, zone_b) = fake.subnets()[:2]
    assert zone_a != zone_b
    block = {"region": "eu-west-1", "subnets": [subnet_a, subnet_b]}
    config = proxy_config(
        tls_origin.port, {"name": PROVIDER, "type": "aws", "aws": block}, password=PASSWORD
    )
    stack = await provider_stack_on(temporal_env, providers_of(fake, config), config)
    port = free_port()
    pool = await stack.client.start_workflow(
        "ProxyPool",
        {
            "replicas": 2,
            "template": stack.proxy_input(PROVIDER, port=port),
            "spread": [
                {"provider": PROVIDER, "placement": {"subnet": subnet_a}},
                {"provider": PROVIDER, "placement": {"subnet": subnet_b}},
            ],
        },
        id=f"pool-aws-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )

    await wait_for(lambda: len(launched(fake)) == 2, "both members' instances launched")
    instances = launched(fake)
    files = script_files(fake.user_data(instances[0].id))
    squid = await squid_upstreams.start(files.pop(SQUID_CONF), files, port=port)
    for instance in instances:
        fake.report(instance.id, STARTUP_READY)

    async def serving() -> bool:
        return bool((await pool.query("status"))["ready"] == 2)

    await wait_for(serving, "both members serving", deadline=120)
    status = await pool.query("status")
    placed = {m["member"]: m["placement"].get("subnet") for m in status["members"]}
    assert sorted(placed.values()) == sorted([subnet_a, subnet_b])
    # Each member's instance is in the subnet (the zone) its placement names.
    by_name = {
        {t["key"]: t["value"] for t in i.get_tags()}[NAME_TAG]: i.subnet_id for i in instances
    }
    assert sorted(by_name.values()) == sorted([subnet_a, subnet_b])
    # The provider's word on where traffic leaves: the instance's public IP.
    assert [m["exit_address"] for m in status["members"]] == [VM_IP, VM_IP]
    assert status["distinct_exits"] == 1

    # As EC2 stops a terminated instance's Squid: the members' monitors see it
    # go at their next probe, not at their next heartbeat (docs/cost.md).
    await pool.signal("terminate")
    await squid.terminate()
    assert (await pool.result())["state"] == "Terminated"
    await wait_for(lambda: not launched(fake), "every instance terminated")


async def test_a_spot_member_advised_to_rebalance_is_replaced_make_before_break(
    fake: FakeEc2,  # noqa: F811 (the fixture imported above)
    tls_origin: TlsOrigin,
    provider_stack_on: StackFactory,
    temporal_env: WorkflowEnvironment,
    squid_upstreams: SquidUpstreams,
) -> None:
    subnet = fake.subnets()[0][0]
    block = {"region": "eu-west-1", "subnets": [subnet]}
    config = proxy_config(
        tls_origin.port,
        {"name": SPOT, "type": "aws", "aws": {**block, "market": "spot"}},
        also=[{"name": PROVIDER, "type": "aws", "aws": block}],
        password=PASSWORD,
    )
    stack = await provider_stack_on(temporal_env, providers_of(fake, config), config)
    port = free_port()
    pool = await stack.client.start_workflow(
        "ProxyPool",
        {
            "replicas": 2,
            "template": stack.proxy_input(SPOT, port=port, drain_seconds=1),
            "spread": [{"provider": SPOT}, {"provider": PROVIDER}],
        },
        id=f"pool-aws-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )

    await wait_for(lambda: len(launched(fake)) == 2, "both members' instances launched")
    files = script_files(fake.user_data(launched(fake)[0].id))
    squid = await squid_upstreams.start(files.pop(SQUID_CONF), files, port=port)
    for instance in launched(fake):
        fake.report(instance.id, STARTUP_READY)

    async def ready() -> bool:
        return bool((await pool.query("status"))["ready"] == 2)

    await wait_for(ready, "both members serving", deadline=120)
    by_provider = {m["provider"]: m["member"] for m in (await pool.query("status"))["members"]}
    spot = stack.client.get_workflow_handle(by_provider[SPOT])
    on_demand = stack.client.get_workflow_handle(by_provider[PROVIDER])
    spot_id = (await status_of(spot)).provider_id
    on_demand_id = (await status_of(on_demand)).provider_id

    def console_reads(instance_id: str) -> int:
        return sum(c.params["InstanceId"] == instance_id for c in fake.calls("GetConsoleOutput"))

    on_demand_reads = console_reads(on_demand_id)

    # The spot instance's watcher reports the recommendation; Squid serves on.
    fake.recommend_rebalance(spot_id)
    # The pool's monitor asks after a round of probes; a busy machine makes rounds slow.
    rotating = await wait_status(
        spot,
        lambda s: s.replaced_because is not None,
        "the spot member's rotation under way",
        deadline=180,
    )
    assert rotating.replaced_because is not None
    assert rotating.replaced_because.why == "a rotate signal: EC2 rebalance recommendation"
    assert (rotating.state, rotating.provider_id) == ("Ready", spot_id)  # still serving
    serving = {e["member"] for e in await pool.query("endpoints")}
    assert serving == {spot.id, on_demand.id}

    # The replacement boots while the advised instance serves on.
    second = lifecycle_instance_name(spot.id, 1)
    await wait_for(lambda: live_instance(fake, second) is not None, "the replacement launched")
    assert live_instance(fake, lifecycle_instance_name(spot.id, 0)) is not None
    second_id = live_instance(fake, second).id
    fake.report(second_id, STARTUP_READY)
    again = await wait_status(
        spot, lambda s: s.provider_id == second_id and s.state == "Ready", "the replacement Ready"
    )
    assert (again.generation, again.disruptions, again.failures_in_a_row) == (1, 0, 0)
    assert again.cause is not None
    assert again.cause.why == "a rotate signal: EC2 rebalance recommendation"
    await wait_for(lambda: fake.instance(spot_id).state == "terminated", "the advised one gone")

    async def pool_serves_the_replacement() -> bool:
        status = await pool.query("status")
        row = next(m for m in status["members"] if m["member"] == spot.id)
        return bool(row["generation"] == 1 and status["ready"] == 2)

    await wait_for(pool_serves_the_replacement, "the pool serving the replacement")
    # Asked once, though the pool's monitor went on finding the advice each round.
    history = await spot.fetch_history()
    rotates = [
        e
        for e in history.events
        if e.HasField("workflow_execution_signaled_event_attributes")
        and e.workflow_execution_signaled_event_attributes.signal_name == "rotate"
    ]
    assert len(rotates) == 1
    # The on-demand member: never rotated, its console never read for advice.
    assert (await status_of(on_demand)).provider_id == on_demand_id
    assert console_reads(on_demand_id) == on_demand_reads

    await pool.signal("terminate")
    await squid.terminate()
    assert (await pool.result())["state"] == "Terminated"
    await wait_for(lambda: not launched(fake), "every instance terminated")
