"""ProxyLifecycle with the AWS provider, against moto's EC2 behind tests/fakes/ec2.py.

The real boto3 client talks to the fake; every instance it launches has the
public IP 127.0.0.1, and the test runs the files the instance's user data
would write (squid.conf and the htpasswd) with a real Squid on that port,
then writes the user data's "ready" line to the instance's console. So
"Ready" means a CONNECT probe really tunnelled through the Squid config the
provider shipped.

A capacity error makes the workflow wait minutes on a workflow timer, on the
time-skipping test server (tests/helpers/time_skipping.py); a spot
interruption ends the instance as lost, and the workflow replaces it; so
does a spot interruption notice, before EC2 reclaims the instance. Either is
a disruption, never a crash. A rebalance recommendation, earlier still,
has the monitor ask the workflow for a make-before-break rotation.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.probe import probe_connect
from contract import QUOTA_RETRY_DELAY
from providers.aws import NAME_TAG, PORT_TAG, SQUID_CONF, STARTUP_READY, AwsConfig, AwsProvider
from providers.config import Config
from tests.fakes.ec2 import FakeEc2
from tests.helpers.config import USERNAME, lifecycle_instance_name, proxy_config
from tests.helpers.network import free_port
from tests.helpers.squid_upstream import LocalSquid, SquidUpstreams, requires_squid, script_files
from tests.helpers.stacks import ProviderStack, StackFactory
from tests.helpers.time_skipping import skip_past_pending_timer
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import status_of, wait_for, wait_status

pytestmark = [pytest.mark.slow, requires_squid]

PROVIDER = "aws-test"
PASSWORD = "aws-workflow-password"
VM_IP = "127.0.0.1"


@pytest.fixture
def fake() -> Iterator[FakeEc2]:
    with FakeEc2(auto_start_ip=VM_IP) as server:
        yield server


def aws_config(origin_port: int, subnet: str) -> Config:
    block = {"region": "eu-west-1", "subnets": [subnet], "market": "spot"}
    return proxy_config(
        origin_port, {"name": PROVIDER, "type": "aws", "aws": block}, password=PASSWORD
    )


@pytest.fixture
def config(fake: FakeEc2, tls_origin: TlsOrigin) -> Config:
    return aws_config(tls_origin.port, fake.subnets()[0][0])


@pytest.fixture
async def stack(
    fake: FakeEc2,
    config: Config,
    provider_stack_on: StackFactory,
    time_skipping_env: WorkflowEnvironment,
) -> ProviderStack:
    settings = config.provider(PROVIDER).settings
    assert isinstance(settings, AwsConfig)
    provider = AwsProvider(
        settings, config.installation, ec2=fake.client(), console_interval=0, advice_interval=0
    )
    return await provider_stack_on(time_skipping_env, {PROVIDER: provider}, config)


def live_instance(fake: FakeEc2, name: str) -> Any | None:
    """moto's instance of that name not yet terminated, once RunInstances made it."""
    for instance in fake.instances():
        tags = {t["key"]: t["value"] for t in instance.get_tags()}
        if tags.get(NAME_TAG) == name and instance.state not in ("shutting-down", "terminated"):
            return instance
    return None


async def serve(
    fake: FakeEc2,
    squid_upstreams: SquidUpstreams,
    handle: WorkflowHandle[Any, Any],
    name: str,
    *,
    while_in: tuple[str, ...] = ("Provisioning", "Replacing"),
) -> tuple[str, LocalSquid]:
    """Play the user data: run Squid from the files it writes, then report ready."""
    await wait_for(lambda: live_instance(fake, name) is not None, f"instance {name}")
    instance = live_instance(fake, name)
    assert instance is not None
    files = script_files(fake.user_data(instance.id))
    squid_conf = files.pop(SQUID_CONF)
    port = int({t["key"]: t["value"] for t in instance.get_tags()}[PORT_TAG])
    squid = await squid_upstreams.start(squid_conf, files, port=port)
    # Running all along; only now does the user data report Squid ready.
    assert (await status_of(handle)).state in while_in
    fake.report(instance.id, STARTUP_READY)
    return instance.id, squid


async def ready_proxy(
    stack: ProviderStack, fake: FakeEc2, squid_upstreams: SquidUpstreams
) -> tuple[WorkflowHandle[Any, Any], str, LocalSquid]:
    """A spot proxy Ready on its first instance: the handle, the instance id, its Squid."""
    handle = await stack.start(PROVIDER, port=free_port())
    first_id, first_squid = await serve(
        fake, squid_upstreams, handle, lifecycle_instance_name(handle.id, 0)
    )
    await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    return handle, first_id, first_squid


async def test_capacity_wait_then_a_spot_interruption_is_replaced_then_terminated(
    stack: ProviderStack, fake: FakeEc2, squid_upstreams: SquidUpstreams
) -> None:
    port = free_port()
    fake.inject_error("RunInstances", "capacity")
    handle = await stack.start(PROVIDER, port=port)
    first, second = lifecycle_instance_name(handle.id, 0), lifecycle_instance_name(handle.id, 1)

    waiting = await wait_status(
        handle, lambda s: (s.waiting_for or "").startswith("waiting for quota"), "capacity wait"
    )
    assert waiting.last_error is not None and "InsufficientInstanceCapacity" in waiting.last_error
    assert live_instance(fake, first) is None
    skipped = await skip_past_pending_timer(stack.env, handle)
    assert timedelta(minutes=2) < skipped <= QUOTA_RETRY_DELAY  # the long wait, not a retry

    first_id, first_squid = await serve(fake, squid_upstreams, handle, first)
    ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    assert (ready.endpoint, ready.provider, ready.provider_id) == (
        f"{VM_IP}:{port}",
        PROVIDER,
        first_id,
    )
    tunnelled = await probe_connect(
        VM_IP,
        port,
        USERNAME,
        PASSWORD,
        stack.origin.url,
        ssl_context=stack.origin.client_ssl_context,
    )
    assert tunnelled.ok, tunnelled

    # EC2 reclaims the spot instance: its Squid goes with it.
    fake.interrupt_spot(first_id, state="shutting-down")
    await first_squid.terminate()
    replaced = await wait_status(
        handle, lambda s: "spot interruption" in (s.last_error or ""), "the interruption seen"
    )
    assert replaced.state in ("Replacing", "Provisioning")
    second_id, second_squid = await serve(fake, squid_upstreams, handle, second)
    again = await wait_status(handle, lambda s: s.state == "Ready", "the replacement Ready")
    assert (again.provider_id, again.generation) == (second_id, 1)
    assert (again.disruptions, again.failures_in_a_row) == (1, 0)  # no crash counted

    await handle.signal("terminate", {"reason": "test done"})
    await wait_for(lambda: live_instance(fake, second) is None, "the instance terminated")
    await second_squid.terminate()
    result: dict[str, Any] = await handle.result()
    assert (result["state"], result["reason"]) == ("Terminated", "test done")
    assert [i for i in fake.instances() if i.state != "terminated"] == []


async def test_a_spot_interruption_notice_replaces_the_proxy_before_ec2_reclaims_it(
    stack: ProviderStack, fake: FakeEc2, squid_upstreams: SquidUpstreams
) -> None:
    handle, first_id, first_squid = await ready_proxy(stack, fake, squid_upstreams)
    first, second = lifecycle_instance_name(handle.id, 0), lifecycle_instance_name(handle.id, 1)

    # The two-minute notice, as the user data's watcher handles it: the
    # console line, then Squid stopped. EC2 has not touched the instance.
    fake.notify_spot_interruption(first_id, when="2026-12-02T18:30:00Z")
    await first_squid.terminate()
    noticed = await wait_status(
        handle, lambda s: "spot interruption notice" in (s.last_error or ""), "the notice seen"
    )
    assert noticed.last_error is not None
    assert (
        f"{first} is TERMINATED: spot interruption notice: terminate at 2026-12-02T18:30:00Z"
        in noticed.last_error
    )
    assert "Server.SpotInstanceTermination" not in noticed.last_error  # ahead of EC2

    second_id, second_squid = await serve(fake, squid_upstreams, handle, second)
    again = await wait_status(handle, lambda s: s.state == "Ready", "the replacement Ready")
    assert (again.provider_id, again.generation) == (second_id, 1)
    assert (again.disruptions, again.failures_in_a_row) == (1, 0)  # no crash counted
    # The lifecycle deleted the noticed instance itself, not EC2.
    await wait_for(lambda: live_instance(fake, first) is None, "the noticed instance deleted")
    assert fake.instance(first_id).state_reason.code == "Client.UserInitiatedShutdown"

    await handle.signal("terminate", {"reason": "test done"})
    await wait_for(lambda: live_instance(fake, second) is None, "the instance terminated")
    await second_squid.terminate()
    result: dict[str, Any] = await handle.result()
    assert (result["state"], result["reason"]) == ("Terminated", "test done")


async def test_a_rebalance_recommendation_replaces_the_proxy_make_before_break(
    stack: ProviderStack, fake: FakeEc2, squid_upstreams: SquidUpstreams
) -> None:
    handle, first_id, first_squid = await ready_proxy(stack, fake, squid_upstreams)
    first, second = lifecycle_instance_name(handle.id, 0), lifecycle_instance_name(handle.id, 1)

    # The watcher's report: Squid serves on, EC2 has not acted.
    fake.recommend_rebalance(first_id)
    rotating = await wait_status(
        handle, lambda s: s.replaced_because is not None, "the rotation under way"
    )
    assert rotating.replaced_because.why == "a rotate signal: EC2 rebalance recommendation"
    assert (rotating.state, rotating.provider_id) == ("Ready", first_id)  # still serving

    second_id, second_squid = await serve(
        fake, squid_upstreams, handle, second, while_in=("Ready",)
    )
    again = await wait_status(
        handle, lambda s: s.provider_id == second_id and s.state == "Ready", "the replacement"
    )
    assert (again.generation, again.disruptions, again.failures_in_a_row) == (1, 0, 0)
    await wait_for(lambda: live_instance(fake, first) is None, "the advised instance deleted")
    await first_squid.terminate()
    # Asked once, though the old instance's monitor probed on through the rotation.
    history = await stack.client.get_workflow_handle(handle.id).fetch_history()
    rotates = [
        event
        for event in history.events
        if event.HasField("workflow_execution_signaled_event_attributes")
        and event.workflow_execution_signaled_event_attributes.signal_name == "rotate"
    ]
    assert len(rotates) == 1

    await handle.signal("terminate", {"reason": "test done"})
    await wait_for(lambda: live_instance(fake, second) is None, "the instance terminated")
    await second_squid.terminate()
    result: dict[str, Any] = await handle.result()
    assert (result["state"], result["reason"]) == ("Terminated", "test done")
