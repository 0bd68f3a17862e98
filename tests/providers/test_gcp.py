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
from providers.config import parse_config
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded, Transient
from providers.gcp import GcpConfig, GcpProvider
from providers.naming import INSTALLATION_KEY, OWNER_KEY, instance_name, owner_tags, short_hash
from providers.squid import ProxySettings, sha512_crypt
from tests.conftest import RealCredentialsForbidden
from tests.fakes.compute import DEFAULT_PROJECT, DEFAULT_ZONES, FakeCompute, remote
from tests.fakes.compute import fake_compute_fixture as fake_compute_fixture

ZONE_B, ZONE_C, ZONE_D = DEFAULT_ZONES[:3]
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
) -> CreateRequest:
    return CreateRequest(
        name=instance_name(owner, 1),
        proxy=proxy_settings(port),
        tags=owner_tags(installation, owner, 1, labels),
        placement={"zone": zone} if zone else {},
    )


def make_provider(fake: FakeCompute, **settings: Any) -> GcpProvider:
    config = GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B, **settings)
    return GcpProvider(config, INSTALLATION, **fake.clients())


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
    assert "scheduling" not in body
    assert "serviceAccounts" not in body
    metadata = metadata_of(body)
    assert json.loads(metadata["proxy-operator-tags"]) == req.tags
    assert metadata["proxy-operator-port"] == "3128"
    script = metadata["startup-script"]
    assert "apt-get install -y -q --no-install-recommends squid" in script
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
    fake_compute.set_status(ZONE_B, created.name, status, nat_ip=nat_ip)

    instance = provider.get(created.provider_id)

    assert instance.state is state
    # An address is published only with RUNNING, and RUNNING only with one.
    assert instance.ip == (nat_ip if state is InstanceState.RUNNING else "")
    assert instance.endpoint == (f"{nat_ip}:3128" if state is InstanceState.RUNNING else "")


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
    fake_compute.set_status(ZONE_B, req.name, "RUNNING", nat_ip="203.0.113.10")

    # A retried activity, possibly on another worker with a fresh provider.
    again = make_provider(fake_compute).create(req)

    assert again.provider_id == first.provider_id
    assert again.state is InstanceState.RUNNING
    assert again.ip == "203.0.113.10"
    assert fake_compute.instance_keys() == {(ZONE_B, req.name)}
    assert inserted_zones(fake_compute) == [ZONE_B, ZONE_B]  # the second one got a 409


def test_delete_waits_for_the_operation_and_is_idempotent(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    created = provider.create(make_request())

    provider.delete(created.provider_id)

    assert fake_compute.instance(ZONE_B, created.name) is None
    with pytest.raises(NotFound):
        provider.get(created.provider_id)
    provider.delete(created.provider_id)  # already gone: success
    assert len(fake_compute.calls("delete")) == 2


# -- list_by_tag ----------------------------------------------------------------


def test_list_by_tag_finds_tagged_instances_in_every_zone(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    ours = [make_request(f"proxy-{zone}", zone=zone) for zone in (ZONE_B, ZONE_C, ZONE_D)]
    for req in ours:
        provider.create(req)
    provider.create(make_request("other-installation", zone=ZONE_C, installation="staging"))
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

    assert len(fake_compute.calls("firewall_get")) == 1
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


def test_empty_allowed_cidrs_never_open_the_port_to_everyone(
    fake_compute: FakeCompute, provider: GcpProvider
) -> None:
    req = make_request()
    req = CreateRequest(
        name=req.name, proxy=proxy_settings(cidrs=()), tags=req.tags, placement=req.placement
    )

    with pytest.raises(Permanent):
        provider.create(req)

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
    # the VM in ZONE_C instead of starting a second one in ZONE_B.
    fake_compute.clear_errors()
    assert make_provider(fake_compute, zones=[ZONE_C, ZONE_D]).create(req) == instance
    assert inserted_zones(fake_compute) == [ZONE_B, ZONE_C]


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
    provider = GcpProvider(
        GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B),
        INSTALLATION,
        operation_timeout=0.3,
        **fake_compute.clients(),
    )
    provider.create(make_request("warm-up"))  # firewall in place
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
        ("get", "rate_limit", QuotaExceeded),
        ("get", "forbidden", Permanent),
        ("get", "bad_request", Permanent),
        ("insert", "quota", QuotaExceeded),
        ("insert", "quota_operation", QuotaExceeded),
        ("insert", "stockout", QuotaExceeded),
        ("insert", "forbidden", Permanent),
        ("insert", "bad_request", Permanent),
        ("insert", "not_found", Permanent),  # e.g. the image family does not exist
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

    assert provider.get(created.provider_id).endpoint == "127.0.0.1:3128"
    assert remote(fake_compute.url, "instance", zone=ZONE_B, name=created.name)["status"] == (
        "RUNNING"
    )
