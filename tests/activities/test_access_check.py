"""A failed probe has the GCP firewall rule checked again (issue 46, item 12).

A rule deleted by hand, or a port another writer's update dropped, leaves
healthy VMs unreachable: they fail their probes, and without a check the
proxy crash-loops through replacements whose creates trust the old check.
Here the provider talks to the fake Compute Engine through the real REST
clients, and the probe is the network's part only: a VM is reachable exactly
while a firewall rule of the fake admits its port (the VM itself is taken as
healthy, since the rule is what these tests are about).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.models import InstanceRef, MonitorInput, MonitorReason, ProbeInput
from activities.probe import TIMEOUT, ProbeResult
from activities.provider import InstanceProbe, ProbeRequest, ProviderActivities
from providers.base import CreateRequest
from providers.gcp import GcpConfig, GcpProvider, firewall_name
from providers.naming import instance_name, owner_tags
from tests.fakes.compute import DEFAULT_PROJECT, DEFAULT_ZONES, FakeCompute
from tests.helpers.config import build_config, local_entry

ZONE = DEFAULT_ZONES[0]
INSTALLATION = "test"
TARGET = "https://example.com/"


@pytest.fixture
def fake() -> Iterator[FakeCompute]:
    with FakeCompute(auto_start_ip="127.0.0.1") as server:
        yield server


def through_the_firewall(fake: FakeCompute) -> InstanceProbe:
    """The probe as the VPC network decides it: dropped (a timeout) unless a rule admits it."""

    async def probe(req: ProbeRequest) -> ProbeResult:
        if fake.admits(req.instance.port):
            return ProbeResult(ok=True, status_code=200, total_ms=1.0)
        return ProbeResult(ok=False, failure=TIMEOUT, error="no firewall rule admits the port")

    return probe


def setup(fake: FakeCompute, tmp_path: Path) -> tuple[ProviderActivities, InstanceRef]:
    """A Ready VM whose firewall rule is then deleted by hand."""
    config = build_config(local_entry(tmp_path), connect_ports=[443])
    provider = GcpProvider(
        GcpConfig(project=DEFAULT_PROJECT, zone=ZONE),
        config.installation,
        # The rule was checked a moment ago (by the create); in production
        # the VM boots for a minute or two before its first probe.
        firewall_doubt_seconds=0,
        **fake.clients(),
    )
    name = instance_name("access-owner", 0)
    proxy = config.proxy_settings()
    made = provider.create(
        CreateRequest(
            name=name,
            proxy=proxy,
            tags=owner_tags(config.installation, "access-owner", 0, namespace="default"),
        )
    )
    assert fake.admits(proxy.port)
    fake.delete_firewall(firewall_name(config.installation))
    assert not fake.admits(proxy.port)
    activities = ProviderActivities(
        {"gcp": provider},
        config,
        probe=through_the_firewall(fake),
    )
    ref = InstanceRef(
        "gcp",
        made.provider_id,
        name,
        0,
        ip="127.0.0.1",
        port=proxy.port,
        created_at=datetime.now(UTC).isoformat(),
    )
    return activities, ref


async def test_a_new_vm_whose_rule_was_deleted_passes_its_probe_once_it_is_back(
    fake: FakeCompute, tmp_path: Path
) -> None:
    activities, ref = setup(fake, tmp_path)
    try:
        summary = await ActivityEnvironment().run(
            activities.wait_healthy,
            ProbeInput(ref, TARGET, timeout_seconds=1, deadline_seconds=20),
        )
    finally:
        activities.close()

    assert summary.ok, summary
    assert fake.admits(ref.port)


async def test_a_ready_proxy_whose_rule_was_deleted_stays_healthy(
    fake: FakeCompute, tmp_path: Path
) -> None:
    activities, ref = setup(fake, tmp_path)
    try:
        outcome = await ActivityEnvironment().run(
            activities.monitor,
            MonitorInput(
                ref,
                TARGET,
                interval_seconds=0.2,
                failure_threshold=3,
                max_duration_seconds=3,
                probe_timeout_seconds=1,
            ),
        )
    finally:
        activities.close()

    # Put back after its first failed probe: the proxy was never unhealthy.
    assert outcome.reason is MonitorReason.ELAPSED, outcome
    assert outcome.last_probe is not None and outcome.last_probe.ok
    assert fake.admits(ref.port)
