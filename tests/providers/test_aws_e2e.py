"""Opt-in: AwsProvider against a real AWS account. Costs a few cents per run.

Launches one t3.micro proxy instance, waits until `get` says RUNNING, which
must mean its user data has reported Squid ready on the serial console (so a
probe passes at once), checks IMDSv2 is required and the volume carries its
tags, tunnels an HTTPS request through it, terminates it, and deletes the
security group it made. Skipped unless these are set (see docs/providers.md,
"AWS EC2"):

    PROXY_OPERATOR_E2E_AWS_REGION       e.g. eu-west-1
    PROXY_OPERATOR_E2E_AWS_SUBNET       a subnet of that region with a route to the internet
    PROXY_OPERATOR_E2E_AWS_CLIENT_CIDR  this machine's public egress, e.g. 203.0.113.7/32

Credentials come from the default AWS chain (AWS_PROFILE, the environment,
~/.aws), with the policy of docs/providers.md plus ec2:DeleteSecurityGroup
for the clean-up:

    pytest -m aws_e2e tests/providers/test_aws_e2e.py
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets

import boto3
import pytest
from botocore.exceptions import ClientError

from activities.probe import ProbeResult, probe_connect
from providers.aws import AwsProvider, group_name
from providers.base import CreateRequest, Instance, InstanceState
from providers.config import parse_config
from providers.errors import NotFound
from providers.naming import INSTALLATION_KEY, instance_name, owner_tags
from tests.helpers.waiting import until

REGION = os.environ.get("PROXY_OPERATOR_E2E_AWS_REGION", "")
SUBNET = os.environ.get("PROXY_OPERATOR_E2E_AWS_SUBNET", "")
CLIENT_CIDR = os.environ.get("PROXY_OPERATOR_E2E_AWS_CLIENT_CIDR", "")
TARGET = os.environ.get("PROXY_OPERATOR_E2E_AWS_TARGET", "https://aws.amazon.com/")

# Captured at import, before the suite's guard (tests/conftest.py) hides
# them for every test; only this test puts them back.
_AWS_ENV_NAMES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_EC2_METADATA_DISABLED",
)
_REAL_ENV = {name: os.environ.get(name) for name in _AWS_ENV_NAMES}

pytestmark = [
    pytest.mark.aws_e2e,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        not (REGION and SUBNET and CLIENT_CIDR),
        reason="set PROXY_OPERATOR_E2E_AWS_REGION, _SUBNET and _CLIENT_CIDR to run",
    ),
]


def test_proxy_instance_lifecycle_on_a_real_account(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _REAL_ENV.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)

    installation = f"e2e-{secrets.token_hex(4)}"
    owner = f"aws-e2e-{secrets.token_hex(4)}"
    password = secrets.token_urlsafe(24)
    config = parse_config(
        {
            "installation": installation,
            "proxy": {"auth": {"password_env": "E2E_PASSWORD"}, "allowed_cidrs": [CLIENT_CIDR]},
            "providers": [
                {"name": "aws-e2e", "type": "aws", "aws": {"region": REGION, "subnets": [SUBNET]}}
            ],
        },
        environ={"E2E_PASSWORD": password},
    )
    provider = AwsProvider.from_config(config.provider("aws-e2e"), config)
    ec2 = boto3.session.Session().client("ec2", region_name=REGION)
    settings = config.proxy_settings()
    req = CreateRequest(
        name=instance_name(owner, 1), proxy=settings, tags=owner_tags(installation, owner, 1)
    )
    created = provider.create(req)
    try:
        # The instance boots in seconds; its user data then installs Squid,
        # which takes minutes. `get` stays PROVISIONING meanwhile (or ends
        # TERMINATED with the script's reason).
        seen: list[Instance] = []

        def fetch() -> Instance:
            seen.append(provider.get(created.provider_id))
            return seen[-1]

        running = until(
            fetch, lambda i: i.state is not InstanceState.PROVISIONING, timeout=900, every=10
        )
        assert running.state is InstanceState.RUNNING, running
        assert running.ip and running.tags == req.tags
        assert any("user data" in i.reason for i in seen), seen
        assert req.name in {i.name for i in provider.list_by_tag(INSTALLATION_KEY, installation)}

        described = ec2.describe_instances(InstanceIds=[created.provider_id])
        instance = described["Reservations"][0]["Instances"][0]
        assert instance["MetadataOptions"]["HttpTokens"] == "required"
        volumes = ec2.describe_volumes(
            Filters=[{"Name": "attachment.instance-id", "Values": [created.provider_id]}]
        )["Volumes"]
        assert {t["Key"]: t["Value"] for t in volumes[0]["Tags"]}[INSTALLATION_KEY] == installation

        # RUNNING means Squid answers: the first probes pass, no boot to wait out.
        def probe() -> ProbeResult:
            return asyncio.run(
                probe_connect(
                    running.ip, running.port, settings.username, password, TARGET, timeout=10
                )
            )

        result = until(probe, lambda r: r.ok, timeout=60, every=5)
        assert result.ok, result
    finally:
        provider.delete(created.provider_id)
        gone = until(
            lambda: ec2.describe_instances(InstanceIds=[created.provider_id]),
            lambda d: d["Reservations"][0]["Instances"][0]["State"]["Name"] == "terminated",
            timeout=600,
            every=10,
        )
        assert gone["Reservations"][0]["Instances"][0]["State"]["Name"] == "terminated"
        # The provider never deletes its installation's group; this test's is throwaway.
        groups = ec2.describe_security_groups(
            Filters=[{"Name": "group-name", "Values": [group_name(installation)]}]
        )["SecurityGroups"]
        for group in groups:
            with contextlib.suppress(ClientError):
                ec2.delete_security_group(GroupId=group["GroupId"])

    with pytest.raises(NotFound):
        provider.get(created.provider_id)
