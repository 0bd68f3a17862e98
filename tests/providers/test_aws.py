"""AwsProvider against moto's EC2 in server mode, through the real boto3 client.

What moto does not model (client-token idempotency, the serial console the
user data reports on, capacity and throttling errors, spot interruptions)
comes from the layer in front of it, tests/fakes/ec2.py (docs/fakes.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest

from providers.aws import NAME_TAG, STATE_MARKER, AwsConfig, AwsProvider, group_name
from providers.aws.provider import PROVIDER_TYPE
from providers.aws.security_group import PORT_GRACE_SECONDS, PORTS_TAG
from providers.aws.user_data import (
    SPOT_WATCH,
    console_report,
    htpasswd_salt,
    interruption_notice,
    user_data,
)
from providers.base import Advice, CreateRequest, Disruption, Instance, InstanceState
from providers.config import ConfigError, parse_config
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded, Transient
from providers.naming import INSTALLATION_KEY, OWNER_KEY, instance_name, owner_tags
from squid import conf as squid_conf
from squid.conf import ProxySettings
from squid.htpasswd import SHA512_CRYPT_ROUNDS, sha512_crypt
from tests.fakes.ec2 import DEBIAN_IMAGES, NEWEST_DEBIAN_12, REGION, FakeEc2
from tests.fakes.ec2 import fake_ec2_fixture as fake_ec2_fixture

INSTALLATION = "prod-eu"
PASSWORD = "correct horse battery staple"
CIDRS = ("192.0.2.0/24", "10.0.0.0/8")
NAMESPACE = "default"


def proxy_settings(port: int = 3128, cidrs: tuple[str, ...] = CIDRS) -> ProxySettings:
    return ProxySettings(
        port=port,
        username="proxy",
        password=PASSWORD,
        allowed_cidrs=cidrs,
        allowed_connect_ports=(443,),
    )


def make_request(
    owner: str = "proxy-eu-1",
    *,
    generation: int = 1,
    subnet: str | None = None,
    port: int = 3128,
    installation: str = INSTALLATION,
    labels: dict[str, str] | None = None,
) -> CreateRequest:
    return CreateRequest(
        name=instance_name(owner, generation, installation=installation, namespace=NAMESPACE),
        proxy=proxy_settings(port),
        tags=owner_tags(installation, owner, generation, labels, namespace=NAMESPACE),
        placement={"subnet": subnet} if subnet else {},
    )


def subnet_ids(fake: FakeEc2, count: int = 2) -> list[str]:
    return [subnet for subnet, _ in fake.subnets()[:count]]


def make_provider(
    fake: FakeEc2,
    subnets: int = 1,
    *,
    consistency_window: float = 300.0,
    clock: Callable[[], float] = time.time,
    advice_interval: float = 0,
    **settings: Any,
) -> AwsProvider:
    config = AwsConfig(region=REGION, subnets=subnet_ids(fake, subnets), **settings)
    # Every `get` asks the console: tests step through it without pacing.
    return AwsProvider(
        config,
        INSTALLATION,
        ec2=fake.client(),
        console_interval=0,
        advice_interval=advice_interval,
        consistency_window=consistency_window,
        clock=clock,
    )


@pytest.fixture
def provider(fake_ec2: FakeEc2) -> AwsProvider:
    return make_provider(fake_ec2)


def live(fake: FakeEc2) -> list[Any]:
    return [i for i in fake.instances() if i.state != "terminated"]


def run_param(fake: FakeEc2, key: str) -> str:
    return fake.calls("RunInstances")[-1].params[key]


# -- create, ready, delete -------------------------------------------------------


def test_create_is_provisioning_until_the_user_data_reports_squid_ready(
    fake_ec2: FakeEc2, provider: AwsProvider
) -> None:
    req = make_request(labels={"team": "crawl"})

    created = provider.create(req)

    assert created.state is InstanceState.PROVISIONING and created.ip == ""
    assert created.tags == req.tags  # round-trips, the provider's own tags left out
    assert (created.name, created.port) == (req.name, 3128)
    ec2 = fake_ec2.instance(created.provider_id)
    assert ec2.image_id == NEWEST_DEBIAN_12  # the newest Debian 12, not 11, not older
    assert ec2.instance_type == "t3.micro"
    assert ec2.get_tags() and {t["key"]: t["value"] for t in ec2.get_tags()}[NAME_TAG] == req.name
    options = ec2.metadata_options
    assert (options.http_tokens, options.http_put_response_hop_limit) == ("required", 1)
    assert ec2.lifecycle is None  # on-demand
    assert run_param(fake_ec2, "ClientToken") == req.name
    script = fake_ec2.user_data(created.provider_id)
    assert script.startswith("#!/bin/bash") and PASSWORD not in script
    assert "auth_param basic program" in script and "http_port 3128" in script

    waiting = provider.get(created.provider_id)
    assert waiting.state is InstanceState.PROVISIONING
    assert "waiting for its user data to start Squid (booting)" in waiting.reason
    fake_ec2.report(created.provider_id, "installing")
    assert "(installing)" in provider.get(created.provider_id).reason

    fake_ec2.report(created.provider_id, "ready")
    ready = provider.get(created.provider_id)

    assert ready.state is InstanceState.RUNNING
    assert ready.ip == ec2.public_ip and ready.endpoint == f"{ec2.public_ip}:3128"
    assert ready.exit_address == ec2.public_ip  # requests leave from the public IP
    assert waiting.exit_address == ec2.public_ip  # known before Squid is ready

    provider.delete(created.provider_id)
    assert fake_ec2.instance(created.provider_id).state == "terminated"
    provider.delete(created.provider_id)  # already gone: success
    with pytest.raises(NotFound, match="is terminated"):
        provider.get(created.provider_id)  # listed for an hour, but gone for good
    assert provider.list_by_tag(INSTALLATION_KEY, INSTALLATION) == []


def test_a_failure_the_user_data_reports_ends_the_instance_with_its_reason(
    fake_ec2: FakeEc2, provider: AwsProvider
) -> None:
    created = provider.create(make_request())
    fake_ec2.console_write(created.provider_id, "[   12.3] cloud-init[612]: noise\x1b[0m")
    fake_ec2.report(created.provider_id, "failed: apt-get could not install squid in 5 attempts")

    ended = provider.get(created.provider_id)

    assert ended.state is InstanceState.TERMINATED and ended.ip == ""
    assert ended.reason == "user data failed: apt-get could not install squid in 5 attempts"


def test_a_slow_boot_stays_provisioning_until_its_report() -> None:
    with FakeEc2(ready_after_polls=3) as fake:
        provider = make_provider(fake)
        created = provider.create(make_request())  # pending: the console is not asked
        states = [provider.get(created.provider_id).state for _ in range(4)]

    assert created.state is InstanceState.PROVISIONING
    assert states == [InstanceState.PROVISIONING] * 3 + [InstanceState.RUNNING]


def test_the_user_data_is_valid_bash_and_reports_on_the_console(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2)
    created = provider.create(make_request())
    script = fake_ec2.user_data(created.provider_id)
    bash = shutil.which("bash") or "/bin/bash"

    subprocess.run([bash, "-n"], input=script, text=True, check=True)

    assert f'echo "{STATE_MARKER} $1" > /dev/console' in script
    assert "@" + "READY@" not in script  # every placeholder filled


# -- ownership: delete and adopt -----------------------------------------------------


def launch_by_hand(fake: FakeEc2, tags: dict[str, str], name: str) -> str:
    """An instance somebody made without this provider, carrying `tags` and `name`."""
    client = fake.client()
    answer = client.run_instances(
        ImageId=NEWEST_DEBIAN_12,
        MinCount=1,
        MaxCount=1,
        InstanceType="t3.micro",
        TagSpecifications=[
            {
                "ResourceType": "instance",
                "Tags": [{"Key": k, "Value": v} for k, v in {**tags, NAME_TAG: name}.items()],
            }
        ],
    )
    instance_id: str = answer["Instances"][0]["InstanceId"]
    return instance_id


def test_delete_refuses_an_instance_of_another_installation(
    fake_ec2: FakeEc2, provider: AwsProvider
) -> None:
    theirs = launch_by_hand(fake_ec2, owner_tags("other", "x", 1), "proxy-theirs")
    by_hand = launch_by_hand(fake_ec2, {"team": "web"}, "web-1")

    for instance_id in (theirs, by_hand):
        with pytest.raises(Permanent, match="refused, not managed by this installation"):
            provider.delete(instance_id)

    assert {i.state for i in fake_ec2.instances()} == {"running"}


def test_create_adopts_its_own_instance_and_refuses_somebody_elses_of_that_name(
    fake_ec2: FakeEc2, provider: AwsProvider
) -> None:
    req = make_request()
    first = provider.create(req)

    again = provider.create(req)  # a retried create

    assert again.provider_id == first.provider_id and len(live(fake_ec2)) == 1
    assert len(fake_ec2.calls("RunInstances")) == 1

    other = make_request("another-owner")
    launch_by_hand(fake_ec2, owner_tags(INSTALLATION, "x", 1), other.name)
    with pytest.raises(Permanent, match=r"exists \(i-[0-9a-f]+\) and is not this proxy's"):
        provider.create(other)


def test_a_client_token_launches_once(fake_ec2: FakeEc2) -> None:
    """EC2's idempotency as the fake models it: same token, same answer."""
    client = fake_ec2.client()
    params: dict[str, Any] = {
        "ImageId": NEWEST_DEBIAN_12,
        "MinCount": 1,
        "MaxCount": 1,
        "ClientToken": "proxy-abc",
    }
    first = client.run_instances(**params)["Instances"][0]["InstanceId"]
    second = client.run_instances(**params)["Instances"][0]["InstanceId"]
    assert first == second and len(fake_ec2.instances()) == 1
    with pytest.raises(client.exceptions.ClientError, match="IdempotentParameterMismatch"):
        client.run_instances(**{**params, "InstanceType": "t3.large"})


def test_a_create_whose_token_already_launched_elsewhere_adopts_that_instance(
    fake_ec2: FakeEc2,
) -> None:
    """An earlier attempt launched with the token, but is not found by name (yet).

    RunInstances with the same token and other parameters (another subnet)
    answers IdempotentParameterMismatch; the instance the token made is
    looked up by token and adopted, never launched twice.
    """
    provider = make_provider(fake_ec2)
    req = make_request()
    client = fake_ec2.client()
    client.run_instances(
        ImageId=NEWEST_DEBIAN_12,
        MinCount=1,
        MaxCount=1,
        ClientToken=req.name,
        SubnetId=subnet_ids(fake_ec2, 2)[1],
        TagSpecifications=[
            {
                "ResourceType": "instance",
                "Tags": [{"Key": k, "Value": v} for k, v in req.tags.items()],
            }
        ],
    )
    [earlier] = fake_ec2.instances()

    adopted = provider.create(req)

    assert adopted.provider_id == earlier.id and len(fake_ec2.instances()) == 1


# -- placement: subnets and zones ----------------------------------------------------


def test_instances_spread_over_the_subnets_and_a_full_zone_falls_back(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2, subnets=2)
    (subnet_a, zone_a), (subnet_b, zone_b) = fake_ec2.subnets()[:2]

    made = [provider.create(make_request(f"owner-{i}")) for i in range(8)]

    zones = {fake_ec2.instance(i.provider_id).placement.zone for i in made}
    assert zones == {zone_a, zone_b}

    fake_ec2.inject_error("RunInstances", "capacity", subnet=subnet_a, times=None)
    landed = [provider.create(make_request(f"later-{i}")) for i in range(4)]
    assert {fake_ec2.instance(i.provider_id).subnet_id for i in landed} == {subnet_b}

    pinned = make_request("pinned", subnet=subnet_a)
    with pytest.raises(QuotaExceeded, match="InsufficientInstanceCapacity"):
        provider.create(pinned)  # pinned to the full zone: no fallback


def test_placement_outside_the_configured_subnets_is_refused(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2)
    stranger = fake_ec2.subnets()[2][0]
    with pytest.raises(
        Permanent, match=r"placement\.subnet: 'subnet-[0-9a-f]+' is not one of this provider"
    ):
        provider.create(make_request(subnet=stranger))
    assert fake_ec2.calls("RunInstances") == []


# -- spot ----------------------------------------------------------------------------


def test_a_spot_interruption_ends_the_instance_as_lost(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2, market="spot", max_price="0.0050")
    created = provider.create(make_request())
    assert run_param(fake_ec2, "InstanceMarketOptions.MarketType") == "spot"
    assert run_param(fake_ec2, "InstanceMarketOptions.SpotOptions.MaxPrice") == "0.0050"
    assert fake_ec2.instance(created.provider_id).lifecycle == "spot"
    fake_ec2.report(created.provider_id, "ready")
    assert provider.get(created.provider_id).state is InstanceState.RUNNING

    fake_ec2.interrupt_spot(created.provider_id, state="shutting-down")

    lost = provider.get(created.provider_id)
    assert lost.state is InstanceState.TERMINATED and lost.endpoint == ""
    assert lost.exit_address is None
    assert lost.reason.startswith("spot interruption: Server.SpotInstanceTermination")
    assert lost.disruption is Disruption.SPOT_INTERRUPTED  # replaced, no crash counted

    fake_ec2.interrupt_spot(created.provider_id, state="terminated")
    with pytest.raises(NotFound, match="terminated: spot interruption") as gone:
        provider.get(created.provider_id)
    assert gone.value.disruption is Disruption.SPOT_INTERRUPTED


def test_a_spot_interruption_notice_ends_the_instance_before_ec2_does(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2, market="spot")
    created = provider.create(make_request())
    fake_ec2.report(created.provider_id, "ready")
    assert provider.get(created.provider_id).state is InstanceState.RUNNING

    fake_ec2.notify_spot_interruption(created.provider_id, when="2026-12-02T18:30:00Z")
    noticed = provider.get(created.provider_id)
    # A line the instance writes after it hides nothing: the notice is final.
    fake_ec2.console_write(created.provider_id, "\x00\x1b[2J garbage \ufffd")
    fake_ec2.report(created.provider_id, "\x07\x01 not a state")
    fake_ec2.report(created.provider_id, "ready")
    still = provider.get(created.provider_id)

    for lost in (noticed, still):
        assert lost.state is InstanceState.TERMINATED and lost.endpoint == ""
        assert lost.exit_address is None
        assert lost.reason == "spot interruption notice: terminate at 2026-12-02T18:30:00Z"
        assert lost.disruption is Disruption.SPOT_INTERRUPTED
    assert fake_ec2.instance(created.provider_id).state == "running"  # EC2 has not acted yet


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (
            "interrupted stop 2026-12-02T18:30:00Z",
            "spot interruption notice: stop at 2026-12-02T18:30:00Z",
        ),
        ("interrupted", "spot interruption notice: unknown at unknown"),
        ("interrupted \x1b[31m x", "spot interruption notice: ?[31m at x"),
        ("ready", None),
        ("failed: interrupted", None),
        ("interruptedly", None),
    ],
)
def test_the_notice_line_is_parsed_strictly(line: str, reason: str | None) -> None:
    assert interruption_notice(line) == reason


def test_the_latest_notice_wins_over_any_line_after_it() -> None:
    console = "\n".join(
        [
            f"{STATE_MARKER} installing",
            f"{STATE_MARKER} ready",
            f"{STATE_MARKER} interrupted terminate 2026-12-02T18:30:00Z",
            "[  12.3] kernel: garbage",
            f"{STATE_MARKER} ready",
            f"{STATE_MARKER} \x00",
        ]
    )
    assert console_report(console).state == "interrupted terminate 2026-12-02T18:30:00Z"
    assert console_report(f"{STATE_MARKER} ready\n{STATE_MARKER} installing").state == "installing"


def test_an_on_demand_instance_gets_no_notice_and_no_watcher(
    fake_ec2: FakeEc2, provider: AwsProvider
) -> None:
    created = provider.create(make_request())
    fake_ec2.report(created.provider_id, "ready")

    with pytest.raises(ValueError, match="not a spot instance"):
        fake_ec2.notify_spot_interruption(created.provider_id)
    assert "spot/instance-action" not in fake_ec2.user_data(created.provider_id)
    assert provider.get(created.provider_id).state is InstanceState.RUNNING


def test_a_rebalance_recommendation_advises_replacing_a_spot_instance_that_still_serves(
    fake_ec2: FakeEc2,
) -> None:
    provider = make_provider(fake_ec2, market="spot")
    created = provider.create(make_request())
    fake_ec2.report(created.provider_id, "ready")
    assert provider.replacement_advised(created.provider_id) is None

    fake_ec2.recommend_rebalance(created.provider_id)

    assert provider.replacement_advised(created.provider_id) == "EC2 rebalance recommendation"
    serving = provider.get(created.provider_id)  # Squid serves on until its replacement
    assert serving.state is InstanceState.RUNNING and serving.endpoint
    fake_ec2.notify_spot_interruption(created.provider_id)
    assert provider.get(created.provider_id).disruption is Disruption.SPOT_INTERRUPTED


def test_the_console_is_read_for_advice_at_most_every_advice_interval(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2, market="spot", advice_interval=3600)
    created = provider.create(make_request())
    fake_ec2.report(created.provider_id, "ready")
    assert provider.replacement_advised(created.provider_id) is None
    reads = len(fake_ec2.calls("GetConsoleOutput"))

    fake_ec2.recommend_rebalance(created.provider_id)

    assert provider.replacement_advised(created.provider_id) is None  # not read again yet
    assert len(fake_ec2.calls("GetConsoleOutput")) == reads


def test_an_on_demand_instance_is_never_advised_and_its_console_not_read_for_it(
    fake_ec2: FakeEc2, provider: AwsProvider
) -> None:
    created = provider.create(make_request())

    assert provider.replacement_advised(created.provider_id) is None
    assert fake_ec2.calls("GetConsoleOutput") == []
    with pytest.raises(ValueError, match="not a spot instance"):
        fake_ec2.recommend_rebalance(created.provider_id)


def ready_instances(fake: FakeEc2, provider: AwsProvider, *owners: str) -> dict[str, Instance]:
    """An instance per owner, created by `provider` and reported ready: by owner."""
    made = {}
    for owner in owners:
        created = provider.create(make_request(owner))
        fake.report(created.provider_id, "ready")
        made[owner] = provider.get(created.provider_id)
    return made


def test_a_pool_is_advised_about_its_spot_members_by_owner_and_endpoint(
    fake_ec2: FakeEc2,
) -> None:
    provider = make_provider(fake_ec2, market="spot")
    made = ready_instances(fake_ec2, provider, "pool/0", "pool/1", "pool/2")
    fake_ec2.recommend_rebalance(made["pool/0"].provider_id)
    fake_ec2.recommend_rebalance(made["pool/2"].provider_id)

    advised = provider.replacements_advised(
        {
            "pool/0": made["pool/0"].endpoint,
            "pool/1": made["pool/1"].endpoint,
            # Not the endpoint its instance serves on: no word about that instance.
            "pool/2": "192.0.2.9:3128",
        }
    )

    assert advised == {"pool/0": Advice(made["pool/0"].provider_id, "EC2 rebalance recommendation")}
    assert len(fake_ec2.calls("DescribeInstances")) > 0
    listing = fake_ec2.calls("DescribeInstances")[-1].params
    assert "instance-lifecycle" in listing.values() and "spot" in listing.values()


def test_a_pool_s_advice_lists_and_reads_each_console_at_most_every_advice_interval(
    fake_ec2: FakeEc2,
) -> None:
    provider = make_provider(fake_ec2, market="spot", advice_interval=3600)
    made = ready_instances(fake_ec2, provider, "pool/0", "pool/1")
    serving = {owner: instance.endpoint for owner, instance in made.items()}
    lists, reads = len(fake_ec2.calls("DescribeInstances")), len(fake_ec2.calls("GetConsoleOutput"))

    for _ in range(5):
        provider.replacements_advised(serving)

    assert len(fake_ec2.calls("DescribeInstances")) == lists + 1  # one listing, shared
    # Each console at most once in the interval (its first read at a random point in it).
    assert len(fake_ec2.calls("GetConsoleOutput")) - reads <= len(made)


def test_an_on_demand_member_is_never_asked_about(fake_ec2: FakeEc2) -> None:
    on_demand = make_provider(fake_ec2)
    made = ready_instances(fake_ec2, on_demand, "pool/0")
    serving = {"pool/0": made["pool/0"].endpoint}
    calls, reads = len(fake_ec2.calls()), len(fake_ec2.calls("GetConsoleOutput"))

    assert on_demand.replacements_advised(serving) == {}
    assert len(fake_ec2.calls()) == calls  # not a call made
    # A spot entry of the installation asked about it (by mistake) reads no console either.
    assert make_provider(fake_ec2, market="spot").replacements_advised(serving) == {}
    assert len(fake_ec2.calls("GetConsoleOutput")) == reads


def test_only_a_spot_instance_is_interrupted(fake_ec2: FakeEc2, provider: AwsProvider) -> None:
    created = provider.create(make_request())
    with pytest.raises(ValueError, match="not a spot instance"):
        fake_ec2.interrupt_spot(created.provider_id)


# -- the security group ----------------------------------------------------------------


def group_of(fake: FakeEc2) -> dict[str, Any]:
    [group] = fake.client().describe_security_groups(
        Filters=[{"Name": "group-name", "Values": [group_name(INSTALLATION)]}]
    )["SecurityGroups"]
    return dict(group)


def ingress(group: dict[str, Any]) -> set[tuple[str, int, str]]:
    return {
        (p["IpProtocol"], p.get("FromPort", -1), r.get("CidrIp") or r.get("CidrIpv6"))
        for p in group["IpPermissions"]
        for r in [*p.get("IpRanges", []), *p.get("Ipv6Ranges", [])]
    }


ANYONE = "0.0.0.0/0"


def test_the_security_group_admits_the_proxy_ports_from_allowed_cidrs_only(
    fake_ec2: FakeEc2,
) -> None:
    created = make_provider(fake_ec2).create(make_request(port=3128))
    group = group_of(fake_ec2)
    [reservation] = fake_ec2.client().describe_instances(InstanceIds=[created.provider_id])[
        "Reservations"
    ]
    [interface] = reservation["Instances"][0]["NetworkInterfaces"]
    assert [g["GroupId"] for g in interface["Groups"]] == [group["GroupId"]]
    assert ingress(group) == {("tcp", 3128, cidr) for cidr in CIDRS}
    fake_ec2.open_by_hand(group_name(INSTALLATION), 22, ANYONE)

    make_provider(fake_ec2).create(make_request("second", port=8080))  # a new provider object

    # The widened rule is put back; the first proxy's port stays open.
    assert ingress(group_of(fake_ec2)) == {("tcp", p, c) for p in (3128, 8080) for c in CIDRS}


@dataclass
class Clock:
    """The workers' wall clock, moved on by the test."""

    now: float = field(default_factory=time.time)

    def __call__(self) -> float:
        return self.now


def proxy_ports(fake: FakeEc2) -> set[int]:
    return {port for _, port, _ in ingress(group_of(fake))}


def group_tags(fake: FakeEc2) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in group_of(fake).get("Tags", [])}


def test_a_port_no_instance_listens_on_is_revoked_once_unasked_for_the_grace(
    fake_ec2: FakeEc2,
) -> None:
    clock = Clock()
    before = make_provider(fake_ec2, clock=clock)  # the worker's config said 8080
    old = before.create(make_request("old-port", port=8080))
    before.delete(old.provider_id)
    after = make_provider(fake_ec2, clock=clock)  # restarted with 3128

    clock.now += PORT_GRACE_SECONDS / 2
    after.create(make_request("first", port=3128))
    assert proxy_ports(fake_ec2) == {3128, 8080}  # another worker may still launch on it

    clock.now += PORT_GRACE_SECONDS
    after.create(make_request("second", port=3128))

    assert ingress(group_of(fake_ec2)) == {("tcp", 3128, cidr) for cidr in CIDRS}
    tags = group_tags(fake_ec2)
    assert tags[PORTS_TAG] == "3128"
    assert not [key for key in tags if key.endswith("/8080")]


def test_a_port_an_instance_listens_on_stays_open_past_the_grace(fake_ec2: FakeEc2) -> None:
    clock = Clock()
    make_provider(fake_ec2, clock=clock).create(make_request("old-port", port=8080))

    clock.now += 2 * PORT_GRACE_SECONDS
    make_provider(fake_ec2, clock=clock).create(make_request("new-port", port=3128))

    assert proxy_ports(fake_ec2) == {3128, 8080}
    assert group_tags(fake_ec2)[PORTS_TAG] == "3128,8080"


def test_an_instance_in_another_entrys_group_opens_no_port_here(fake_ec2: FakeEc2) -> None:
    clock = Clock()
    other = make_provider(fake_ec2, clock=clock, security_group="entry-b-group")
    other.create(make_request("entry-b", port=8080))

    make_provider(fake_ec2, clock=clock).create(make_request("entry-a", port=3128))

    assert proxy_ports(fake_ec2) == {3128}


def test_a_port_another_worker_just_asked_for_stays_open_before_ec2_lists_its_instance() -> None:
    with FakeEc2(instance_lag=3) as fake:
        clock = Clock()
        make_provider(fake, clock=clock).create(make_request("old-port", port=8080))

        # Another worker, whose listing does not show that instance yet.
        make_provider(fake, clock=clock).create(make_request("new-port", port=3128))

        assert proxy_ports(fake) == {3128, 8080}


def test_ports_an_older_worker_recorded_get_the_grace_and_stay_readable_to_it(
    fake_ec2: FakeEc2,
) -> None:
    clock = Clock()
    provider = make_provider(fake_ec2, clock=clock)
    provider.create(make_request("first", port=3128))
    group_id = group_of(fake_ec2)["GroupId"]
    # What a worker without timestamps leaves: the list, and the rules.
    fake_ec2.client().create_tags(
        Resources=[group_id], Tags=[{"Key": PORTS_TAG, "Value": "3128,8080"}]
    )
    fake_ec2.client().authorize_security_group_ingress(
        GroupId=group_id,
        IpPermissions=[
            {"IpProtocol": "tcp", "FromPort": 8080, "ToPort": 8080, "IpRanges": [{"CidrIp": c}]}
            for c in CIDRS
        ],
    )

    clock.now += PORT_GRACE_SECONDS / 2
    provider.create(make_request("second", port=3128))
    listed = group_tags(fake_ec2)[PORTS_TAG]
    assert 8080 in proxy_ports(fake_ec2) and listed == "3128,8080"  # an older worker's format

    clock.now += PORT_GRACE_SECONDS
    provider.create(make_request("third", port=3128))

    assert proxy_ports(fake_ec2) == {3128} and group_tags(fake_ec2)[PORTS_TAG] == "3128"


def test_a_security_group_of_that_name_that_is_not_ours_is_refused(fake_ec2: FakeEc2) -> None:
    vpc = fake_ec2.client().describe_subnets(SubnetIds=subnet_ids(fake_ec2, 1))["Subnets"][0]
    fake_ec2.client().create_security_group(
        GroupName=group_name(INSTALLATION), Description="web servers", VpcId=vpc["VpcId"]
    )
    with pytest.raises(Permanent, match="is not this installation's"):
        make_provider(fake_ec2).create(make_request())
    assert fake_ec2.calls("RunInstances") == []


# -- listing ---------------------------------------------------------------------------


def test_list_by_tag_matches_exactly_not_as_a_wildcard(
    fake_ec2: FakeEc2, provider: AwsProvider
) -> None:
    ours = provider.create(make_request("crawler-1"))
    provider.create(make_request("crawler-2"))

    assert [i.provider_id for i in provider.list_by_tag(OWNER_KEY, "crawler-1")] == [
        ours.provider_id
    ]
    assert provider.list_by_tag(OWNER_KEY, "crawler-*") == []  # EC2 filters take wildcards
    assert len(provider.list_by_tag(INSTALLATION_KEY, INSTALLATION)) == 2


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "kind", "expected"),
    [
        ("RunInstances", "capacity", QuotaExceeded),
        ("RunInstances", "instance_limit", QuotaExceeded),
        ("RunInstances", "vcpu_limit", QuotaExceeded),
        ("RunInstances", "throttled", Transient),
        ("RunInstances", "unauthorized", Permanent),
        ("RunInstances", "auth_failure", Permanent),
        ("RunInstances", "internal", Transient),
        ("DescribeInstances", "throttled", Transient),
        ("CreateSecurityGroup", "unauthorized", Permanent),
    ],
)
def test_ec2_errors_map_onto_the_taxonomy(
    fake_ec2: FakeEc2,
    provider: AwsProvider,
    action: str,
    kind: str,
    expected: type[ProviderError],
) -> None:
    fake_ec2.inject_error(action, kind)

    with pytest.raises(expected) as caught:
        provider.create(make_request())

    assert type(caught.value) is expected
    assert caught.value.cause is not None  # the SDK's error is kept


def test_errors_of_get_and_delete(fake_ec2: FakeEc2, provider: AwsProvider) -> None:
    # An id EC2 does not list may be one it does not show yet: gone only
    # once the consistency window since it was first missed has passed.
    with pytest.raises(Transient, match="is not listed yet"):
        provider.get("i-0123456789abcdef0")
    with pytest.raises(Transient, match="is not listed yet"):
        provider.delete("i-0123456789abcdef0")
    past_the_window = make_provider(fake_ec2, consistency_window=0)
    with pytest.raises(NotFound):
        past_the_window.get("i-0123456789abcdef0")
    past_the_window.delete("i-0123456789abcdef0")  # gone already: success
    with pytest.raises(Permanent, match="malformed AWS provider_id"):
        provider.get("i-../../x")
    created = provider.create(make_request())
    fake_ec2.inject_error("GetConsoleOutput", "throttled")
    with pytest.raises(Transient, match="RequestLimitExceeded"):
        provider.get(created.provider_id)
    fake_ec2.inject_error("TerminateInstances", "unauthorized")
    with pytest.raises(Permanent, match="UnauthorizedOperation"):
        provider.delete(created.provider_id)


def test_a_create_with_tags_ec2_would_refuse_fails_naming_the_tag(provider: AwsProvider) -> None:
    req = make_request(labels={"note": "x" * 300})
    with pytest.raises(Permanent, match="tag 'label/note': value longer than 256"):
        provider.create(req)
    foreign = make_request(installation="other")
    with pytest.raises(Permanent, match=f"tag {INSTALLATION_KEY} must be 'prod-eu'"):
        provider.create(foreign)


def test_no_credentials_is_permanent(fake_ec2: FakeEc2) -> None:
    """The suite hides every credential (tests/conftest.py): what a worker without any sees."""
    bare = boto3.session.Session(region_name=REGION).client("ec2", endpoint_url=fake_ec2.url)
    settings = AwsConfig(region=REGION, subnets=subnet_ids(fake_ec2, 1))
    provider = AwsProvider(settings, INSTALLATION, ec2=bare)
    with pytest.raises(Permanent, match="AWS credentials: Unable to locate credentials"):
        provider.create(make_request())


def test_subnets_in_two_vpcs_are_refused(fake_ec2: FakeEc2) -> None:
    client = fake_ec2.client()
    vpc = client.create_vpc(CidrBlock="10.77.0.0/16")["Vpc"]["VpcId"]
    elsewhere = client.create_subnet(VpcId=vpc, CidrBlock="10.77.1.0/24")["Subnet"]["SubnetId"]
    settings = AwsConfig(region=REGION, subnets=[*subnet_ids(fake_ec2, 1), elsewhere])
    provider = AwsProvider(settings, INSTALLATION, ec2=client)
    with pytest.raises(Permanent, match="the subnets must be in one VPC"):
        provider.create(make_request())
    assert fake_ec2.calls("RunInstances") == []


def test_no_image_of_that_name_is_a_config_error(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2, image_name="debian-13-amd64-*")
    with pytest.raises(Permanent, match=r"aws\.image_name: no available image"):
        provider.create(make_request())
    fixed = make_provider(fake_ec2, image_id=next(iter(DEBIAN_IMAGES)))
    assert fake_ec2.instance(fixed.create(make_request()).provider_id).image_id == next(
        iter(DEBIAN_IMAGES)
    )


# -- config --------------------------------------------------------------------------


def aws_config(block: dict[str, Any], cidrs: list[str] | None = None) -> dict[str, Any]:
    return {
        "installation": INSTALLATION,
        "proxy": {"auth": {"password_env": "PW"}, "allowed_cidrs": cidrs or ["192.0.2.0/24"]},
        "providers": [{"name": "ec2", "type": "aws", "aws": block}],
    }


GOOD = {"region": "eu-west-1", "subnets": ["subnet-0123456789abcdef0"]}
SPOT = {**GOOD, "market": "spot"}


@pytest.mark.parametrize(
    ("block", "cidrs", "problem"),
    [
        ({**GOOD, "max_price": "0.01"}, None, "max_price: only for market: spot"),
        ({**GOOD, "market": "spot", "max_price": "cheap"}, None, "aws.max_price: 'cheap' is not"),
        (
            {**GOOD, "market": "spot", "max_price": "-1"},
            None,
            "aws.max_price: '-1' is not a positive",
        ),
        (
            {**GOOD, "market": "spot", "max_price": "NaN"},
            None,
            "aws.max_price: 'NaN' is not a positive",
        ),
        ({**GOOD, "market": "reserved"}, None, "aws.market: input should be 'on-demand' or 'spot'"),
        ({**GOOD, "subnets": []}, None, "aws.subnets: list should have at least 1 item"),
        ({**GOOD, "subnets": ["sg-1"]}, None, "aws.subnets[0]: string should match pattern"),
        ({**GOOD, "subnets": ["subnet-01234567"] * 2}, None, "aws.subnets: listed more than once"),
        ({**GOOD, "region": "Europe"}, None, "aws.region: string should match pattern"),
        ({**GOOD, "image_id": "ami-x"}, None, "aws.image_id: string should match pattern"),
        ({"region": "eu-west-1"}, None, "aws.subnets: field required"),
        ({**GOOD, "instance_type": []}, None, "aws.instance_type: list should have at least 1"),
        (
            {**GOOD, "instance_type": ["t3.micro", "T3 Large"]},
            None,
            "aws.instance_type[1]: string should match pattern",
        ),
        (
            {**GOOD, "instance_type": ["t3.micro", "t3.micro"]},
            None,
            "aws.instance_type: listed more than once",
        ),
        (GOOD, ["2001:db8::/32"], "proxy.allowed_cidrs: no IPv4 range, but providers[0] (ec2)"),
    ],
)
def test_bad_config_is_refused_naming_the_field(
    block: dict[str, Any], cidrs: list[str] | None, problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(aws_config(block, cidrs), environ={"PW": PASSWORD})
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def test_a_good_config_builds_a_provider_on_the_default_chain() -> None:
    config = parse_config(
        aws_config({**GOOD, "market": "spot", "max_price": "0.0042"}), environ={"PW": PASSWORD}
    )
    settings = config.provider("ec2").settings
    assert isinstance(settings, AwsConfig) and settings.max_price == "0.0042"
    provider = PROVIDER_TYPE.build(config.provider("ec2"), config)
    assert isinstance(provider, AwsProvider)
    assert settings.placement_problems({"subnet": "subnet-0123456789abcdef0"}) == []


# -- the spot watcher in the user data ------------------------------------------------


def test_only_a_spot_instance_s_user_data_watches_for_the_notice(fake_ec2: FakeEc2) -> None:
    spot = make_provider(fake_ec2, market="spot").create(make_request())
    script = fake_ec2.user_data(spot.provider_id)
    bash = shutil.which("bash") or "/bin/bash"

    subprocess.run([bash, "-n"], input=script, text=True, check=True)

    assert SPOT_WATCH in script and "latest/meta-data/spot/instance-action" in script
    assert script.index(SPOT_WATCH) > script.index("report ready")  # once Squid serves
    assert "@" not in SPOT_WATCH  # every placeholder filled


class FakeImds(BaseHTTPRequestHandler):
    """IMDSv2 as the docs describe it: a PUT for a token, then GETs carrying it.

    `spot/instance-action` is 404 for the first `quiet` asks, then the
    notice; `events/recommendations/rebalance` has a recommendation from the start.
    """

    token = "imds-token"
    quiet = 2
    asks = 0
    recommendations = 0

    def do_PUT(self) -> None:
        if self.path != "/latest/api/token" or not self.headers.get(
            "X-aws-ec2-metadata-token-ttl-seconds"
        ):
            self._answer(400, b"")
            return
        self._answer(200, self.token.encode())

    def do_GET(self) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") != self.token:
            self._answer(401, b"")
        elif self.path == "/latest/meta-data/events/recommendations/rebalance":
            type(self).recommendations += 1
            self._answer(200, b'{"noticeTime": "2026-12-02T18:20:00Z"}')
        elif self.path != "/latest/meta-data/spot/instance-action":
            self._answer(404, b"")
        else:
            type(self).asks += 1
            if type(self).asks <= self.quiet:
                self._answer(404, b"")
            else:
                self._answer(200, b'{"action": "stop", "time": "2026-12-02T18:30:00Z"}')

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


def test_the_watcher_reports_a_recommendation_once_then_the_notice_and_stops_squid(
    tmp_path: Path,
) -> None:
    imds = ThreadingHTTPServer(("127.0.0.1", 0), FakeImds)
    threading.Thread(target=imds.serve_forever, daemon=True).start()
    # systemctl played by a stub on PATH: the test never touches this machine's services.
    stub = tmp_path / "bin" / "systemctl"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "systemctl.log"}\n')
    stub.chmod(0o755)
    console = tmp_path / "console"
    # The user data's own lines, but for the unit systemd-run starts: the
    # same command, run here in the foreground.
    watcher = SPOT_WATCH.split("systemd-run", 1)[0]
    launch = '/bin/bash -c "$(declare -f report watch_spot_notice); watch_spot_notice"'
    assert launch in SPOT_WATCH
    script = f'report() {{ echo "$1" >> {console}; }}\n{watcher}\n{launch}\n'
    env = {
        **os.environ,
        "PATH": f"{stub.parent}:{os.environ['PATH']}",
        "PROXY_OPERATOR_IMDS_URL": f"http://127.0.0.1:{imds.server_address[1]}",
    }
    try:
        subprocess.run(
            [shutil.which("bash") or "/bin/bash", "-c", script], env=env, check=True, timeout=120
        )
    finally:
        imds.shutdown()

    assert console.read_text().splitlines() == [
        "rebalance 2026-12-02T18:20:00Z",  # Squid serves on
        "interrupted stop 2026-12-02T18:30:00Z",
    ]
    assert (tmp_path / "systemctl.log").read_text().split() == [
        "--no-ask-password",
        "stop",
        "squid",
    ]
    assert FakeImds.asks == 3  # asked again after each 404, stopped after the notice
    assert FakeImds.recommendations == 1  # reported once, not asked again


# -- eventual consistency ("Eventual consistency in the Amazon EC2 API") ---------------


def test_a_new_instance_ec2_does_not_list_yet_is_waited_for_not_lost() -> None:
    with FakeEc2(instance_lag=2) as fake:
        provider = make_provider(fake)
        created = provider.create(make_request())

        for _ in range(2):
            with pytest.raises(Transient, match="is not listed yet"):
                provider.get(created.provider_id)
        listed = provider.get(created.provider_id)

    assert listed.state is InstanceState.PROVISIONING
    assert listed.provider_id == created.provider_id


def test_a_delete_right_after_create_is_asked_again_until_ec2_lists_the_instance() -> None:
    with FakeEc2(instance_lag=1) as fake:
        provider = make_provider(fake)
        created = provider.create(make_request())

        with pytest.raises(Transient, match="is not listed yet"):
            provider.delete(created.provider_id)
        provider.delete(created.provider_id)  # Temporal's retry: listed now

        assert fake.instance(created.provider_id).state == "terminated"
        # Asked by its id each time: nothing else would show it sooner.
        assert [call.params.get("InstanceId.1") for call in fake.calls("DescribeInstances")][
            -2:
        ] == [created.provider_id] * 2


def test_a_delete_is_not_done_while_ec2_may_not_show_the_instance_yet() -> None:
    with FakeEc2(instance_lag=3) as fake:
        provider = make_provider(fake)
        created = provider.create(make_request())

        for _ in range(3):
            with pytest.raises(Transient, match="is not listed yet"):
                provider.delete(created.provider_id)
            assert fake.instance(created.provider_id).state == "running"  # not taken for gone
        provider.delete(created.provider_id)

        assert fake.instance(created.provider_id).state == "terminated"


def test_a_terminate_answered_not_found_is_asked_again(
    fake_ec2: FakeEc2, provider: AwsProvider
) -> None:
    created = provider.create(make_request())
    fake_ec2.inject_error("TerminateInstances", "instance_not_found")

    with pytest.raises(Transient, match="TerminateInstances says it does not exist"):
        provider.delete(created.provider_id)
    assert fake_ec2.instance(created.provider_id).state == "running"
    provider.delete(created.provider_id)

    assert fake_ec2.instance(created.provider_id).state == "terminated"


def test_a_new_security_group_is_used_by_its_id_until_ec2_lists_it() -> None:
    with FakeEc2(group_lag=1) as fake:
        provider = make_provider(fake)
        req = make_request()

        with pytest.raises(Transient, match=r"InvalidGroup\.NotFound"):
            provider.create(req)  # the group's id is not known everywhere yet
        created = provider.create(req)

        assert fake.calls("RunInstances") and len(fake.calls("CreateSecurityGroup")) == 1
        assert ingress(group_of(fake)) == {("tcp", 3128, cidr) for cidr in CIDRS}
        assert fake.instance(created.provider_id).state == "running"


def test_rules_another_worker_changed_first_are_as_asked(fake_ec2: FakeEc2) -> None:
    fake_ec2.a_racing_worker("AuthorizeSecurityGroupIngress")
    make_provider(fake_ec2).create(make_request("first"))
    fake_ec2.open_by_hand(group_name(INSTALLATION), 22, ANYONE)
    fake_ec2.a_racing_worker("RevokeSecurityGroupIngress")

    make_provider(fake_ec2).create(make_request("second"))  # another worker's provider

    assert ingress(group_of(fake_ec2)) == {("tcp", 3128, cidr) for cidr in CIDRS}
    assert len(live(fake_ec2)) == 2


# -- zones that refuse: Unsupported, the spot price --------------------------------


def test_a_type_a_zone_does_not_offer_moves_to_the_next_subnet(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2, subnets=2)
    subnet_a, subnet_b = subnet_ids(fake_ec2, 2)
    fake_ec2.inject_error("RunInstances", "unsupported", subnet=subnet_a, times=None)

    landed = [provider.create(make_request(f"owner-{i}")) for i in range(4)]

    assert {fake_ec2.instance(i.provider_id).subnet_id for i in landed} == {subnet_b}
    with pytest.raises(Permanent, match=r"aws\.instance_type: t3\.micro is not offered"):
        provider.create(make_request("pinned", subnet=subnet_a))


def test_a_spot_price_above_max_price_moves_to_the_next_subnet(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2, subnets=2, market="spot", max_price="0.0010")
    subnet_a, subnet_b = subnet_ids(fake_ec2, 2)
    fake_ec2.inject_error("RunInstances", "spot_price_too_low", subnet=subnet_a, times=None)

    landed = [provider.create(make_request(f"owner-{i}")) for i in range(4)]

    assert {fake_ec2.instance(i.provider_id).subnet_id for i in landed} == {subnet_b}
    with pytest.raises(QuotaExceeded, match="SpotMaxPriceTooLow"):
        provider.create(make_request("pinned", subnet=subnet_a))  # waits, as for capacity


# -- a retried RunInstances ----------------------------------------------------------


def test_the_user_data_of_one_name_is_the_same_on_every_render() -> None:
    proxy = proxy_settings()
    first = user_data(proxy, spot=False, name="proxy-aaaa")

    assert user_data(proxy, spot=False, name="proxy-aaaa") == first
    assert user_data(proxy, spot=False, name="proxy-bbbb") != first  # a salt per instance
    [hashed] = [
        line.split(":", 1)[1] for line in first.splitlines() if line.startswith("proxy:$6$")
    ]
    assert sha512_crypt(PASSWORD, hashed) == hashed  # Squid's helper accepts the password


def test_a_render_hashes_the_password_once_with_the_instance_s_salt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SHA-512-crypt's rounds are the costly part of a render: paid once, not twice."""
    settings: list[str | None] = []

    def counted(password: str, setting: str | None = None) -> str:
        settings.append(setting)
        return sha512_crypt(password, setting)

    monkeypatch.setattr(squid_conf, "sha512_crypt", counted)
    user_data(proxy_settings(), spot=False, name="proxy-aaaa")

    assert settings == [f"$6$rounds={SHA512_CRYPT_ROUNDS}${htpasswd_salt('proxy-aaaa')}"]


def test_a_create_retried_before_ec2_lists_the_instance_gets_the_same_one() -> None:
    with FakeEc2(instance_lag=2) as fake:
        provider = make_provider(fake)
        req = make_request()
        first = provider.create(req)

        again = make_provider(fake).create(req)  # another worker: not listed by name yet

        assert again.provider_id == first.provider_id
        assert len(fake.calls("RunInstances")) == 2 and len(fake.instances()) == 1


def test_a_client_token_whose_instance_ended_is_a_terminated_instance_not_a_wait(
    fake_ec2: FakeEc2,
) -> None:
    provider = make_provider(fake_ec2, subnets=2)
    subnet_a, subnet_b = subnet_ids(fake_ec2, 2)
    ended = provider.create(make_request(subnet=subnet_a))
    fake_ec2.client().terminate_instances(InstanceIds=[ended.provider_id])

    # The same name, now asked in another subnet: EC2 answers
    # IdempotentParameterMismatch, and the token's instance has ended.
    again = provider.create(make_request(subnet=subnet_b))

    assert again.provider_id == ended.provider_id
    assert again.state is InstanceState.TERMINATED  # the workflow replaces it
    assert len(fake_ec2.instances()) == 1


# -- the instance type: Nitro, offered in the subnets' zones -------------------------


@pytest.mark.parametrize(
    ("given", "read"),
    [("m7i.large", ["m7i.large"]), (["t3.micro", "t3a.micro"], ["t3.micro", "t3a.micro"])],
)
def test_instance_type_is_one_type_or_several(given: Any, read: list[str]) -> None:
    config = parse_config(aws_config({**SPOT, "instance_type": given}), environ={"PW": PASSWORD})
    settings = config.providers[0].settings
    assert isinstance(settings, AwsConfig) and settings.instance_type == read


def test_a_type_no_subnet_takes_moves_to_the_next_type(fake_ec2: FakeEc2) -> None:
    provider = make_provider(
        fake_ec2, subnets=2, market="spot", instance_type=["t3.micro", "t3a.micro"]
    )
    # The first launch in each subnet, t3.micro's, meets no capacity.
    for subnet in subnet_ids(fake_ec2, 2):
        fake_ec2.inject_error("RunInstances", "capacity", subnet=subnet, times=1)

    created = provider.create(make_request())

    tried = [
        (c.params["InstanceType"], c.params["NetworkInterface.1.SubnetId"])
        for c in fake_ec2.calls("RunInstances")
    ]
    assert [t for t, _ in tried] == ["t3.micro", "t3.micro", "t3a.micro"]  # every zone first
    assert len({s for _, s in tried[:2]}) == 2
    assert fake_ec2.instance(created.provider_id).instance_type == "t3a.micro"


def test_every_listed_type_is_checked_before_any_launch(fake_ec2: FakeEc2) -> None:
    provider = make_provider(fake_ec2, market="spot", instance_type=["t3.micro", "m4.large"])

    with pytest.raises(Permanent, match=r"aws\.instance_type: m4\.large is not built on the Nitro"):
        provider.create(make_request())
    assert fake_ec2.calls("RunInstances") == []


def test_a_type_not_offered_in_a_zone_is_not_tried_there_the_next_is(fake_ec2: FakeEc2) -> None:
    (subnet_a, zone_a), _ = fake_ec2.subnets()[:2]
    fake_ec2.not_offered("t3.micro", zone_a)
    provider = make_provider(fake_ec2, subnets=2, instance_type=["t3.micro", "t3a.micro"])

    created = provider.create(make_request(subnet=subnet_a))

    assert fake_ec2.instance(created.provider_id).instance_type == "t3a.micro"
    assert [c.params["InstanceType"] for c in fake_ec2.calls("RunInstances")] == ["t3a.micro"]


@pytest.mark.parametrize("instance_type", ["t2.micro", "m4.large", "c4.large"])
def test_a_type_not_built_on_nitro_is_a_config_error_before_any_launch(
    fake_ec2: FakeEc2, instance_type: str
) -> None:
    """Its serial console never shows "ready" to GetConsoleOutput Latest: a crash loop."""
    provider = make_provider(fake_ec2, instance_type=instance_type)

    with pytest.raises(Permanent) as raised:
        provider.create(make_request())

    assert raised.value.message.startswith(
        f"aws.instance_type: {instance_type} is not built on the Nitro System (hypervisor xen)"
    )
    assert fake_ec2.calls("RunInstances") == []
    assert fake_ec2.calls("CreateSecurityGroup") == []


def test_the_console_of_a_xen_instance_never_shows_what_its_user_data_reports(
    fake_ec2: FakeEc2,
) -> None:
    """The fake's side of the check above: why a Xen type cannot be used."""
    xen = fake_ec2.client().run_instances(
        ImageId=NEWEST_DEBIAN_12, MinCount=1, MaxCount=1, InstanceType="t2.micro"
    )["Instances"][0]["InstanceId"]
    fake_ec2.report(xen, "ready")

    output = fake_ec2.client().get_console_output(InstanceId=xen, Latest=True).get("Output")

    assert console_report(output).state != "ready"


def test_a_type_offered_in_none_of_the_subnets_zones_is_a_config_error(
    fake_ec2: FakeEc2,
) -> None:
    (subnet_a, zone_a), (subnet_b, zone_b) = fake_ec2.subnets()[:2]
    fake_ec2.not_offered("t3.micro", zone_a)
    fake_ec2.not_offered("t3.micro", zone_b)
    provider = make_provider(fake_ec2, subnets=2)

    with pytest.raises(Permanent) as raised:
        provider.create(make_request())

    assert raised.value.message.startswith(
        "aws.instance_type: t3.micro is not offered in the availability zone of any "
        f"configured subnet: {subnet_a} ({zone_a}), {subnet_b} ({zone_b})"
    )
    assert fake_ec2.calls("RunInstances") == []


def test_subnets_whose_zone_does_not_offer_the_type_are_never_tried(fake_ec2: FakeEc2) -> None:
    (subnet_a, zone_a), (subnet_b, _) = fake_ec2.subnets()[:2]
    fake_ec2.not_offered("t3.micro", zone_a)
    provider = make_provider(fake_ec2, subnets=2)

    landed = [provider.create(make_request(f"owner-{i}")) for i in range(4)]

    assert {fake_ec2.instance(i.provider_id).subnet_id for i in landed} == {subnet_b}
    assert [c.params["NetworkInterface.1.SubnetId"] for c in fake_ec2.calls("RunInstances")] == [
        subnet_b
    ] * 4
    with pytest.raises(Permanent, match=r"placement\.subnet: .* offers none of aws\.instance_type"):
        provider.create(make_request("pinned", subnet=subnet_a))


# -- cost and hygiene: CPU credits, the root volume ------------------------------------


@pytest.mark.parametrize(
    ("settings", "credits"),
    [
        ({}, "standard"),
        ({"cpu_credits": "unlimited"}, "unlimited"),
        ({"instance_type": "t4g.micro", "image_name": "debian-12-*"}, "standard"),
        ({"instance_type": "m5.large"}, None),
    ],
    ids=["t3-default", "t3-unlimited", "t4g", "not-burstable"],
)
def test_burstable_types_launch_in_the_configured_credit_mode(
    fake_ec2: FakeEc2, settings: dict[str, Any], credits: str | None
) -> None:
    """EC2 launches t3, t3a and t4g unlimited unless told: surplus credits are billed."""
    make_provider(fake_ec2, **settings).create(make_request())

    assert fake_ec2.calls("RunInstances")[-1].params.get("CreditSpecification.CpuCredits") == (
        credits
    )


def credit_mode(fake_ec2: FakeEc2, instance_id: str) -> str:
    answer = fake_ec2.client().describe_instance_credit_specifications(InstanceIds=[instance_id])
    [spec] = answer["InstanceCreditSpecifications"]
    return str(spec["CpuCredits"])


@pytest.mark.parametrize(
    ("settings", "mode"),
    [({}, "standard"), ({"cpu_credits": "unlimited"}, "unlimited")],
    ids=["default", "unlimited"],
)
def test_a_t3_proxy_runs_in_the_configured_credit_mode_not_ec2s_unlimited_default(
    fake_ec2: FakeEc2, settings: dict[str, Any], mode: str
) -> None:
    created = make_provider(fake_ec2, **settings).create(make_request())

    assert credit_mode(fake_ec2, created.provider_id) == mode


def test_the_fake_launches_t3_unlimited_and_t2_standard_without_a_credit_specification(
    fake_ec2: FakeEc2,
) -> None:
    """As EC2 does: what the provider's credit mode must override."""
    launched = {
        instance_type: fake_ec2.client().run_instances(
            ImageId=NEWEST_DEBIAN_12, InstanceType=instance_type, MinCount=1, MaxCount=1
        )["Instances"][0]["InstanceId"]
        for instance_type in ("t3.micro", "t2.micro")
    }

    assert credit_mode(fake_ec2, launched["t3.micro"]) == "unlimited"
    assert credit_mode(fake_ec2, launched["t2.micro"]) == "standard"


def test_the_root_volume_is_encrypted_gp3_and_deleted_with_the_instance(
    fake_ec2: FakeEc2, provider: AwsProvider
) -> None:
    """Said in full, so a custom image cannot leave volumes behind, or unencrypted."""
    created = provider.create(make_request())

    params = fake_ec2.calls("RunInstances")[-1].params
    assert {k: v for k, v in params.items() if k.startswith("BlockDeviceMapping.1.")} == {
        "BlockDeviceMapping.1.DeviceName": "/dev/xvda",
        "BlockDeviceMapping.1.Ebs.VolumeType": "gp3",
        "BlockDeviceMapping.1.Ebs.Encrypted": "true",
        "BlockDeviceMapping.1.Ebs.DeleteOnTermination": "true",
        # The image's own root size (moto gives the fake's Debian images 15 GiB).
        "BlockDeviceMapping.1.Ebs.VolumeSize": "15",
    }
    [volume] = fake_ec2.client().describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [created.provider_id]}]
    )["Volumes"]
    assert (volume["VolumeType"], volume["Encrypted"]) == ("gp3", True)
