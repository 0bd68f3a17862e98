"""The provider core: naming, error taxonomy, metrics decorator, registry, config."""

from __future__ import annotations

import copy
import ipaddress
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from activities.models import InstanceRef
from providers.base import CreateRequest, Instance, InstanceState, Provider
from providers.catalog import TYPE_NAMES, provider_type
from providers.config import ConfigError, load_config, parse_config
from providers.errors import TAXONOMY, NotFound, ProviderError, Transient, classify
from providers.local import LocalProvider
from providers.memory import MemoryProvider
from providers.metrics import MeteredProvider, ProviderMetrics
from providers.naming import (
    GENERATION_KEY,
    INSTALLATION_KEY,
    MANAGED_BY_KEY,
    OWNER_KEY,
    RFC1035_LABEL,
    instance_name,
    owner_tags,
    ownership_mismatch,
)
from providers.registry import build_providers
from squid.conf import DEFAULT_DENIED_DESTINATIONS, ProxySettings

REPO = Path(__file__).resolve().parents[2]
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

# -- naming --------------------------------------------------------------------


def test_names_are_unique_valid_and_deterministic() -> None:
    owners = [f"proxy-eu-{i}" for i in range(10_000)]
    names = [instance_name(owner, 0) for owner in owners]
    assert len(set(names)) == len(owners)
    for name in names:
        assert len(name) == 22
        assert RFC1035_LABEL.fullmatch(name), name
        assert DNS1123_LABEL.fullmatch(name), name
    assert names == [instance_name(owner, 0) for owner in owners]
    next_generation = [instance_name(owner, 1) for owner in owners]
    assert all(a != b for a, b in zip(names, next_generation, strict=True))
    assert set(names).isdisjoint(next_generation)


def test_user_labels_cannot_overwrite_the_tags_gc_relies_on() -> None:
    tags = owner_tags("prod", "proxy-eu-1", 3, {"managed-by": "me", "team": "crawl"})
    assert tags[MANAGED_BY_KEY] == "proxy-operator"
    assert tags[INSTALLATION_KEY] == "prod"
    assert tags[OWNER_KEY] == "proxy-eu-1"
    assert tags[GENERATION_KEY] == "3"
    assert tags["label/managed-by"] == "me"
    assert tags["label/team"] == "crawl"


# -- error taxonomy ------------------------------------------------------------


def test_unknown_exceptions_are_transient_with_their_cause() -> None:
    cause = ConnectionResetError("peer reset")
    error = classify(cause)
    assert type(error) is Transient
    assert error.cause is cause
    assert error.__cause__ is cause
    assert "ConnectionResetError" in str(error) and "peer reset" in str(error)


@pytest.mark.parametrize("kind", TAXONOMY)
def test_classified_errors_pass_through(kind: type[ProviderError]) -> None:
    error = kind("as is", retry_after_seconds=60)
    assert classify(error) is error
    assert error.retry_after_seconds == 60


# -- metrics decorator ---------------------------------------------------------


class StubProvider:
    """Answers every operation with `outcome`: an exception to raise, or success."""

    def __init__(self) -> None:
        self.outcome: BaseException | None = None

    def _answer(self) -> Instance:
        if self.outcome is not None:
            raise self.outcome
        return Instance(
            provider_id="stub/one",
            name="one",
            state=InstanceState.RUNNING,
            ip="192.0.2.1",
            port=3128,
            tags={},
            created_at=datetime.now(UTC),
        )

    def create(self, req: CreateRequest) -> Instance:
        return self._answer()

    def get(self, provider_id: str) -> Instance:
        return self._answer()

    def delete(self, provider_id: str) -> None:
        self._answer()

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        return [self._answer()]


OPERATIONS: dict[str, Callable[[Provider], object]] = {
    "create": lambda p: p.create(
        CreateRequest(
            name="one",
            proxy=ProxySettings(3128, "u", "p", ("10.0.0.0/8",), (443,)),
            tags={},
        )
    ),
    "get": lambda p: p.get("stub/one"),
    "delete": lambda p: p.delete("stub/one"),
    "list_by_tag": lambda p: p.list_by_tag("k", "v"),
}


def calls(registry: CollectorRegistry, operation: str, outcome: str) -> float:
    labels = {"provider": "stub", "operation": operation, "outcome": outcome}
    return registry.get_sample_value("proxy_operator_provider_calls_total", labels) or 0.0


@pytest.mark.parametrize("operation", OPERATIONS)
def test_metered_provider_counts_every_outcome(operation: str) -> None:
    registry = CollectorRegistry()
    stub = StubProvider()
    metered = MeteredProvider(stub, "stub", ProviderMetrics(registry))
    assert isinstance(metered, Provider)
    call = OPERATIONS[operation]

    call(metered)
    assert calls(registry, operation, "ok") == 1

    for kind in TAXONOMY:
        stub.outcome = kind("boom")
        with pytest.raises(kind):
            call(metered)
        assert calls(registry, operation, kind.__name__) == 1

    # Outside the taxonomy: normalised to Transient at the edge, cause kept.
    unexpected = RuntimeError("sdk exploded")
    stub.outcome = unexpected
    with pytest.raises(Transient) as caught:
        call(metered)
    assert caught.value.cause is unexpected
    assert calls(registry, operation, "Transient") == 2

    latency = registry.get_sample_value(
        "proxy_operator_provider_call_seconds_count",
        {"provider": "stub", "operation": operation, "outcome": "ok"},
    )
    assert latency == 1


# -- registry ------------------------------------------------------------------


def minimal_config(*providers: dict[str, Any]) -> dict[str, Any]:
    return {
        "installation": "test",
        "proxy": {"auth": {"password_env": "PROXY_PASSWORD"}, "allowed_cidrs": ["10.0.0.0/8"]},
        "providers": list(providers) or [{"name": "local", "type": "local"}],
    }


ENVIRON = {"PROXY_PASSWORD": "from-the-environment"}


def test_registry_builds_each_entry_through_its_type_and_meters_it(tmp_path: Path) -> None:
    config = parse_config(
        minimal_config(
            {"name": "here", "type": "local", "local": {"state_dir": str(tmp_path)}},
            {"name": "demo", "type": "memory"},
        ),
        environ=ENVIRON,
    )
    providers = build_providers(config)
    assert set(providers) == {"here", "demo"}
    assert all(isinstance(p, MeteredProvider) for p in providers.values())
    here, demo = providers["here"], providers["demo"]
    assert isinstance(here, MeteredProvider) and isinstance(demo, MeteredProvider)
    assert isinstance(here.inner, LocalProvider) and isinstance(demo.inner, MemoryProvider)
    # The memory type keeps the whole contract, through the same metering.
    request = CreateRequest(
        name="one", proxy=ProxySettings(3128, "u", "p", ("10.0.0.0/8",), (443,)), tags={"k": "v"}
    )
    created = demo.create(request)
    assert demo.list_by_tag("k", "v") == [created] == [demo.create(request)]
    demo.delete(created.provider_id)
    with pytest.raises(NotFound):
        demo.get(created.provider_id)


def test_every_type_in_the_catalog_declares_itself() -> None:
    declared = {name: provider_type(name) for name in TYPE_NAMES}
    assert {name: t.name for name, t in declared.items()} == {name: name for name in TYPE_NAMES}
    assert {name: set(t.placement_keys) for name, t in declared.items()} == {
        "local": set(),
        "kubernetes": {"namespace"},
        "gcp": {"zone"},
        "aws": {"subnet"},
        "memory": set(),
    }


@pytest.mark.parametrize("kind", ["local", "kubernetes", "gcp", "aws"])
def test_from_config_refuses_a_block_of_another_type_the_same_way(kind: str) -> None:
    config = parse_config(minimal_config({"name": "odd", "type": "memory"}), environ=ENVIRON)
    with pytest.raises(TypeError) as caught:
        provider_type(kind).build(config.provider("odd"), config)
    assert str(caught.value) == f"provider 'odd' is of type 'memory', not {kind!r}"


def test_a_local_only_worker_never_imports_the_cloud_sdks(tmp_path: Path) -> None:
    # A fresh interpreter: this test session has imported every SDK already.
    # (Temporal's client loads google.protobuf, which is no cloud SDK.)
    script = f"""
import sys
import worker
from providers.config import parse_config
from providers.registry import build_providers
raw = {minimal_config({"name": "here", "type": "local", "local": {"state_dir": str(tmp_path)}})!r}
build_providers(parse_config(raw, environ={ENVIRON!r}))
sdks = (
    "kubernetes", "google.cloud", "google.auth", "google.api_core", "providers.gcp",
    "boto3", "botocore", "providers.aws",
)
print(sorted(m for m in sys.modules if m.startswith(sdks) or m == "providers.kubernetes"))
"""
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == "[]"


# -- config --------------------------------------------------------------------


def broken(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    raw = minimal_config()
    change(raw)
    return raw


def add_providers(*entries: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda raw: raw["providers"].extend(copy.deepcopy(entries))


def set_in(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set a dotted path (list indexes as numbers) in the raw config."""

    def change(raw: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = raw
        for key in parents:
            node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
        node[last] = value

    return change


def several(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def change(raw: dict[str, Any]) -> None:
        for one in changes:
            one(raw)

    return change


BROKEN_CONFIGS: dict[str, tuple[dict[str, Any], dict[str, str], list[str]]] = {
    "missing gcp.project": (
        broken(
            add_providers(
                {"name": "cluster", "type": "kubernetes", "kubernetes": {}},
                {"name": "cloud", "type": "gcp", "gcp": {"zone": "europe-west1-b"}},
            )
        ),
        ENVIRON,
        ["providers[2].gcp.project: field required"],
    ),
    "duplicate name": (
        broken(add_providers({"name": "local", "type": "local"})),
        ENVIRON,
        ["providers[1].name: duplicate 'local'"],
    ),
    "unknown type": (
        broken(add_providers({"name": "azure", "type": "azure"})),
        ENVIRON,
        [
            "providers[1].type: unknown type 'azure' "
            "(expected one of local, kubernetes, gcp, aws, memory)"
        ],
    ),
    "block of another type": (
        broken(add_providers({"name": "cloud", "type": "gcp", "kubernetes": {}})),
        ENVIRON,
        [
            "providers[1].kubernetes: block belongs to type 'kubernetes', not 'gcp'",
            "providers[1].gcp: field required for type 'gcp'",
        ],
    ),
    "a block that is null, and the settings field written by hand": (
        broken(
            several(
                add_providers({"name": "cluster", "type": "kubernetes", "kubernetes": None}),
                set_in("providers.0.settings", {"state_dir": "/tmp/x"}),
            )
        ),
        ENVIRON,
        [
            "providers[1].kubernetes: field required for type 'kubernetes'",
            "providers[0].settings: unknown key",
        ],
    ),
    "problems in the entry and in its block, all of them": (
        broken(
            add_providers(
                {"name": "Bad Name", "type": "gcp", "gcp": {"zone": 5}, "region": "eu"},
                {"name": "demo", "type": "memory", "memory": {"instances": 3}},
            )
        ),
        ENVIRON,
        [
            "providers[1].name: string should match pattern '^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$'",
            "providers[1].region: unknown key",
            "providers[1].gcp.project: field required",
            "providers[1].gcp.zone: input should be a valid string",
            "providers[2].memory.instances: unknown key",
        ],
    ),
    "unknown keys at every depth": (
        broken(
            several(
                set_in("colour", "blue"),
                set_in("proxy.auth.token", "x"),
                set_in("providers.0.local", {"state_dir": "/tmp/x", "ports": 3}),
            )
        ),
        ENVIRON,
        [
            "colour: unknown key",
            "proxy.auth.token: unknown key",
            "providers[0].local.ports: unknown key",
        ],
    ),
    "bad CIDRs, all of them": (
        broken(set_in("proxy.allowed_cidrs", ["10.0.0.1/8", "10.0.0.0/8", "nope"])),
        ENVIRON,
        [
            "proxy.allowed_cidrs: bad CIDR '10.0.0.1/8': 10.0.0.1/8 has host bits set; "
            "bad CIDR 'nope': 'nope' does not appear to be an IPv4 or IPv6 network"
        ],
    ),
    "bad ports": (
        broken(
            several(
                set_in("proxy.port", 0),
                set_in("proxy.allowed_connect_ports", [443, 70000]),
                set_in("providers.0.local", {"first_port": 0}),
            )
        ),
        ENVIRON,
        [
            "proxy.port: input should be greater than or equal to 1",
            "proxy.allowed_connect_ports[1]: input should be less than or equal to 65535",
            "providers[0].local.first_port: input should be greater than or equal to 1",
        ],
    ),
    "secret env var not set": (
        broken(lambda raw: None),
        {},
        ["proxy.auth.password_env: environment variable PROXY_PASSWORD is not set"],
    ),
    "password_file missing": (
        broken(set_in("proxy.auth", {"password_file": "/nonexistent/proxy-password"})),
        ENVIRON,
        [
            "proxy.auth.password_file: cannot read /nonexistent/proxy-password: "
            "No such file or directory"
        ],
    ),
    "two password sources": (
        broken(set_in("proxy.auth.password_file", "/etc/hostname")),
        ENVIRON,
        ["proxy.auth: set exactly one of password_env, password_file"],
    ),
    "a password too short to withstand guessing, named without being shown": (
        broken(lambda raw: None),
        {"PROXY_PASSWORD": "fifteen-chars-x"},
        [
            "proxy.auth.password_env: the password in environment variable PROXY_PASSWORD "
            "has 15 characters, at least 16 are required (e.g. openssl rand -base64 24)"
        ],
    ),
    "an empty port range": (
        broken(set_in("providers.0.local", {"first_port": 21000, "last_port": 20999})),
        ENVIRON,
        ["providers[0].local.last_port: must be at least first_port (21000), not 20999"],
    ),
    "a name among the denied destinations (Squid's dst list takes addresses)": (
        broken(set_in("proxy.denied_destinations", ["169.254.169.254", "metadata.google"])),
        ENVIRON,
        [
            "proxy.denied_destinations: bad CIDR 'metadata.google': "
            "'metadata.google' does not appear to be an IPv4 or IPv6 network",
        ],
    ),
    "a destination exception that is not one IPv4 address and port": (
        broken(
            set_in(
                "proxy.destination_exceptions",
                ["127.0.0.1:8443", "127.0.0.0/8:8443", "localhost:8443", "[::1]:8443", "127.0.0.1"],
            )
        ),
        ENVIRON,
        [
            "proxy.destination_exceptions: "
            + "; ".join(
                f"{bad!r} is not an IPv4 address and port, such as 127.0.0.1:8443"
                for bad in ("127.0.0.0/8:8443", "localhost:8443", "[::1]:8443", "127.0.0.1")
            )
        ],
    ),
    "denied destinations not a list": (
        broken(set_in("proxy.denied_destinations", "10.0.0.0/8")),
        ENVIRON,
        ["proxy.denied_destinations: input should be a valid list"],
    ),
}


@pytest.mark.parametrize("case", BROKEN_CONFIGS)
def test_broken_configs_report_every_problem_with_its_path(case: str) -> None:
    raw, environ, expected = BROKEN_CONFIGS[case]
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, source="broken.yaml", environ=environ)
    assert sorted(caught.value.problems) == sorted(expected)
    assert str(caught.value).startswith("invalid providers config broken.yaml:")


def test_password_file_is_read_and_stripped(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("from-a-file-of-20-ch\n")
    raw = broken(set_in("proxy.auth", {"password_file": str(secret)}))
    assert parse_config(raw, environ={}).proxy_settings().password == "from-a-file-of-20-ch"
    # Length is counted after stripping, and in characters.
    secret.write_text("  short-password \n")
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, environ={})
    assert caught.value.problems == [
        f"proxy.auth.password_file: the password in {secret} has 14 characters, "
        "at least 16 are required (e.g. openssl rand -base64 24)"
    ]
    assert "short-password" not in str(caught.value)
    secret.write_text("ünïcödé-päßwörd-16")
    assert parse_config(raw, environ={}).proxy_settings().password == "ünïcödé-päßwörd-16"


def test_destinations_are_denied_by_default_and_a_configured_list_replaces_them() -> None:
    default = parse_config(minimal_config(), environ=ENVIRON).proxy_settings()
    assert default.denied_destinations == DEFAULT_DENIED_DESTINATIONS
    for private in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "100.64.0.1", "::1", "fd00::1"):
        address = ipaddress.ip_address(private)
        assert any(address in ipaddress.ip_network(c) for c in default.denied_destinations)

    listed = broken(set_in("proxy.denied_destinations", ["169.254.169.254", "FD00::/8"]))
    settings = parse_config(listed, environ=ENVIRON).proxy_settings()
    assert settings.denied_destinations == ("169.254.169.254/32", "fd00::/8")
    nothing = broken(set_in("proxy.denied_destinations", []))
    assert parse_config(nothing, environ=ENVIRON).proxy_settings().denied_destinations == ()


def test_destination_exceptions_reach_squid_as_address_and_port() -> None:
    assert (
        parse_config(minimal_config(), environ=ENVIRON).proxy_settings().destination_exceptions
        == ()
    )
    raw = broken(set_in("proxy.destination_exceptions", ["127.0.0.1:8443", "10.0.0.7:443"]))
    settings = parse_config(raw, environ=ENVIRON).proxy_settings()
    assert settings.destination_exceptions == (("127.0.0.1", 8443), ("10.0.0.7", 443))
    assert settings.denied_destinations == DEFAULT_DENIED_DESTINATIONS


def test_cidrs_reach_providers_in_one_spelling() -> None:
    # 0.0.0.0/0.0.0.0 is 0.0.0.0/0: it must meet the all-IPv4 special cases as such.
    raw = broken(set_in("proxy.allowed_cidrs", ["0.0.0.0/0.0.0.0", "10.0.0.0/255.0.0.0"]))
    settings = parse_config(raw, environ=ENVIRON).proxy_settings()
    assert settings.allowed_cidrs == ("0.0.0.0/0", "10.0.0.0/8")


def test_risky_but_valid_settings_are_logged_once_at_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    raw = broken(
        several(
            set_in("proxy.allowed_cidrs", ["0.0.0.0/0.0.0.0", "::/0"]),
            set_in("proxy.denied_destinations", []),
        )
    )
    path = tmp_path / "providers.yaml"
    path.write_text(yaml.safe_dump(raw))
    with caplog.at_level(logging.WARNING, logger="providers.config"):
        load_config(path, environ=ENVIRON)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings
    assert all(w.startswith(f"{path}: proxy.") for w in warnings)
    assert any("0.0.0.0/0 admits every IPv4 client" in w for w in warnings)
    assert any("::/0 admits every IPv6 client" in w for w in warnings)
    assert any("denied_destinations: empty" in w for w in warnings)

    caplog.clear()
    load_config(REPO / "deploy/local/providers.yaml", environ=ENVIRON)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_the_shipped_local_config_loads() -> None:
    config = load_config(REPO / "deploy/local/providers.yaml", environ=ENVIRON)
    assert config.provider("local").type == "local"
    settings = config.proxy_settings()
    assert settings.password == ENVIRON["PROXY_PASSWORD"]
    assert settings.allowed_cidrs == ("127.0.0.0/8",)
    assert ENVIRON["PROXY_PASSWORD"] not in repr(config) + repr(settings)


def test_unreadable_and_invalid_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config(tmp_path / "missing.yaml", environ=ENVIRON)
    bad = tmp_path / "bad.yaml"
    bad.write_text("providers: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ=ENVIRON)


def test_ownership_mismatch_names_every_wrong_tag() -> None:
    ours = owner_tags("prod", "proxy-a", 2)
    assert ownership_mismatch(ours, "prod") is None
    assert ownership_mismatch(ours, "prod", owner_id="proxy-a", generation=2) is None
    foreign = ownership_mismatch(ours, "staging")
    assert foreign is not None and "staging" in foreign and INSTALLATION_KEY in foreign
    other_owner = ownership_mismatch(ours, "prod", owner_id="proxy-b", generation=3)
    assert other_owner is not None
    assert OWNER_KEY in other_owner and GENERATION_KEY in other_owner
    hand_made = ownership_mismatch({}, "prod")
    assert hand_made is not None and MANAGED_BY_KEY in hand_made


@pytest.mark.parametrize(
    ("ip", "expected"),
    [
        ("10.244.1.7", "10.244.1.7:3128"),
        ("fd00:10:244::7", "[fd00:10:244::7]:3128"),
        ("", ""),
    ],
)
def test_endpoints_bracket_ipv6_addresses_for_instances_and_workflow_refs(
    ip: str, expected: str
) -> None:
    """`host:port` parsers and proxy URLs need `[addr]:port`; every provider shares this."""
    instance = Instance("p/x", "x", InstanceState.RUNNING, ip, 3128, {}, datetime.now(UTC))
    ref = InstanceRef(provider="p", provider_id="p/x", name="x", generation=0, ip=ip, port=3128)

    assert instance.endpoint == ref.endpoint == expected
