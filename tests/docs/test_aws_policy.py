"""The IAM policy in docs/providers.md names exactly the EC2 actions the provider calls.

The provider runs everything it can do against the EC2 fake (launch, the
security group created and a hand-made rule revoked, readiness, listing,
terminate), and the actions the fake received are compared with the
policy's: one missing is a worker refused in production, one extra is more
than the worker needs.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from providers.aws import AwsConfig, AwsProvider, group_name
from providers.aws.security_group import PORT_GRACE_SECONDS
from providers.base import CreateRequest
from providers.naming import INSTALLATION_KEY, instance_name, owner_tags
from squid.conf import ProxySettings
from tests.fakes.ec2 import REGION, FakeEc2
from tests.fakes.ec2 import fake_ec2_fixture as fake_ec2_fixture

DOC = Path(__file__).resolve().parents[2] / "docs" / "providers.md"
MARKER = "<!-- aws-iam-policy -->"
INSTALLATION = "prod"


def documented_policy() -> dict[str, Any]:
    text = DOC.read_text()
    found = re.search(re.escape(MARKER) + r"\s*```json\n(?P<json>.*?)\n```", text, re.DOTALL)
    assert found is not None, f"no ```json block after {MARKER} in {DOC}"
    policy: dict[str, Any] = json.loads(found["json"])
    return policy


def actions_of(policy: dict[str, Any]) -> set[str]:
    found: set[str] = set()
    for statement in policy["Statement"]:
        action = statement["Action"]
        found.update([action] if isinstance(action, str) else action)
    return found


def request(owner: str, port: int) -> CreateRequest:
    return CreateRequest(
        name=instance_name(owner, 0, installation=INSTALLATION, namespace="default"),
        proxy=ProxySettings(port, "proxy", "p" * 20, ("192.0.2.0/24",), (443,)),
        tags=owner_tags(INSTALLATION, owner, 0, namespace="default"),
    )


def test_the_policy_is_valid_and_scopes_writes_to_the_installation() -> None:
    policy = documented_policy()
    assert policy["Version"] == "2012-10-17"
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow"
        assert statement["Resource"] == "*" or statement["Action"] == "ec2:RunInstances"
    [scoped] = [s for s in policy["Statement"] if s["Sid"] == "TheInstallationsOwn"]
    condition = scoped["Condition"]["StringEquals"]
    assert condition == {f"aws:ResourceTag/{INSTALLATION_KEY}": INSTALLATION}
    assert "ec2:TerminateInstances" in scoped["Action"]


def test_the_policy_lists_exactly_the_actions_the_provider_calls(fake_ec2: FakeEc2) -> None:
    settings = AwsConfig(region=REGION, subnets=[fake_ec2.subnets()[0][0]])
    provider = AwsProvider(settings, INSTALLATION, ec2=fake_ec2.client(), console_interval=0)
    created = provider.create(request("first", 3128))
    fake_ec2.report(created.provider_id, "ready")
    provider.get(created.provider_id)
    # A rule added by hand, which the next create revokes.
    fake_ec2.open_by_hand(group_name(INSTALLATION), 22, "0.0.0.0/0")
    # A worker past the grace: the first proxy's port, unused, is dropped (DeleteTags).
    again = AwsProvider(
        settings,
        INSTALLATION,
        ec2=fake_ec2.client(),
        console_interval=0,
        clock=lambda: time.time() + 2 * PORT_GRACE_SECONDS,
    )
    again.list_by_tag(INSTALLATION_KEY, INSTALLATION)
    again.delete(created.provider_id)
    again.create(request("second", 8080))

    called = {f"ec2:{c.action}" for c in fake_ec2.calls()}

    assert actions_of(documented_policy()) == called


def test_runinstances_is_allowed_only_tagged_of_the_listed_types_with_imdsv2(
    fake_ec2: FakeEc2,
) -> None:
    """What the conditions ask is what the provider's launch sends."""
    statements = {s["Sid"]: s for s in documented_policy()["Statement"]}
    instance = statements["LaunchTaggedInstances"]
    volume = statements["LaunchTaggedVolumes"]
    condition = instance["Condition"]["StringEquals"]
    settings = AwsConfig(region=REGION, subnets=[fake_ec2.subnets()[0][0]])
    provider = AwsProvider(settings, INSTALLATION, ec2=fake_ec2.client(), console_interval=0)
    provider.create(request("first", 3128))
    sent = fake_ec2.calls("RunInstances")[-1].params
    tagged = {
        (sent[f"TagSpecification.{n}.ResourceType"], sent[f"TagSpecification.{n}.Tag.{t}.Value"])
        for n in (1, 2)
        for t in range(1, 20)
        if sent.get(f"TagSpecification.{n}.Tag.{t}.Key") == INSTALLATION_KEY
    }

    assert instance["Resource"] == "arn:aws:ec2:*:*:instance/*"
    assert volume["Resource"] == "arn:aws:ec2:*:*:volume/*"
    assert condition == {
        f"aws:RequestTag/{INSTALLATION_KEY}": INSTALLATION,
        "ec2:InstanceType": settings.instance_type,
        "ec2:MetadataHttpTokens": "required",
    }
    assert volume["Condition"]["StringEquals"] == {
        f"aws:RequestTag/{INSTALLATION_KEY}": INSTALLATION
    }
    assert tagged == {("instance", INSTALLATION), ("volume", INSTALLATION)}
    assert sent["InstanceType"] == settings.instance_type[0]
    assert sent["MetadataOptions.HttpTokens"] == "required"
