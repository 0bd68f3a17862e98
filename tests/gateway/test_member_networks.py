"""The gateway's second wall: `--member-networks`, its default, and the endpoints it refuses."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from gateway import metrics
from gateway.main import UsageError, member_networks, parse_args
from gateway.member_networks import Gatekeeper, MemberNetworks, parse_networks
from providers.config import Config, parse_config
from squid.gateway import GatewayMember
from tests.helpers.config import PASSWORD, PASSWORD_ENV, local_entry, raw_config

FLAG = "--member-networks"


def config_with(*entries: dict[str, Any]) -> Config:
    raw = raw_config(entries[0], connect_ports=[443])
    raw["providers"] = list(entries)
    return parse_config(raw, environ={PASSWORD_ENV: PASSWORD})


def allowed_by(config: Config, *argv: str) -> MemberNetworks:
    return member_networks(parse_args(["--pool", "web", *argv]), config)


def test_bad_cidrs_are_each_named_with_the_flag(tmp_path: Path) -> None:
    config = config_with(local_entry(tmp_path))
    with pytest.raises(UsageError) as caught:
        allowed_by(config, FLAG, "10.0.0.0/8,10.0.0.1/8,nonsense, ::1/128")
    message = str(caught.value)
    assert message.startswith(FLAG)
    assert "bad CIDR '10.0.0.1/8'" in message and "bad CIDR 'nonsense'" in message
    assert "'10.0.0.0/8'" not in message and "::1/128" not in message


@pytest.mark.parametrize(
    ("bind_address", "expected"),
    [
        ("127.0.0.1", "127.0.0.1/32"),
        ("0.0.0.0", "127.0.0.1/32"),
        ("::", "::1/128"),
        ("10.1.2.3", "10.1.2.3/32"),
    ],
)
def test_by_default_local_members_may_be_only_where_the_local_provider_publishes_them(
    tmp_path: Path, bind_address: str, expected: str
) -> None:
    entry = local_entry(tmp_path)
    entry["local"]["bind_address"] = bind_address
    allowed = allowed_by(config_with(entry))
    assert [str(network) for network in allowed.networks] == [expected]
    assert not allowed.allow_hostnames


def test_kubernetes_and_gcp_entries_need_the_flag_and_are_named(tmp_path: Path) -> None:
    config = config_with(
        local_entry(tmp_path),
        {"name": "cluster", "type": "kubernetes", "kubernetes": {}},
        {"name": "cloud", "type": "gcp", "gcp": {"project": "p", "zone": "europe-west1-b"}},
    )
    with pytest.raises(UsageError) as caught:
        allowed_by(config)
    message = str(caught.value)
    assert f"{FLAG} (or PROXY_OPERATOR_GATEWAY_MEMBER_NETWORKS) is required" in message
    assert "providers[1] (cluster, type kubernetes)" in message
    assert "providers[2] (cloud, type gcp)" in message
    assert "providers[0]" not in message

    allowed = allowed_by(config, FLAG, "10.244.0.0/16,2001:db8::/32", "--allow-member-hostnames")
    assert [str(n) for n in allowed.networks] == ["10.244.0.0/16", "2001:db8::/32"]
    assert allowed.allow_hostnames


def refused_count(reason: str) -> float:
    sample = REGISTRY.get_sample_value(
        "proxy_operator_gateway_refused_endpoints_total", {"reason": reason}
    )
    return sample or 0.0


def test_endpoints_outside_the_networks_and_hostnames_are_refused_logged_and_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gatekeeper = Gatekeeper(MemberNetworks(parse_networks("127.0.0.1/32,2001:db8::/32", FLAG)))
    real = [GatewayMember("web/0", "127.0.0.1", 20000), GatewayMember("web/1", "2001:db8::7", 3128)]
    forged = [
        GatewayMember("web/2", "127.0.0.2", 3128),
        GatewayMember("web/3", "::ffff:127.0.0.1", 3128),  # IPv4-mapped: not the IPv4 network
        GatewayMember("web/4", "10.0.0.1", 3128),
    ]
    named = GatewayMember("web/5", "localhost", 20000)  # resolves inside, refused anyway
    before = refused_count(metrics.REFUSED_NETWORK), refused_count(metrics.REFUSED_HOSTNAME)

    with caplog.at_level(logging.WARNING, logger="proxy_operator.gateway"):
        assert gatekeeper.admit([*real, *forged, named]) == real
        assert gatekeeper.admit([*real, *forged, named]) == real  # the next poll
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 4, refusals
    assert (
        "refusing member 'web/2' at 127.0.0.2:3128 as a parent: "
        "outside the member networks (127.0.0.1/32, 2001:db8::/32)"
    ) in refusals
    assert any("'web/5' at localhost:20000" in r and "a hostname" in r for r in refusals)
    after = refused_count(metrics.REFUSED_NETWORK), refused_count(metrics.REFUSED_HOSTNAME)
    assert (after[0] - before[0], after[1] - before[1]) == (3, 1)

    # Gone from the answer and back: a new appearance, reported again.
    assert gatekeeper.admit(real) == real
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="proxy_operator.gateway"):
        assert gatekeeper.admit([*real, forged[0]]) == real
    assert len(caplog.records) == 1
    assert refused_count(metrics.REFUSED_NETWORK) - before[0] == 4


def test_hostnames_pass_only_when_allowed() -> None:
    networks = parse_networks("10.0.0.0/8", FLAG)
    named = GatewayMember("web/0", "proxy-0.internal", 3128)
    assert Gatekeeper(MemberNetworks(networks, allow_hostnames=True)).admit([named]) == [named]
    assert Gatekeeper(MemberNetworks(networks)).admit([named]) == []


def test_a_long_forged_member_id_is_cut_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    gatekeeper = Gatekeeper(MemberNetworks(parse_networks("127.0.0.1/32", FLAG)))
    with caplog.at_level(logging.WARNING, logger="proxy_operator.gateway"):
        gatekeeper.admit([GatewayMember("x" * 10_000, "10.0.0.1", 3128)])
    assert len(caplog.records[0].getMessage()) < 300
