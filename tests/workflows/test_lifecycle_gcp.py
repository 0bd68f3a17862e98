"""ProxyLifecycle with the GCP provider, against the fake Compute Engine (issue 6).

The real google-cloud-compute REST clients talk to tests/fakes/compute.py; the
fake starts every VM whose insert finishes with the external IP 127.0.0.1,
and the test runs the files the VM's startup script would write (squid.conf
and the htpasswd) with a real Squid on that port. So "Ready" means a CONNECT
probe really tunnelled through the Squid config the provider shipped.

A quota error makes the workflow wait minutes (next_retry_delay, 3 minutes by
default) on a workflow timer. That runs on the time-skipping test server, and
the test skips exactly to that timer: see tests/helpers/time_skipping.py for
why a generous `env.sleep` is not enough there.
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
from providers.config import Config
from providers.gcp import (
    PORT_METADATA_KEY,
    SQUID_CONF,
    STARTUP_READY,
    STARTUP_SCRIPT_KEY,
    STARTUP_STATE_ATTRIBUTE,
    GcpConfig,
    GcpProvider,
    firewall_name,
)
from tests.fakes.compute import DEFAULT_PROJECT, DEFAULT_ZONES, FakeCompute
from tests.helpers.config import INSTALLATION, USERNAME, lifecycle_instance_name, proxy_config
from tests.helpers.network import free_port
from tests.helpers.squid_upstream import (
    LocalSquid,
    SquidUpstreams,
    requires_squid,
    script_files,
)
from tests.helpers.stacks import ProviderStack, StackFactory
from tests.helpers.time_skipping import skip_past_pending_timer
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import status_of, wait_for, wait_status
from workflows.lifecycle_crash_budget import CRASH_BUDGET

pytestmark = [pytest.mark.slow, requires_squid]

PROVIDER = "gcp-test"
ZONE = DEFAULT_ZONES[0]
PASSWORD = "gcp-workflow-password"
VM_IP = "127.0.0.1"


def gcp_config(origin_port: int, *, spot: bool = False) -> Config:
    settings: dict[str, Any] = {"project": DEFAULT_PROJECT, "zone": ZONE}
    if spot:
        settings["spot"] = True
    return proxy_config(
        origin_port, {"name": PROVIDER, "type": "gcp", "gcp": settings}, password=PASSWORD
    )


@pytest.fixture
def fake() -> Iterator[FakeCompute]:
    with FakeCompute(auto_start_ip=VM_IP) as server:
        yield server


def gcp_provider(fake: FakeCompute, config: Config) -> GcpProvider:
    """The provider as `from_config` builds it, but on clients pointed at the fake."""
    settings = config.provider(PROVIDER).settings
    assert isinstance(settings, GcpConfig)
    return GcpProvider(settings, config.installation, guest_attribute_interval=0, **fake.clients())


@pytest.fixture
async def stack(
    fake: FakeCompute,
    provider_stack_on: StackFactory,
    time_skipping_env: WorkflowEnvironment,
    tls_origin: TlsOrigin,
) -> ProviderStack:
    config = gcp_config(tls_origin.port)
    return await provider_stack_on(
        time_skipping_env, {PROVIDER: gcp_provider(fake, config)}, config
    )


@pytest.fixture
async def spot_stack(
    fake: FakeCompute,
    provider_stack_on: StackFactory,
    time_skipping_env: WorkflowEnvironment,
    tls_origin: TlsOrigin,
) -> ProviderStack:
    config = gcp_config(tls_origin.port, spot=True)
    return await provider_stack_on(
        time_skipping_env, {PROVIDER: gcp_provider(fake, config)}, config
    )


def vm_status(fake: FakeCompute, name: str) -> str | None:
    instance = fake.instance(ZONE, name)
    return None if instance is None else str(instance["status"])


async def monitor_finished(handle: WorkflowHandle[Any, Any]) -> bool:
    pending = (await handle.describe()).raw_description.pending_activities
    return all(activity.activity_type.name != "monitor" for activity in pending)


def instance_metadata(instance: dict[str, Any]) -> dict[str, str]:
    return {item["key"]: item["value"] for item in instance["metadata"]["items"]}


def startup_script(instance: dict[str, Any]) -> str:
    return instance_metadata(instance)[STARTUP_SCRIPT_KEY]


async def serve(
    fake: FakeCompute, squid_upstreams: SquidUpstreams, handle: WorkflowHandle[Any, Any], name: str
) -> LocalSquid:
    """Play the VM's startup script: run Squid from the files it writes, then report ready."""
    instance = fake.instance(ZONE, name)
    assert instance is not None and instance["status"] == "RUNNING"
    files = script_files(startup_script(instance))
    squid_conf = files.pop(SQUID_CONF)
    port = int(instance_metadata(instance)[PORT_METADATA_KEY])
    squid = await squid_upstreams.start(squid_conf, files, port=port)
    # The VM has been RUNNING all along; only now does its startup script
    # report Squid ready, and only now may the workflow probe it.
    assert (await status_of(handle)).state in ("Provisioning", "Replacing")
    fake.guest_write(ZONE, name, STARTUP_STATE_ATTRIBUTE, STARTUP_READY)
    return squid


async def terminate(
    handle: WorkflowHandle[Any, Any], fake: FakeCompute, name: str, squid: LocalSquid
) -> dict[str, Any]:
    """Terminate a Ready proxy without leaving an activity behind the workflow.

    Deleting a VM takes a while, and its Squid stops meanwhile. Holding the
    delete operation until the monitor has seen that keeps any activity from
    outliving the workflow: on the test server such an activity would hold a
    time-skipping lock for good (tests/helpers/time_skipping.py).
    """
    fake.set_operations_paused(True)
    await handle.signal("terminate", {"reason": "test done"})
    await wait_for(lambda: vm_status(fake, name) == "STOPPING", "the VM to be stopping")
    await squid.terminate()
    await wait_for(lambda: monitor_finished(handle), "the monitor to see the VM go")
    fake.set_operations_paused(False)
    result: dict[str, Any] = await handle.result()
    assert (result["state"], result["reason"]) == ("Terminated", "test done")
    assert fake.instance_keys() == set()
    final = await status_of(handle)
    assert (final.state, final.endpoint) == ("Terminated", "")
    return result


async def test_quota_error_waits_for_quota_then_the_vm_serves_until_terminated(
    stack: ProviderStack,
    fake: FakeCompute,
    squid_upstreams: SquidUpstreams,
) -> None:
    port = free_port()
    fake.inject_error("insert", "quota", zone=ZONE)
    handle = await stack.start(PROVIDER, port=port)
    name = lifecycle_instance_name(handle.id, 0)

    waiting = await wait_status(
        handle, lambda s: (s.waiting_for or "").startswith("waiting for quota"), "quota wait"
    )
    assert waiting.state == "Provisioning" and waiting.endpoint == ""
    assert waiting.last_error is not None and "Quota 'CPUS' exceeded" in waiting.last_error
    assert fake.instance(ZONE, name) is None
    assert len(fake.calls("insert")) == 1

    skipped = await skip_past_pending_timer(stack.env, handle)
    assert timedelta(minutes=2) < skipped <= QUOTA_RETRY_DELAY  # the long wait, not a retry

    await wait_for(lambda: len(fake.calls("insert")) == 2, "the insert retried after the wait")
    await wait_for(lambda: vm_status(fake, name) == "RUNNING", f"instance {name}")
    squid = await serve(fake, squid_upstreams, handle, name)

    status = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    assert status.waiting_for is None
    assert status.endpoint == f"{VM_IP}:{port}"
    assert (status.provider, status.provider_id) == (PROVIDER, f"{ZONE}/{name}")
    assert status.last_probe is not None and status.last_probe.ok, status.last_probe
    tunnelled = await probe_connect(
        VM_IP,
        port,
        USERNAME,
        PASSWORD,
        stack.origin.url,
        ssl_context=stack.origin.client_ssl_context,
    )
    assert tunnelled.ok, tunnelled
    rule = fake.firewall(firewall_name(INSTALLATION))
    assert rule is not None and rule["allowed"] == [{"IPProtocol": "tcp", "ports": [str(port)]}]

    await terminate(handle, fake, name, squid)
    assert [call.path.rsplit("/", 1)[-1] for call in fake.calls("delete")] == [name]


async def test_a_rate_limit_waits_about_a_minute(
    stack: ProviderStack, fake: FakeCompute, squid_upstreams: SquidUpstreams
) -> None:
    """API rate quotas refill per minute: no three-minute quota wait for them."""
    fake.inject_error("insert", "rate_limit", zone=ZONE)
    handle = await stack.start(PROVIDER, port=free_port())
    name = lifecycle_instance_name(handle.id, 0)
    await wait_status(
        handle, lambda s: "Rate Limit Exceeded" in (s.waiting_for or ""), "the rate-limit wait"
    )

    skipped = await skip_past_pending_timer(stack.env, handle)

    assert timedelta(seconds=30) < skipped <= timedelta(seconds=60)
    await wait_for(lambda: vm_status(fake, name) == "RUNNING", f"instance {name}")
    squid = await serve(fake, squid_upstreams, handle, name)
    await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    await terminate(handle, fake, name, squid)


async def test_a_vm_whose_startup_fails_is_replaced_and_the_reason_shown(
    stack: ProviderStack, fake: FakeCompute, squid_upstreams: SquidUpstreams
) -> None:
    handle = await stack.start(PROVIDER, port=free_port())
    first, second = lifecycle_instance_name(handle.id, 0), lifecycle_instance_name(handle.id, 1)
    await wait_for(lambda: vm_status(fake, first) == "RUNNING", f"{first} running")

    # The VM runs, but its startup script could not install Squid.
    fake.guest_write(
        ZONE,
        first,
        STARTUP_STATE_ATTRIBUTE,
        "failed: apt-get could not install squid in 5 attempts",
    )

    status = await wait_status(
        handle,
        lambda s: "apt-get could not install squid" in (s.last_error or ""),
        "the startup failure in status",
    )
    assert status.state in ("Provisioning", "Replacing")
    await wait_for(lambda: vm_status(fake, second) == "RUNNING", f"the replacement {second}")
    await wait_for(lambda: fake.instance(ZONE, first) is None, f"{first} deleted")

    squid = await serve(fake, squid_upstreams, handle, second)
    await wait_status(handle, lambda s: s.state == "Ready", "the replacement Ready")
    await terminate(handle, fake, second, squid)


async def serve_ready(
    fake: FakeCompute, squid_upstreams: SquidUpstreams, handle: WorkflowHandle[Any, Any], name: str
) -> LocalSquid:
    """Wait for the VM `name`, serve it, and wait for the proxy to be Ready on it."""
    await wait_for(lambda: vm_status(fake, name) == "RUNNING", f"{name} running")
    squid = await serve(fake, squid_upstreams, handle, name)
    await wait_status(handle, lambda s: s.state == "Ready" and s.instance == name, f"{name} Ready")
    return squid


async def test_preempted_spot_vms_are_replaced_without_spending_the_crash_budget(
    spot_stack: ProviderStack, fake: FakeCompute, squid_upstreams: SquidUpstreams
) -> None:
    """Issue 46: five preemptions within minutes leave the proxy Ready, counted apart;
    a VM that ends for no reason Compute Engine gives still spends the budget."""
    handle = await spot_stack.start(PROVIDER, port=free_port())
    for generation in range(CRASH_BUDGET):
        name = lifecycle_instance_name(handle.id, generation)
        squid = await serve_ready(fake, squid_upstreams, handle, name)
        fake.preempt(ZONE, name)
        await squid.terminate()
        replacing = await wait_status(
            handle, lambda s, n=generation + 1: s.disruptions == n, "the preemption counted"
        )
        assert replacing.failures_in_a_row == 0, replacing
        assert replacing.last_error is not None and "preempted" in replacing.last_error

    # A VM stopped by hand (no preemption recorded) is the proxy's loss: a crash.
    lost = lifecycle_instance_name(handle.id, CRASH_BUDGET)
    squid = await serve_ready(fake, squid_upstreams, handle, lost)
    fake.set_status(ZONE, lost, "TERMINATED")
    await squid.terminate()
    crashed = await wait_status(handle, lambda s: s.failures_in_a_row == 1, "the loss counted")
    assert crashed.disruptions == CRASH_BUDGET
    assert crashed.last_error is not None and "preempted" not in crashed.last_error

    last = lifecycle_instance_name(handle.id, CRASH_BUDGET + 1)
    squid = await serve_ready(fake, squid_upstreams, handle, last)
    ready = await status_of(handle)
    assert (ready.disruptions, ready.failures_in_a_row) == (CRASH_BUDGET, 1)
    await terminate(handle, fake, last, squid)
