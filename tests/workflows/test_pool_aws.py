"""A ProxyPool spread over two availability zones on the AWS fake (moto behind tests/fakes/ec2.py).

Each spread entry pins one subnet (one zone); the pool puts one member in
each. Every instance the fake launches has the public IP 127.0.0.1 and the
members share one port, so one real Squid, run from the first member's user
data, serves both; each member's own console line says when it is ready.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from providers.aws import NAME_TAG, SQUID_CONF, STARTUP_READY, AwsConfig, AwsProvider
from tests.fakes.ec2 import FakeEc2
from tests.helpers.config import proxy_config
from tests.helpers.network import free_port
from tests.helpers.squid_upstream import SquidUpstreams, requires_squid, script_files
from tests.helpers.stacks import StackFactory
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import wait_for
from tests.workflows.test_lifecycle_aws import (  # noqa: F401 (the fake EC2's fixture)
    PASSWORD,
    PROVIDER,
    VM_IP,
    fake,
)

pytestmark = [pytest.mark.slow, requires_squid]


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
    settings = config.provider(PROVIDER).settings
    assert isinstance(settings, AwsConfig)
    provider = AwsProvider(settings, config.installation, ec2=fake.client(), console_interval=0)
    stack = await provider_stack_on(temporal_env, {PROVIDER: provider}, config)
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

    def launched() -> list[Any]:
        return [i for i in fake.instances() if i.state not in ("shutting-down", "terminated")]

    await wait_for(lambda: len(launched()) == 2, "both members' instances launched")
    instances = launched()
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
    await wait_for(lambda: not launched(), "every instance terminated")
