"""GcpProvider against the fake Compute Engine API, through the real REST clients."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import google.auth
import pytest
import requests
from google.api_core.exceptions import GoogleAPICallError
from google.auth.credentials import AnonymousCredentials

from providers.base import CreateRequest, InstanceState
from providers.config import ConfigError, parse_config
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded, Transient
from providers.gcp import (
    STARTUP_READY,
    STARTUP_STATE_ATTRIBUTE,
    GcpConfig,
    GcpProvider,
)
from providers.naming import (
    GENERATION_KEY,
    INSTALLATION_KEY,
    MANAGED_BY_KEY,
    NAMESPACE_KEY,
    OWNER_KEY,
    instance_name,
    owner_tags,
    short_hash,
)
from squid.conf import ProxySettings
from squid.htpasswd import sha512_crypt
from tests.conftest import RealCredentialsForbidden
from tests.fakes.compute import DEFAULT_PROJECT, DEFAULT_ZONES, FakeCompute, remote
from tests.fakes.compute import fake_compute_fixture as fake_compute_fixture

ZONE_B, ZONE_C, ZONE_D, ZONE_US = DEFAULT_ZONES
INSTALLATION = "prod-eu"
FIREWALL = "proxy-operator-prod-eu"
PASSWORD = "correct horse battery staple"
CIDRS = ("192.0.2.0/24", "10.0.0.0/8")
SQUID = shutil.which("squid") or "/usr/sbin/squid"


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
    zone: str | None = None,
    port: int = 3128,
    installation: str = INSTALLATION,
    labels: dict[str, str] | None = None,
    cidrs: tuple[str, ...] = CIDRS,
    namespace: str | None = None,
) -> CreateRequest:
    return CreateRequest(
        name=instance_name(owner, 1),
        proxy=proxy_settings(port, cidrs),
        tags=owner_tags(installation, owner, 1, labels, namespace=namespace),
        placement={"zone": zone} if zone else {},
    )


def make_provider(
    fake: FakeCompute, *, tuning: dict[str, float] | None = None, **settings: Any
) -> GcpProvider:
    """A provider of `settings`; `tuning`: GcpProvider's own keyword arguments."""
    config = GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B, **settings)
    # Every `get` asks for the startup state: tests step through it quickly.
    options: dict[str, Any] = {"guest_attribute_interval": 0, **(tuning or {})}
    return GcpProvider(config, INSTALLATION, **options, **fake.clients())


def boot(fake: FakeCompute, zone: str, name: str, nat_ip: str = "203.0.113.10") -> None:
    """The VM boots and its startup script reports Squid ready, as on a real VM."""
    fake.set_status(zone, name, "RUNNING", nat_ip=nat_ip)
    fake.guest_write(zone, name, STARTUP_STATE_ATTRIBUTE, STARTUP_READY)


@pytest.fixture
def provider(fake_compute: FakeCompute) -> GcpProvider:
    return make_provider(fake_compute)


def metadata_of(body: dict[str, Any]) -> dict[str, str]:
    return {item["key"]: item["value"] for item in body["metadata"]["items"]}


def insert_body(fake: FakeCompute) -> dict[str, Any]:
    """The body of the first instances.insert the fake received."""
    body = fake.calls("insert")[0].body
    assert body is not None
    return body


def inserted_zones(fake: FakeCompute) -> list[str | None]:
    return [call.zone for call in fake.calls("insert")]


# -- create -------------------------------------------------------------------


def test_create_sends_the_instance_a_proxy_needs(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    req = make_request(labels={"team": "crawl"})

    instance = provider.create(req)

    body = insert_body(fake_compute)
    assert inserted_zones(fake_compute) == [ZONE_B]
    assert body["name"] == req.name
    assert body["machineType"] == f"zones/{ZONE_B}/machineTypes/e2-micro"
    assert body["labels"] == {
        "managed-by": "proxy-operator",
        "proxy-operator_installation": INSTALLATION,
        "proxy-operator_owner": short_hash("proxy-eu-1"),
        "proxy-operator_generation": "1",
        "label_team": "crawl",
    }
    assert body["tags"] == {"items": [FIREWALL]}
    (nic,) = body["networkInterfaces"]
    assert nic["network"] == "global/networks/default"
    assert nic["accessConfigs"] == [{"name": "external-nat", "type": "ONE_TO_ONE_NAT"}]
    (disk,) = body["disks"]
    assert disk["boot"] and disk["autoDelete"]
    assert disk["initializeParams"]["sourceImage"] == (
        "projects/debian-cloud/global/images/family/debian-12"
    )
    # Disk listings and billing exports show whose boot disk it is.
    assert disk["initializeParams"]["labels"] == body["labels"]
    assert "scheduling" not in body
    assert "serviceAccounts" not in body
    metadata = metadata_of(body)
    assert json.loads(metadata["proxy-operator-tags"]) == req.tags
    assert metadata["proxy-operator-port"] == "3128"
    # The startup script reports readiness here; no project-wide SSH keys.
    assert metadata["enable-guest-attributes"] == "TRUE"
    assert metadata["block-project-ssh-keys"] == "TRUE"
    script = metadata["startup-script"]
    assert "install -y --no-install-recommends squid" in script
    assert "systemctl restart squid" in script
    assert PASSWORD not in json.dumps(body), "the plaintext password must stay in the worker"
    # The insert operation was waited on, then the instance read back.
    assert len(fake_compute.calls("zone_operation_wait")) == 1
    assert instance.provider_id == f"{ZONE_B}/{req.name}"
    assert instance.name == req.name
    assert instance.state is InstanceState.PROVISIONING
    assert instance.ip == ""
    assert instance.port == 3128
    assert instance.tags == req.tags


def test_create_applies_machine_image_network_and_spot_settings(
    fake_compute: FakeCompute,
) -> None:
    provider = make_provider(
        fake_compute,
        machine_type="e2-small",
        image_project="debian-cloud",
        image_family="debian-13",
        network="global/networks/proxies",
        subnetwork="regions/europe-west1/subnetworks/proxies",
        network_tag="corp-proxies",
        spot=True,
    )

    provider.create(make_request(zone=ZONE_C))

    body = insert_body(fake_compute)
    assert body["machineType"] == f"zones/{ZONE_C}/machineTypes/e2-small"
    assert body["disks"][0]["initializeParams"]["sourceImage"] == (
        "projects/debian-cloud/global/images/family/debian-13"
    )
    assert body["networkInterfaces"][0]["network"] == "global/networks/proxies"
    assert body["networkInterfaces"][0]["subnetwork"] == "regions/europe-west1/subnetworks/proxies"
    assert body["tags"] == {"items": ["corp-proxies"]}
    assert body["scheduling"] == {
        "provisioningModel": "SPOT",
        "instanceTerminationAction": "DELETE",
        "automaticRestart": False,
        "onHostMaintenance": "TERMINATE",
    }
    rule = fake_compute.firewall(FIREWALL)
    assert rule is not None
    assert rule["targetTags"] == ["corp-proxies"]
    assert rule["network"].endswith("/global/networks/proxies")


def test_tags_round_trip_exactly_when_labels_cannot_hold_them(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    long_key = "Cost.Center/" + "x" * 80
    req = make_request("Team/EU Proxy #1", labels={long_key: "R&D 42", "tier": "Gold"})

    created = provider.create(req)

    labels = insert_body(fake_compute)["labels"]
    assert labels["proxy-operator_owner"] == short_hash("Team/EU Proxy #1")
    assert labels["label_tier"] == short_hash("Gold")  # uppercase is not a valid label value
    (long_label,) = (k for k in labels if k.startswith("label_cost_center_"))
    assert len(long_label) <= 63
    assert labels[long_label] == short_hash("R&D 42")
    assert created.tags == req.tags
    assert provider.get(created.provider_id).tags == req.tags
    (listed,) = provider.list_by_tag(OWNER_KEY, "Team/EU Proxy #1")
    assert listed.tags == req.tags


def test_startup_script_is_valid_bash_and_its_squid_config_parses(
    fake_compute: FakeCompute, provider: GcpProvider, tmp_path: Path
) -> None:
    provider.create(make_request())
    body = insert_body(fake_compute)
    script = metadata_of(body)["startup-script"]
    script_file = tmp_path / "startup.sh"
    script_file.write_text(script)

    syntax = subprocess.run(["bash", "-n", str(script_file)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr

    files = {
        m["path"]: m["content"]
        for m in re.finditer(
            r"^cat > (?P<path>\S+) <<'(?P<eof>\w+)'\n(?P<content>.*?)\n(?P=eof)$",
            script,
            re.MULTILINE | re.DOTALL,
        )
    }
    assert set(files) == {"/etc/squid/squid.conf", "/etc/squid/passwords"}
    user, hashed = files["/etc/squid/passwords"].split(":", 1)
    assert user == "proxy"
    assert hashed == sha512_crypt(PASSWORD, hashed)
    # The htpasswd is created readable by root and Squid only, before the hash lands.
    assert script.index("install -m 0640 -o root -g proxy /dev/null /etc/squid/passwords") < (
        script.index("cat > /etc/squid/passwords")
    )

    conf = files["/etc/squid/squid.conf"]
    assert "http_port 3128" in conf
    assert "auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid/passwords" in conf
    assert f"acl allowed_clients src {' '.join(CIDRS)}" in conf
    if not Path(SQUID).exists():
        pytest.skip("squid is not installed")
    conf_file = tmp_path / "squid.conf"
    conf_file.write_text(conf)
    parsed = subprocess.run(
        [SQUID, "-k", "parse", "-f", str(conf_file)], capture_output=True, text=True, timeout=60
    )
    output = parsed.stdout + parsed.stderr
    assert parsed.returncode == 0, output
    assert "FATAL" not in output and "ERROR" not in output, output


# -- get and the state table -----------------------------------------------


@pytest.mark.parametrize(
    ("status", "nat_ip", "state"),
    [
        ("PENDING", None, InstanceState.PROVISIONING),
        ("PROVISIONING", None, InstanceState.PROVISIONING),
        ("STAGING", "203.0.113.10", InstanceState.PROVISIONING),
        ("RUNNING", "203.0.113.10", InstanceState.RUNNING),
        ("RUNNING", None, InstanceState.PROVISIONING),
        ("PENDING_STOP", None, InstanceState.STOPPED),
        ("STOPPING", None, InstanceState.STOPPED),
        ("STOPPED", None, InstanceState.STOPPED),
        ("SUSPENDING", None, InstanceState.STOPPED),
        ("SUSPENDED", None, InstanceState.STOPPED),
        ("REPAIRING", "203.0.113.10", InstanceState.STOPPED),
        ("TERMINATED", None, InstanceState.STOPPED),
        ("DEPROVISIONING", None, InstanceState.STOPPED),
        ("A_STATUS_FROM_THE_FUTURE", "203.0.113.10", InstanceState.PROVISIONING),
    ],
)
def test_get_maps_every_status(
    fake_compute: FakeCompute,
    provider: GcpProvider,
    status: str,
    nat_ip: str | None,
    state: InstanceState,
) -> None:
    created = provider.create(make_request())
    fake_compute.guest_write(ZONE_B, created.name, STARTUP_STATE_ATTRIBUTE, STARTUP_READY)
    fake_compute.set_status(ZONE_B, created.name, status, nat_ip=nat_ip)

    instance = provider.get(created.provider_id)

    assert instance.state is state
    # An address is published only with RUNNING, and RUNNING only with one.
    assert instance.ip == (nat_ip if state is InstanceState.RUNNING else "")
    assert instance.endpoint == (f"{nat_ip}:3128" if state is InstanceState.RUNNING else "")
    # The exit is the external IP while the VM holds one, ready or not.
    holds = state in (InstanceState.RUNNING, InstanceState.PROVISIONING)
    assert instance.exit_address == (nat_ip if holds else None)


@pytest.mark.parametrize(
    "provider_id",
    ["", "europe-west1-b", "europe-west1-b/", "/proxy-abc", "a/b/c", "Europe/Proxy", "zone/x_y"],
)
def test_malformed_provider_id_is_permanent_and_calls_nothing(
    fake_compute: FakeCompute, provider: GcpProvider, provider_id: str
) -> None:
    with pytest.raises(Permanent):
        provider.get(provider_id)
    with pytest.raises(Permanent):
        provider.delete(provider_id)
    assert fake_compute.calls() == []


# -- idempotency ----------------------------------------------------------------


def test_create_adopts_an_instance_that_already_exists(fake_compute: FakeCompute) -> None:
    req = make_request()
    first = make_provider(fake_compute).create(req)
    boot(fake_compute, ZONE_B, req.name)

    # A retried activity, possibly on another worker with a fresh provider.
    again = make_provider(fake_compute).create(req)

    assert again.provider_id == first.provider_id
    assert again.state is InstanceState.RUNNING
    assert again.ip == "203.0.113.10"
    assert fake_compute.instance_keys() == {(ZONE_B, req.name)}
    assert inserted_zones(fake_compute) == [ZONE_B, ZONE_B]  # the second one got a 409


def test_a_spot_vm_gone_is_not_found_even_where_preemptions_cannot_be_listed(
    fake_compute: FakeCompute,
) -> None:
    # A role without compute.zoneOperations.list: the reason is unknown, the VM still gone.
    provider = make_provider(fake_compute, spot=True)
    created = provider.create(make_request())
    provider.delete(created.provider_id)
    fake_compute.inject_error("zone_operation_list", "forbidden", times=None)

    with pytest.raises(NotFound) as gone:
        provider.get(created.provider_id)
    assert gone.value.disruption is None


def test_delete_waits_for_the_operation_and_is_idempotent(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    created = provider.create(make_request())

    provider.delete(created.provider_id)

    assert fake_compute.instance(ZONE_B, created.name) is None
    with pytest.raises(NotFound):
        provider.get(created.provider_id)
    provider.delete(created.provider_id)  # already gone: success
    # The second delete read the instance first (to check its tags) and found it gone.
    assert len(fake_compute.calls("delete")) == 1


# -- list_by_tag ----------------------------------------------------------------


def test_list_by_tag_finds_tagged_instances_in_every_zone(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    ours = [make_request(f"proxy-{zone}", zone=zone) for zone in (ZONE_B, ZONE_C, ZONE_D)]
    for req in ours:
        provider.create(req)
    staging = GcpProvider(
        GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B), "staging", **fake_compute.clients()
    )
    staging.create(make_request("other-installation", zone=ZONE_C, installation="staging"))
    fake_compute.add_instance(ZONE_B, "someone-elses-vm", labels={"team": "web"})
    # Same label, different exact tag: a label collision the metadata resolves.
    fake_compute.add_instance(
        ZONE_D,
        "lookalike",
        labels={"proxy-operator_installation": INSTALLATION},
        metadata={"proxy-operator-tags": json.dumps({INSTALLATION_KEY: "prod-eu-2"})},
    )
    fake_compute.page_size = 2  # make the client follow page tokens

    found = provider.list_by_tag(INSTALLATION_KEY, INSTALLATION)

    assert sorted(i.provider_id for i in found) == sorted(
        f"{req.placement['zone']}/{req.name}" for req in ours
    )
    assert {i.name: i.tags for i in found} == {req.name: req.tags for req in ours}
    filters = {c.query["filter"][0] for c in fake_compute.calls("aggregated_list")}
    assert f'labels.proxy-operator_installation = "{INSTALLATION}"' in filters
    assert len(fake_compute.calls("aggregated_list")) >= 2


# -- firewall -----------------------------------------------------------------


def test_firewall_is_ensured_once_and_admits_allowed_cidrs_only(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    provider.create(make_request("proxy-1"))
    provider.create(make_request("proxy-2"))

    # Read, insert, read back; the second create trusts the check.
    assert len(fake_compute.calls("firewall_get")) == 2
    assert len(fake_compute.calls("firewall_insert")) == 1
    assert len(fake_compute.calls("global_operation_wait")) == 1
    rule = fake_compute.firewall(FIREWALL)
    assert rule is not None
    assert rule["direction"] == "INGRESS"
    assert rule["allowed"] == [{"IPProtocol": "tcp", "ports": ["3128"]}]
    assert sorted(rule["sourceRanges"]) == sorted(CIDRS)
    assert rule["targetTags"] == [FIREWALL]
    assert rule["network"].endswith("/global/networks/default")


def test_a_widened_firewall_rule_is_put_back(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    fake_compute.put_firewall(
        {
            "name": FIREWALL,
            "sourceRanges": ["0.0.0.0/0"],
            "allowed": [{"IPProtocol": "tcp"}, {"IPProtocol": "udp", "ports": ["53"]}],
            "targetTags": [FIREWALL],
        }
    )

    provider.create(make_request())

    rule = fake_compute.firewall(FIREWALL)
    assert rule is not None
    assert sorted(rule["sourceRanges"]) == sorted(CIDRS)
    assert rule["allowed"] == [{"IPProtocol": "tcp", "ports": ["3128"]}]
    assert len(fake_compute.calls("firewall_insert")) == 0
    assert len(fake_compute.calls("firewall_update")) == 1


def test_firewall_keeps_the_ports_of_earlier_proxies(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    provider.create(make_request("default-port"))
    provider.create(make_request("overridden-port", port=8080))
    provider.create(make_request("default-port-again"))

    rule = fake_compute.firewall(FIREWALL)
    assert rule is not None
    assert rule["allowed"] == [{"IPProtocol": "tcp", "ports": ["3128", "8080"]}]
    assert len(fake_compute.calls("firewall_update")) == 1


def test_firewall_inserted_by_a_racing_worker_is_accepted(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    # Another worker inserts the rule between our get and our insert.
    make_provider(fake_compute).create(make_request("first"))
    fake_compute.inject_error("firewall_get", "not_found")

    provider.create(make_request("second"))

    assert len(fake_compute.calls("firewall_insert")) == 2  # ours got a 409
    assert len(fake_compute.calls("firewall_update")) == 0  # and the rule was right


def rule_ports(fake: FakeCompute) -> list[str]:
    rule = fake.firewall(FIREWALL)
    assert rule is not None, "no firewall rule"
    return [port for allowed in rule["allowed"] for port in allowed["ports"]]


def test_a_port_a_concurrent_writer_dropped_is_merged_back(fake_compute: FakeCompute) -> None:
    """No precondition on firewalls.update: our update is read back, and redone if lost."""
    make_provider(fake_compute).create(make_request("first"))
    # Another worker adds 9090 from the rule as it was, just after our update.
    fake_compute.race_firewall_update(FIREWALL, 9090)

    make_provider(fake_compute).create(make_request("overridden-port", port=8080))

    assert rule_ports(fake_compute) == ["3128", "8080", "9090"]
    assert len(fake_compute.calls("firewall_update")) == 2


def test_a_rule_deleted_by_hand_is_recreated_once_its_check_is_stale(
    fake_compute: FakeCompute,
) -> None:
    provider = make_provider(fake_compute, tuning={"firewall_recheck_seconds": 0})
    provider.create(make_request("first"))
    fake_compute.delete_firewall(FIREWALL)

    provider.create(make_request("second"))

    assert rule_ports(fake_compute) == ["3128"]


def test_a_failed_probe_has_the_rule_checked_and_put_back(fake_compute: FakeCompute) -> None:
    provider = make_provider(fake_compute, tuning={"firewall_doubt_seconds": 0})
    made = provider.create(make_request())
    fake_compute.delete_firewall(FIREWALL)

    provider.recheck_access(made.provider_id, proxy_settings())

    assert rule_ports(fake_compute) == ["3128"]


def test_a_failed_probe_right_after_a_check_has_the_next_create_check(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    """Many VMs failing at once cost one read, and the replacement's create checks again."""
    made = provider.create(make_request())
    fake_compute.delete_firewall(FIREWALL)
    reads = len(fake_compute.calls("firewall_get"))

    provider.recheck_access(made.provider_id, proxy_settings())  # just checked: no read
    assert len(fake_compute.calls("firewall_get")) == reads
    provider.create(make_request("replacement"))

    assert rule_ports(fake_compute) == ["3128"]


@pytest.mark.parametrize("cidrs", [(), ("2001:db8::/32",)])
def test_no_ipv4_allowed_cidrs_never_open_the_port_to_everyone(
    fake_compute: FakeCompute, provider: GcpProvider, cidrs: tuple[str, ...]
) -> None:
    with pytest.raises(Permanent, match="allowed_cidrs"):
        provider.create(make_request(cidrs=cidrs))

    assert fake_compute.firewall(FIREWALL) is None
    assert fake_compute.calls("insert") == []


# -- zones ----------------------------------------------------------------------


def test_stockout_falls_back_to_the_next_configured_zone(fake_compute: FakeCompute) -> None:
    provider = make_provider(fake_compute, zones=[ZONE_C, ZONE_D])
    fake_compute.inject_error("insert", "stockout", zone=ZONE_B, times=None)
    req = make_request()

    instance = provider.create(req)

    assert instance.provider_id == f"{ZONE_C}/{req.name}"
    assert inserted_zones(fake_compute) == [ZONE_B, ZONE_C]
    assert fake_compute.instance_keys() == {(ZONE_C, req.name)}

    # A retry of the same create, now that ZONE_B has capacity again, adopts
    # the VM in ZONE_C instead of starting a second one in ZONE_B: still
    # PROVISIONING, it asks for ZONE_C's insert again under its requestId,
    # which answers with the original operation and creates nothing.
    fake_compute.clear_errors()
    assert make_provider(fake_compute, zones=[ZONE_C, ZONE_D]).create(req) == instance
    assert inserted_zones(fake_compute) == [ZONE_B, ZONE_C, ZONE_C]
    ids = [call.query["requestId"][0] for call in fake_compute.calls("insert")]
    assert ids[1] == ids[2] != ids[0]
    assert fake_compute.instance_keys() == {(ZONE_C, req.name)}


def test_a_pinned_zone_does_not_fall_back(fake_compute: FakeCompute) -> None:
    provider = make_provider(fake_compute, zones=[ZONE_C, ZONE_D])
    fake_compute.inject_error("insert", "stockout", zone=ZONE_B, times=None)

    with pytest.raises(QuotaExceeded):
        provider.create(make_request(zone=ZONE_B))

    assert inserted_zones(fake_compute) == [ZONE_B]
    assert fake_compute.instance_keys() == set()


def test_stockout_in_every_zone_is_quota_exceeded(fake_compute: FakeCompute) -> None:
    provider = make_provider(fake_compute, zones=[ZONE_C, ZONE_D])
    fake_compute.inject_error("insert", "stockout", times=None)

    with pytest.raises(QuotaExceeded) as caught:
        provider.create(make_request())

    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in str(caught.value)
    assert inserted_zones(fake_compute) == [ZONE_B, ZONE_C, ZONE_D]


def test_quota_does_not_fall_back(fake_compute: FakeCompute) -> None:
    """Quota is per region or project: another zone would only fail the same way."""
    provider = make_provider(fake_compute, zones=[ZONE_C])
    fake_compute.inject_error("insert", "quota_operation", zone=ZONE_B)

    with pytest.raises(QuotaExceeded):
        provider.create(make_request())

    assert inserted_zones(fake_compute) == [ZONE_B]


# -- operations and errors ----------------------------------------------------


def test_operation_wait_is_bounded(fake_compute: FakeCompute) -> None:
    config = GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B)
    # The firewall put in place with the default budget: a busy machine may
    # take longer than the short one below even for operations that are not paused.
    GcpProvider(config, INSTALLATION, **fake_compute.clients()).create(make_request("warm-up"))
    provider = GcpProvider(config, INSTALLATION, operation_timeout=0.3, **fake_compute.clients())
    fake_compute.set_operations_paused(True)
    req = make_request()

    with pytest.raises(Transient, match="still RUNNING"):
        provider.create(req)

    fake_compute.set_operations_paused(False)
    assert provider.create(req).provider_id == f"{ZONE_B}/{req.name}"  # adopted


@pytest.mark.parametrize(
    ("method", "kind", "expected"),
    [
        ("get", "unavailable", Transient),
        ("get", "internal", Transient),
        ("get", "too_many_requests", Transient),
        ("get", "not_ready", Transient),
        ("get", "quota", QuotaExceeded),
        # Rate limits pass within a minute: waited out, never "quota".
        ("get", "rate_limit", Transient),
        ("get", "user_rate_limit", Transient),
        ("aggregated_list", "rate_limit", Transient),
        ("get", "forbidden", Permanent),
        ("get", "bad_request", Permanent),
        ("insert", "quota", QuotaExceeded),
        ("insert", "quota_operation", QuotaExceeded),
        ("insert", "stockout", QuotaExceeded),
        ("insert", "forbidden", Permanent),
        ("insert", "bad_request", Permanent),
        ("insert", "not_found", Permanent),  # e.g. the image family does not exist
        # An organisation policy (no external IPs): no retry gets past it.
        ("insert", "org_policy", Permanent),
        ("insert", "org_policy_operation", Permanent),
        ("insert", "rate_limit", Transient),
        ("insert", "operation_rate", Transient),
        ("delete", "operation_rate", Transient),
        ("insert", "unavailable", Transient),
        ("zone_operation_wait", "unavailable", Transient),
        ("delete", "unavailable", Transient),
        ("delete", "forbidden", Permanent),
        ("delete", "not_ready", Transient),
        ("aggregated_list", "unavailable", Transient),
        ("aggregated_list", "forbidden", Permanent),
        ("firewall_get", "forbidden", Permanent),
        ("firewall_insert", "quota", QuotaExceeded),
        ("firewall_insert", "bad_request", Permanent),
    ],
)
def test_api_errors_are_mapped_onto_the_taxonomy(
    fake_compute: FakeCompute,
    method: str,
    kind: str,
    expected: type[ProviderError],
) -> None:
    provider = make_provider(fake_compute)
    existing = provider.create(make_request("existing")) if method in ("get", "delete") else None
    fake_compute.inject_error(method, kind)

    with pytest.raises(ProviderError) as caught:
        if method == "get":
            assert existing is not None
            provider.get(existing.provider_id)
        elif method == "delete":
            assert existing is not None
            provider.delete(existing.provider_id)
        elif method == "aggregated_list":
            provider.list_by_tag(INSTALLATION_KEY, INSTALLATION)
        else:
            provider.create(make_request())

    error = caught.value
    assert type(error) is expected
    assert isinstance(error.cause, GoogleAPICallError)
    assert error.__cause__ is error.cause
    if kind == "too_many_requests":
        assert error.retry_after_seconds == 7
    if kind in ("rate_limit", "user_rate_limit", "operation_rate"):
        # Rate quotas refill within a minute; a resource quota waits longer.
        assert error.retry_after_seconds == 60
    if kind in ("quota", "quota_operation", "stockout"):
        assert error.retry_after_seconds is None


def test_unreachable_api_is_transient(fake_compute: FakeCompute, provider: GcpProvider) -> None:
    fake_compute.stop()

    with pytest.raises(Transient) as caught:
        provider.get(f"{ZONE_B}/proxy-abc")

    assert isinstance(caught.value.cause, requests.ConnectionError)


# -- construction ------------------------------------------------------------------


def test_from_config_uses_application_default_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = parse_config(
        {
            "installation": INSTALLATION,
            "proxy": {"auth": {"password_env": "PW"}, "allowed_cidrs": list(CIDRS)},
            "providers": [
                {"name": "gcp-eu", "type": "gcp", "gcp": {"project": "p", "zone": ZONE_B}}
            ],
        },
        environ={"PW": PASSWORD},
    )
    entry = config.provider("gcp-eu")

    # The suite's guard proves the credentials come from ADC and nowhere else.
    with pytest.raises(RealCredentialsForbidden):
        GcpProvider.from_config(entry, config)

    scopes: list[Any] = []

    def fake_default(**kwargs: Any) -> tuple[AnonymousCredentials, str]:
        scopes.append(kwargs.get("scopes"))
        return AnonymousCredentials(), "adc-project"

    monkeypatch.setattr(google.auth, "default", fake_default)
    assert isinstance(GcpProvider.from_config(entry, config), GcpProvider)
    assert scopes == [["https://www.googleapis.com/auth/compute"]]


def test_the_fake_can_be_driven_from_another_process(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    """Workflow tests run the worker elsewhere and steer the fake over HTTP."""
    remote(fake_compute.url, "inject_error", method="insert", kind="quota_operation")
    with pytest.raises(QuotaExceeded):
        provider.create(make_request())

    created = provider.create(make_request())
    remote(
        fake_compute.url,
        "set_status",
        zone=ZONE_B,
        name=created.name,
        status="RUNNING",
        nat_ip="127.0.0.1",
    )
    remote(
        fake_compute.url,
        "guest_write",
        zone=ZONE_B,
        name=created.name,
        path=STARTUP_STATE_ATTRIBUTE,
        value=STARTUP_READY,
    )

    assert provider.get(created.provider_id).endpoint == "127.0.0.1:3128"
    assert remote(fake_compute.url, "instance", zone=ZONE_B, name=created.name)["status"] == (
        "RUNNING"
    )


# -- readiness: RUNNING means Squid is up ----------------------------------------


def test_a_running_vm_is_provisioning_until_its_startup_script_reports_ready(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    created = provider.create(make_request())
    fake_compute.set_status(ZONE_B, created.name, "RUNNING", nat_ip="203.0.113.10")

    booting = provider.get(created.provider_id)
    assert (booting.state, booting.endpoint) == (InstanceState.PROVISIONING, "")
    assert "booting" in booting.reason

    fake_compute.guest_write(ZONE_B, created.name, STARTUP_STATE_ATTRIBUTE, "installing")
    installing = provider.get(created.provider_id)
    assert (installing.state, installing.endpoint) == (InstanceState.PROVISIONING, "")
    assert "installing" in installing.reason

    fake_compute.guest_write(ZONE_B, created.name, STARTUP_STATE_ATTRIBUTE, STARTUP_READY)
    ready = provider.get(created.provider_id)
    assert (ready.state, ready.endpoint) == (InstanceState.RUNNING, "203.0.113.10:3128")

    asked = len(fake_compute.calls("get_guest_attributes"))
    assert provider.get(created.provider_id).state is InstanceState.RUNNING
    assert len(fake_compute.calls("get_guest_attributes")) == asked  # ready is remembered


@pytest.mark.parametrize(
    ("reported", "reason"),
    [
        (
            "failed: apt-get could not install squid in 5 attempts",
            "startup script failed: apt-get could not install squid in 5 attempts",
        ),
        # Any process on the VM can write the attribute: users see it short and printable.
        ("failed: \x1b[2J" + "x" * 10_000, "startup script failed: ?[2J" + "x" * 288),
    ],
)
def test_a_startup_failure_ends_the_instance_with_its_reason(
    fake_compute: FakeCompute, provider: GcpProvider, reported: str, reason: str
) -> None:
    created = provider.create(make_request())
    fake_compute.set_status(ZONE_B, created.name, "RUNNING", nat_ip="203.0.113.10")
    fake_compute.guest_write(ZONE_B, created.name, STARTUP_STATE_ATTRIBUTE, reported)

    failed = provider.get(created.provider_id)

    assert (failed.state, failed.endpoint) == (InstanceState.TERMINATED, "")
    assert failed.reason == reason


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("forbidden", Permanent), ("unavailable", Transient), ("rate_limit", Transient)],
)
def test_a_failed_readiness_query_is_classified(
    fake_compute: FakeCompute,
    provider: GcpProvider,
    kind: str,
    expected: type[ProviderError],
) -> None:
    """A role without compute.instances.getGuestAttributes fails loudly, not slowly."""
    created = provider.create(make_request())
    fake_compute.set_status(ZONE_B, created.name, "RUNNING", nat_ip="203.0.113.10")
    fake_compute.inject_error("get_guest_attributes", kind)

    with pytest.raises(ProviderError) as caught:
        provider.get(created.provider_id)

    assert type(caught.value) is expected


def test_startup_state_queries_are_paced_per_vm(fake_compute: FakeCompute) -> None:
    """Guest attributes are meant for a few queries a minute per VM."""
    provider = GcpProvider(
        GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B),
        INSTALLATION,
        guest_attribute_interval=3600,
        **fake_compute.clients(),
    )
    created = provider.create(make_request())
    fake_compute.set_status(ZONE_B, created.name, "RUNNING", nat_ip="203.0.113.10")

    states = {provider.get(created.provider_id).state for _ in range(5)}

    assert states == {InstanceState.PROVISIONING}
    assert len(fake_compute.calls("get_guest_attributes")) == 1


def test_a_vm_made_before_readiness_reporting_keeps_its_status(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    """Running workflows keep the VMs an older worker made, without guest attributes."""
    tags = owner_tags(INSTALLATION, "proxy-old", 3)
    fake_compute.add_instance(
        ZONE_B,
        "proxy-old",
        metadata={"proxy-operator-tags": json.dumps(tags), "proxy-operator-port": "3128"},
        nat_ip="203.0.113.11",
    )

    instance = provider.get(f"{ZONE_B}/proxy-old")

    assert (instance.state, instance.endpoint) == (InstanceState.RUNNING, "203.0.113.11:3128")
    assert fake_compute.calls("get_guest_attributes") == []


# -- errors as the real API sends them ---------------------------------------------


def test_a_failed_insert_is_reported_once_its_instance_is_gone(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    """The failed insert's instance lingers as PROVISIONING; a retry must not adopt it."""
    req = make_request()
    fake_compute.inject_error("insert", "quota_operation", zone=ZONE_B)

    with pytest.raises(QuotaExceeded):
        provider.create(req)
    assert fake_compute.instance(ZONE_B, req.name) is None

    # The workflow's retry after its quota wait inserts afresh (no 409
    # adoption): its requestId answers with the failed operation, so it
    # inserts again under one derived from that.
    again = provider.create(req)
    assert fake_compute.instance(ZONE_B, req.name) is not None
    assert provider.get(again.provider_id).name == req.name
    ids = [call.query["requestId"][0] for call in fake_compute.calls("insert")]
    assert len(ids) == 3 and ids[0] == ids[1] != ids[2]


def test_a_retried_insert_waits_for_the_original_and_falls_back_on_its_stockout(
    fake_compute: FakeCompute,
) -> None:
    """An attempt lost mid-insert: the retry sees the original operation's stockout."""
    req = make_request()
    fake_compute.inject_error("insert", "stockout", zone=ZONE_B)
    fake_compute.set_operation_seconds(3.0, zone=ZONE_B)
    slow = GcpProvider(
        GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B),
        INSTALLATION,
        operation_timeout=0.5,
        **fake_compute.clients(),
    )
    with pytest.raises(Transient):  # its operation outlived the attempt
        slow.create(req)
    assert fake_compute.instance(ZONE_B, req.name)["status"] == "PROVISIONING"  # type: ignore[index]

    instance = make_provider(fake_compute, zones=[ZONE_C]).create(req)

    # Not adopted while PROVISIONING: the original insert failed, so zone C.
    assert instance.provider_id == f"{ZONE_C}/{req.name}"
    assert fake_compute.instance_keys() == {(ZONE_C, req.name)}


def test_list_by_tag_refuses_to_answer_for_part_of_the_project(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    provider.create(make_request("in-b", zone=ZONE_B))
    provider.create(make_request("in-c", zone=ZONE_C))
    fake_compute.set_zone_unreachable(ZONE_C, True)

    with pytest.raises(Transient, match=f"zones/{ZONE_C}"):
        provider.list_by_tag(INSTALLATION_KEY, INSTALLATION)

    fake_compute.set_zone_unreachable(ZONE_C, False)
    assert len(provider.list_by_tag(INSTALLATION_KEY, INSTALLATION)) == 2


# -- finding an instance by name -------------------------------------------------


def test_lookup_by_name_asks_each_candidate_zone(fake_compute: FakeCompute) -> None:
    provider = make_provider(fake_compute, zones=[ZONE_C])
    req = make_request()

    provider.create(req)

    methods = [call.method for call in fake_compute.calls()]
    before_insert = fake_compute.calls()[: methods.index("insert")]
    assert [(c.method, c.zone) for c in before_insert if c.method != "firewall_get"] == [
        ("firewall_insert", None),
        ("global_operation_wait", None),
        ("get", ZONE_B),
        ("get", ZONE_C),
    ]


def test_find_is_a_zonal_get_never_an_aggregated_list(fake_compute: FakeCompute) -> None:
    """The pool's endpoint check, per member: a read in its zone, not a project-wide list."""
    provider = make_provider(fake_compute, zones=[ZONE_C])
    made = provider.create(make_request())
    pinned = provider.create(make_request("pinned", zone=ZONE_D))
    before = len(fake_compute.calls())

    found = provider.find(made.name, {})
    found_pinned = provider.find(pinned.name, {"zone": ZONE_D})
    missing = provider.find(instance_name("nobody", 1), {})

    assert found is not None and found.provider_id == made.provider_id
    assert found.tags == made.tags
    assert found_pinned is not None and found_pinned.provider_id == pinned.provider_id
    assert missing is None
    asked = [(c.method, c.zone) for c in fake_compute.calls()[before:]]
    assert asked == [("get", ZONE_B), ("get", ZONE_D), ("get", ZONE_B), ("get", ZONE_C)]


def left_in_fallback_zone(fake: FakeCompute, req: CreateRequest) -> None:
    """Attempt 1 of `req` reaches fallback zone C, and its worker dies before reporting."""
    fake.inject_error("insert", "stockout", zone=ZONE_B)
    make_provider(fake, zones=[ZONE_C]).create(req)
    assert fake.instance_keys() == {(ZONE_C, req.name)}


def test_a_candidate_zone_that_cannot_answer_stops_the_create(fake_compute: FakeCompute) -> None:
    """The VM may be in that zone: inserting elsewhere would make a second one."""
    req = make_request()
    left_in_fallback_zone(fake_compute, req)
    fake_compute.set_zone_unreachable(ZONE_C, True)

    with pytest.raises(Transient):
        make_provider(fake_compute, zones=[ZONE_C]).create(req)

    assert fake_compute.instance_keys() == {(ZONE_C, req.name)}


def test_a_zone_dropped_from_the_config_between_attempts_leaves_one_vm(
    fake_compute: FakeCompute,
) -> None:
    req = make_request()
    left_in_fallback_zone(fake_compute, req)
    # Somebody else's VM of the same name elsewhere is never touched.
    fake_compute.add_instance(ZONE_US, req.name, metadata={"proxy-operator-tags": "{}"})

    # The retry runs on a worker whose config no longer lists zone C.
    instance = make_provider(fake_compute, zones=[ZONE_D]).create(req)

    assert instance.provider_id == f"{ZONE_B}/{req.name}"
    assert fake_compute.instance_keys() == {(ZONE_B, req.name), (ZONE_US, req.name)}


def test_a_twin_that_could_not_be_deleted_is_deleted_by_the_retry(
    fake_compute: FakeCompute,
) -> None:
    req = make_request()
    left_in_fallback_zone(fake_compute, req)
    fake_compute.inject_error("delete", "unavailable", zone=ZONE_C)
    with pytest.raises(Transient):
        make_provider(fake_compute, zones=[ZONE_D]).create(req)

    instance = make_provider(fake_compute, zones=[ZONE_D]).create(req)  # adopts B's VM

    assert instance.provider_id == f"{ZONE_B}/{req.name}"
    assert fake_compute.instance_keys() == {(ZONE_B, req.name)}


def test_a_twin_in_an_unreachable_zone_keeps_the_create_transient(
    fake_compute: FakeCompute,
) -> None:
    """A zone the twin check cannot see may hold one: try later, never carry on as if not."""
    req = make_request()
    left_in_fallback_zone(fake_compute, req)
    fake_compute.set_zone_unreachable(ZONE_C, True)

    # The retry runs on a worker whose config no longer lists zone C.
    with pytest.raises(Transient, match=f"zones/{ZONE_C}"):
        make_provider(fake_compute, zones=[ZONE_D]).create(req)

    fake_compute.set_zone_unreachable(ZONE_C, False)
    instance = make_provider(fake_compute, zones=[ZONE_D]).create(req)
    assert instance.provider_id == f"{ZONE_B}/{req.name}"
    assert fake_compute.instance_keys() == {(ZONE_B, req.name)}


def test_find_in_a_zone_the_config_no_longer_allows_finds_nothing(
    fake_compute: FakeCompute,
) -> None:
    """The pool's endpoint check then asks the listing, instead of rejecting the report."""
    made = make_provider(fake_compute).create(make_request(zone=ZONE_US))
    moved = make_provider(fake_compute, subnetwork=SUBNET_EU)

    before = len(fake_compute.calls())
    assert moved.find(made.name, {"zone": ZONE_US}) is None
    assert fake_compute.calls()[before:] == []
    listed = moved.list_by_tag(OWNER_KEY, "proxy-eu-1")
    assert [i.provider_id for i in listed] == [made.provider_id]


def test_inserts_that_keep_failing_are_not_chained_without_bound(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    """Each retry walks the failed inserts its requestIds still answer: a few, then it says so."""
    req = make_request()
    fake_compute.inject_error("insert", "quota_operation", zone=ZONE_B, times=None)
    sent = []
    for _ in range(8):
        with pytest.raises(QuotaExceeded) as caught:
            provider.create(req)
        sent.append(len(fake_compute.calls("insert")))

    per_attempt = [b - a for a, b in zip([0, *sent], sent, strict=False)]
    assert max(per_attempt) <= 4, per_attempt
    assert "no new insert until the first is forgotten" in str(caught.value)
    assert "Quota 'IN_USE_ADDRESSES' exceeded" in str(caught.value)


def test_preemption_lookups_are_remembered_for_a_bounded_number_of_vms(
    fake_compute: FakeCompute,
) -> None:
    provider = make_provider(fake_compute, spot=True, tuning={"remembered_vms": 2})
    made = [provider.create(make_request(f"spot-{i}")) for i in range(3)]
    for instance in made:
        fake_compute.preempt(ZONE_B, instance.name)
        with pytest.raises(NotFound):
            provider.get(instance.provider_id)
    listed = len(fake_compute.calls("zone_operation_list"))

    # The first VM's preemption was forgotten for the later two: asked again.
    with pytest.raises(NotFound) as gone:
        provider.get(made[0].provider_id)

    assert gone.value.disruption is not None
    assert len(fake_compute.calls("zone_operation_list")) == listed + 1


# -- zone fallback ----------------------------------------------------------------


def test_each_zone_gets_its_own_operation_budget(fake_compute: FakeCompute) -> None:
    """A stockout reported late in one zone leaves the next zone a whole budget."""
    provider = GcpProvider(
        GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B, zones=[ZONE_C]),
        INSTALLATION,
        operation_timeout=12.0,
        guest_attribute_interval=0,
        **fake_compute.clients(),
    )
    provider.create(make_request("warm-up", zone=ZONE_D))  # firewall in place
    # Together longer than one budget, each well within its own: 5.5 s to
    # spare in each zone, for a loaded machine's slow replies (3 s was not).
    fake_compute.set_operation_seconds(6.5, zone=ZONE_B)
    fake_compute.set_operation_seconds(6.5, zone=ZONE_C)
    fake_compute.inject_error("insert", "stockout", zone=ZONE_B)
    req = make_request()

    instance = provider.create(req)

    assert instance.provider_id == f"{ZONE_C}/{req.name}"


def raw_config(providers: list[dict[str, Any]], cidrs: list[str] | None = None) -> dict[str, Any]:
    return {
        "installation": INSTALLATION,
        "proxy": {
            "auth": {"password_env": "PW"},
            "allowed_cidrs": list(CIDRS) if cidrs is None else cidrs,
        },
        "providers": providers,
    }


def gcp_entry(name: str = "gcp-eu", **settings: Any) -> dict[str, Any]:
    return {"name": name, "type": "gcp", "gcp": {"project": DEFAULT_PROJECT, **settings}}


def config_problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, environ={"PW": PASSWORD})
    return caught.value.problems


SUBNET_EU = "regions/europe-west1/subnetworks/proxies"


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (
            {"zone": ZONE_B, "zones": [ZONE_C, ZONE_US], "subnetwork": SUBNET_EU},
            f"providers[0].gcp: zones[1] '{ZONE_US}' is not in region 'europe-west1', "
            f"the region of subnetwork '{SUBNET_EU}'",
        ),
        (
            {"zone": ZONE_US, "subnetwork": f"projects/p/{SUBNET_EU}"},
            f"providers[0].gcp: zone '{ZONE_US}' is not in region 'europe-west1'",
        ),
        (
            {"zone": ZONE_B, "subnetwork": "proxies"},
            "providers[0].gcp: subnetwork 'proxies' must name its region",
        ),
        ({"zone": "europe-west1"}, "providers[0].gcp.zone: string should match pattern"),
        ({"zone": ZONE_B, "zones": ["B"]}, "providers[0].gcp.zones[0]: string should match"),
        (
            {"zone": ZONE_B, "zones": [ZONE_C, ZONE_D, "europe-west1-a", "europe-west1-e"]},
            "providers[0].gcp.zones: list should have at most 3 items",
        ),
        (
            {"zone": ZONE_B, "firewall_rule": "Proxies_EU"},
            "providers[0].gcp.firewall_rule: string should match pattern",
        ),
    ],
)
def test_zones_are_checked_at_config_load(settings: dict[str, Any], problem: str) -> None:
    problems = config_problems(raw_config([gcp_entry(**settings)]))

    assert any(p.startswith(problem) for p in problems), problems


@pytest.mark.parametrize(
    ("zone", "problem"),
    [
        ("../global/firewalls/x", "is not a zone name"),
        ("europe-west1-b/instances/x", "is not a zone name"),
        ("EUROPE-WEST1-B", "is not a zone name"),
        (ZONE_US, "is not in region 'europe-west1'"),
    ],
)
def test_a_placement_zone_is_a_zone_of_the_subnetworks_region(
    fake_compute: FakeCompute, zone: str, problem: str
) -> None:
    provider = make_provider(fake_compute, subnetwork=SUBNET_EU)

    with pytest.raises(Permanent, match=re.escape(problem)) as caught:
        provider.create(make_request(zone=zone))

    assert "placement.zone" in str(caught.value)
    assert fake_compute.calls() == []
    settings = GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B, subnetwork=SUBNET_EU)
    assert settings.placement_problems({"zone": ZONE_C}) == []


def test_zones_in_the_subnetworks_region_load() -> None:
    config = parse_config(
        raw_config([gcp_entry(zone=ZONE_B, zones=[ZONE_C, ZONE_D], subnetwork=SUBNET_EU)]),
        environ={"PW": PASSWORD},
    )

    assert config.provider("gcp-eu").settings == GcpConfig(
        project=DEFAULT_PROJECT, zone=ZONE_B, zones=[ZONE_C, ZONE_D], subnetwork=SUBNET_EU
    )


# -- firewall rules: one address family, one network ---------------------------------


def test_firewall_admits_the_ipv4_ranges_of_a_mixed_allowlist(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    """A rule holds one family; the VMs have an IPv4 external address only."""
    provider.create(make_request(cidrs=("192.0.2.0/24", "2001:db8::/32", "10.0.0.0/8")))

    rule = fake_compute.firewall(FIREWALL)
    assert rule is not None
    assert rule["sourceRanges"] == ["10.0.0.0/8", "192.0.2.0/24"]


def test_an_ipv6_only_allowlist_is_a_config_error_for_gcp_only() -> None:
    problems = config_problems(raw_config([gcp_entry(zone=ZONE_B)], cidrs=["2001:db8::/32"]))
    assert problems == [
        "proxy.allowed_cidrs: no IPv4 range, but providers[0] (gcp-eu) is of type gcp, "
        "whose VMs are reachable on an IPv4 external address only"
    ]

    local = {"name": "laptop", "type": "local"}
    assert parse_config(raw_config([local], cidrs=["2001:db8::/32"]), environ={"PW": PASSWORD})


def test_two_providers_on_different_networks_need_their_own_firewall_rules(
    fake_compute: FakeCompute,
) -> None:
    eu = gcp_entry("gcp-eu", zone=ZONE_B)
    proxies = gcp_entry("gcp-proxies", zone=ZONE_C, network="global/networks/proxies")
    other_project = {**gcp_entry("gcp-other", zone=ZONE_C, network="global/networks/x")}
    other_project["gcp"]["project"] = "another-project"

    problems = config_problems(raw_config([eu, proxies, other_project]))

    assert problems == [
        "providers[1].gcp.network: 'global/networks/proxies' shares firewall rule "
        f"'{FIREWALL}' in project '{DEFAULT_PROJECT}' as providers[0], which is on "
        "'global/networks/default' (rule names are unique per project): set "
        "gcp.firewall_rule to a name of its own"
    ]

    proxies["gcp"]["firewall_rule"] = "proxy-operator-prod-eu-proxies"
    config = parse_config(raw_config([eu, proxies]), environ={"PW": PASSWORD})
    for entry in config.providers:
        settings = entry.settings
        assert isinstance(settings, GcpConfig)
        GcpProvider(settings, INSTALLATION, **fake_compute.clients()).create(make_request())
    for name, network in [(FIREWALL, "default"), ("proxy-operator-prod-eu-proxies", "proxies")]:
        rule = fake_compute.firewall(name)
        assert rule is not None and rule["network"].endswith(f"/global/networks/{network}")


def test_two_providers_sharing_a_rule_must_share_its_target_tag() -> None:
    problems = config_problems(
        raw_config(
            [
                gcp_entry("gcp-eu", zone=ZONE_B),
                gcp_entry("gcp-tagged", zone=ZONE_C, network_tag="corp-proxies"),
            ]
        )
    )

    assert len(problems) == 1 and problems[0].startswith(
        "providers[1].gcp.network_tag: 'corp-proxies' shares firewall rule"
    )


def test_a_rule_of_that_name_on_another_network_is_not_taken_over(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    """Another worker's provider, configured elsewhere, owns the rule on its network."""
    theirs = {
        "name": FIREWALL,
        "network": "global/networks/other",
        "sourceRanges": ["198.51.100.0/24"],
        "allowed": [{"IPProtocol": "tcp", "ports": ["3128"]}],
        "targetTags": [FIREWALL],
    }
    fake_compute.put_firewall(theirs)

    with pytest.raises(Permanent, match=re.escape("set gcp.firewall_rule")):
        provider.create(make_request())

    rule = fake_compute.firewall(FIREWALL)
    assert rule is not None and rule["sourceRanges"] == ["198.51.100.0/24"]
    assert fake_compute.calls("firewall_update") == []
    assert fake_compute.calls("insert") == []


# -- acting only on what is ours ------------------------------------------------------


def test_delete_refuses_instances_that_are_not_this_installations(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    staging = GcpProvider(
        GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B), "staging", **fake_compute.clients()
    )
    theirs = staging.create(make_request("staging-proxy", installation="staging"))
    # Labels can be copied; the exact tags in metadata are what counts.
    fake_compute.add_instance(ZONE_B, "hand-made", labels={"managed-by": "proxy-operator"})

    for provider_id in (theirs.provider_id, f"{ZONE_B}/hand-made"):
        with pytest.raises(Permanent, match="not managed by this installation"):
            provider.delete(provider_id)

    assert fake_compute.instance_keys() == {(ZONE_B, theirs.name), (ZONE_B, "hand-made")}
    assert fake_compute.calls("delete") == []


@pytest.mark.parametrize(
    ("tags", "named"),
    [
        ({}, MANAGED_BY_KEY),
        (owner_tags("staging", "proxy-eu-1", 1), INSTALLATION_KEY),
        (owner_tags(INSTALLATION, "someone-else", 1), OWNER_KEY),
        (owner_tags(INSTALLATION, "proxy-eu-1", 2), GENERATION_KEY),
        (owner_tags(INSTALLATION, "proxy-eu-1", 1, namespace="staging"), NAMESPACE_KEY),
    ],
)
@pytest.mark.parametrize("zones", [[], [ZONE_C]])
def test_create_never_adopts_an_instance_it_did_not_make(
    fake_compute: FakeCompute, tags: dict[str, str], named: str, zones: list[str]
) -> None:
    """Same name, other tags: another installation's, another owner's, or hand-made."""
    req = make_request("proxy-eu-1", namespace="default")
    fake_compute.add_instance(
        ZONE_B, req.name, metadata={"proxy-operator-tags": json.dumps(tags)}, nat_ip="192.0.2.9"
    )

    with pytest.raises(Permanent, match="not this proxy's") as caught:
        make_provider(fake_compute, zones=zones).create(req)

    assert named in str(caught.value)
    assert fake_compute.instance_keys() == {(ZONE_B, req.name)}
