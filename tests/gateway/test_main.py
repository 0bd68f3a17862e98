"""`proxy-operator-gateway`'s flags and the pool's answer: clear errors, no hang, no traceback."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from temporalio.testing import WorkflowEnvironment

from gateway.main import METRICS_ENV, UsageError, checked, parse_args
from gateway.membership import Endpoints, parse_endpoints
from gateway.users import hash_password
from providers.base import split_endpoint
from proxy_operator.username import gateway_account
from squid.gateway import GatewayMember
from tests.helpers.config import PASSWORD, PASSWORD_ENV, local_entry, raw_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["--pool (or PROXY_OPERATOR_GATEWAY_POOL) is required"]),
        (["--pool", "web", "--listen", "8888"], ["--listen: '8888' is not host:port"]),
        (["--pool", "web", "--listen", "0.0.0.0:99999"], ["--listen"]),
        (["--pool", "web", "--poll-interval", "0"], ["--poll-interval: 0.0 is not between"]),
        (
            ["--pool", "web", "--poll-interval", "0.01"],
            ["--poll-interval: 0.01 is not between 0.1 and 3600 seconds"],
        ),
        (["--pool", "web", "--poll-interval", "nan"], ["--poll-interval: nan is not between"]),
        (["--pool", "web", "--debounce", "-1"], ["--debounce: -1.0 is not between"]),
        (
            ["--pool", "eu", "--pool", "us", "--pool", "eu"],
            ["--pool (or PROXY_OPERATOR_GATEWAY_POOL): 'eu' given more than once"],
        ),
        (["--pool", "eu", "--pool", ""], ["--pool (or PROXY_OPERATOR_GATEWAY_POOL): an empty"]),
        (
            [arg for n in range(65) for arg in ("--pool", f"p{n}")],
            ["--pool (or PROXY_OPERATOR_GATEWAY_POOL): 65 pools, more than 64"],
        ),
    ],
)
def test_bad_flags_are_named(
    argv: list[str], expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROXY_OPERATOR_GATEWAY_POOL", raising=False)
    monkeypatch.setenv("PROXY_OPERATOR_CONFIG", "providers.yaml")
    with pytest.raises(UsageError) as caught:
        checked(parse_args(argv))
    for text in expected:
        assert text in str(caught.value)


@pytest.mark.parametrize(
    ("listed", "expected"),
    [
        ("eu,,us", "--pool (or PROXY_OPERATOR_GATEWAY_POOL): an empty pool id"),
        ("eu,", "--pool (or PROXY_OPERATOR_GATEWAY_POOL): an empty pool id"),
        ("eu, us,eu", "--pool (or PROXY_OPERATOR_GATEWAY_POOL): 'eu' given more than once"),
    ],
)
def test_a_bad_pool_list_in_the_environment_is_named(
    listed: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROXY_OPERATOR_GATEWAY_POOL", listed)
    monkeypatch.setenv("PROXY_OPERATOR_CONFIG", "providers.yaml")
    with pytest.raises(UsageError, match=re.escape(expected)):
        checked(parse_args([]))


def test_good_flags_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROXY_OPERATOR_CONFIG", "providers.yaml")
    assert checked(parse_args(["--pool", "web", "--listen", "[::1]:8888"])) == (
        ["web"],
        ("::1", 8888),
    )


def test_several_pools_come_from_repeated_flags_or_the_environments_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PROXY_OPERATOR_CONFIG", "providers.yaml")
    monkeypatch.setenv("PROXY_OPERATOR_GATEWAY_POOL", "eu-gce, us-ec2")
    assert checked(parse_args([]))[0] == ["eu-gce", "us-ec2"]
    # The flags, when given, are the whole list: the environment's is not added to them.
    assert checked(parse_args(["--pool", "a", "--pool", "b"]))[0] == ["a", "b"]


def test_metrics_listen_on_loopback_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener takes no token: reaching it from elsewhere is asked for (the manifests do)."""
    monkeypatch.delenv(METRICS_ENV, raising=False)
    host, _, _ = parse_args(["--pool", "web"]).metrics_address.rpartition(":")
    assert ipaddress.ip_address(host).is_loopback


@pytest.mark.parametrize(
    ("username", "account"),
    [
        ("proxy", "proxy"),
        ("proxy-session-a.b_C~1", "proxy"),
        ("proxy-proxy-web/3", "proxy"),
        ("proxy-session-", None),
        ("proxy-session-a b", None),
        ("proxy-session-" + "k" * 129, None),
        ("proxy-proxy-", None),
        ("proxy-proxy-web 3", None),
        ("proxyx", None),
        ("prox", None),
        ("other-session-a", None),
        ("", None),
        ("proxy-session-" + "k" * 128, "proxy"),
        ("proxy-session-a\n", None),  # fullmatch: no trailing newline slips through
        ("proxy-session-a\nproxy", None),
        ("proxy-proxy-web/3\n", None),
        ("proxy-proxy-" + "m" * 201, None),
        ("proxy-session-clé", None),
        ("proxy-session-a%0A", None),
        ("Proxy", None),
        ("proxy-session-proxy-proxy-web.3", "proxy"),  # a session key that looks like a pin
        ("proxy-zone-europe-west1-b", "proxy"),
        ("proxy-region-europe-west1-provider-gcp-session-cart-1", "proxy"),
        ("proxy-zone-eu-proxy-web/3", "proxy"),
        ("proxy-session-k-zone-eu", "proxy"),  # a key with a filter-like tail is a key
        ("proxy-zone-a-zone-b", None),  # each filter at most once
        ("proxy-provider-gcp-zone-a", None),  # in order
        ("proxy-zone-", None),
        ("proxy-zone--session-k", None),
        ("proxy-zone-" + "z" * 65, None),
        ("proxy-zone-eu west", None),
        ("proxy-zone-eu-session-", None),
        ("proxy-country-fr", None),
    ],
)
def test_only_the_username_forms_authenticate_as_the_user(
    username: str, account: str | None
) -> None:
    assert gateway_account(username, "proxy") == account


def test_endpoints_entries_that_are_not_members_are_skipped() -> None:
    raw = [
        {"member": "web/0", "endpoint": "10.0.0.5:3128", "provider": "gcp"},
        {"member": "web/1", "endpoint": "[2001:db8::1]:3128", "provider": "gcp"},
        {"member": "web/2", "endpoint": "", "provider": "gcp"},
        {"member": "", "endpoint": "10.0.0.6:3128"},
        {"endpoint": "10.0.0.7:3128"},
        {"member": "web/3", "endpoint": "10.0.0.8:70000"},
        {"member": "web/4", "endpoint": "bad host:3128"},
        "web/5",
    ]
    assert parse_endpoints(raw) == [
        GatewayMember("web/0", "10.0.0.5", 3128, provider="gcp"),
        GatewayMember("web/1", "2001:db8::1", 3128, provider="gcp"),
    ]
    assert split_endpoint("host") is None
    with pytest.raises(ValueError):
        parse_endpoints("not a list")


def test_each_answer_is_read_whole_and_a_bad_entry_is_said_once_while_it_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoints = Endpoints()
    answer = [
        {"member": "web/0", "endpoint": "10.0.0.5:3128", "placement": {"zone": "europe-west1-b"}},
        {"member": "web/1", "endpoint": "bad host:3128"},
    ]
    assert endpoints.parse(answer) == [
        GatewayMember("web/0", "10.0.0.5", 3128, zone="europe-west1-b", region="europe-west1")
    ]

    # The same answer again, then web/0 moved (its zone too) and web/2 new.
    assert endpoints.parse(answer) == endpoints.parse(list(reversed(answer)))
    moved = {"member": "web/0", "endpoint": "10.0.0.9:3128", "placement": {"zone": "us-east1-c"}}
    again = endpoints.parse([moved, answer[1], {"member": "web/2", "endpoint": "10.0.0.6:3128"}])

    assert again == [
        GatewayMember("web/0", "10.0.0.9", 3128, zone="us-east1-c", region="us-east1"),
        GatewayMember("web/2", "10.0.0.6", 3128),
    ]
    assert [r.getMessage() for r in caplog.records].count(
        "ignoring endpoints entry {'member': 'web/1', 'endpoint': 'bad host:3128'}: "
        "needs a member id and host:port"
    ) == 1
    # Gone from an answer and back: said again.
    endpoints.parse([moved])
    endpoints.parse(answer)
    assert sum("web/1" in r.getMessage() for r in caplog.records) == 2


def run_gateway(
    tmp_path: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """`proxy-operator-gateway *args` over a local providers config, with `env` only."""
    config = tmp_path / "providers.yaml"
    config.write_text(yaml.safe_dump(raw_config(local_entry(tmp_path), connect_ports=[443])))
    return subprocess.run(
        [sys.executable, "-m", "gateway.main", "--providers-config", str(config), *args],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
async def test_a_pool_that_does_not_exist_is_a_clear_error(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    temporal = temporal_env.client.service_client.config.target_host
    env = {PASSWORD_ENV: PASSWORD, "TEMPORAL_ADDRESS": temporal}
    result = run_gateway(tmp_path, env, "--pool", "no-such-pool")
    assert result.returncode == 2, result.stderr
    assert "error: --pool: pool 'no-such-pool'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
async def test_a_second_pool_that_does_not_exist_is_named_and_nothing_serves(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """One good pool does not carry a mistyped second one: the gateway refuses to start."""
    client = temporal_env.client
    # A running workflow is all the check before serving describes; no worker needed.
    handle = await client.start_workflow(
        "ProxyPool", {"replicas": 1}, id=f"pool-{uuid.uuid4().hex[:8]}", task_queue="no-worker"
    )
    try:
        temporal = client.service_client.config.target_host
        env = {PASSWORD_ENV: PASSWORD, "TEMPORAL_ADDRESS": temporal}
        result = run_gateway(tmp_path, env, "--pool", handle.id, "--pool", "no-such-pool")
    finally:
        await handle.terminate()
    assert result.returncode == 2, result.stderr
    assert "error: --pool: pool 'no-such-pool'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_duplicate_pool_is_a_usage_error_before_connecting(tmp_path: Path) -> None:
    result = run_gateway(tmp_path, {PASSWORD_ENV: PASSWORD}, "--pool", "web", "--pool", "web")
    assert result.returncode == 2
    assert "error: --pool (or PROXY_OPERATOR_GATEWAY_POOL): 'web' given more than once" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_missing_password_is_reported_before_connecting(tmp_path: Path) -> None:
    result = run_gateway(tmp_path, {}, "--pool", "web")
    assert result.returncode == 2
    assert (
        "proxy.auth.password_env: environment variable PROXY_PASSWORD is not set" in result.stderr
    )


@pytest.mark.slow
def test_an_unreachable_temporal_is_a_clear_error(tmp_path: Path) -> None:
    env = {PASSWORD_ENV: PASSWORD, "TEMPORAL_ADDRESS": "127.0.0.1:1"}
    result = run_gateway(tmp_path, env, "--pool", "web")
    assert result.returncode == 1
    assert "error: cannot connect to Temporal" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_bad_member_network_is_reported_before_connecting(tmp_path: Path) -> None:
    env = {PASSWORD_ENV: PASSWORD, "TEMPORAL_ADDRESS": "127.0.0.1:1"}
    result = run_gateway(
        tmp_path, env, "--pool", "web", "--member-networks", "10.0.0.0/8,10.0.0.1/8"
    )
    assert result.returncode == 2, result.stderr
    assert (
        "error: --member-networks (or PROXY_OPERATOR_GATEWAY_MEMBER_NETWORKS): "
        "bad CIDR '10.0.0.1/8'"
    ) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("alice:my-plain-password", "line 1: the hash is not one"),
        (f"alice:{hash_password('pw')} tunnels=0", "line 1: tunnels= takes a whole number"),
    ],
)
def test_a_bad_users_file_is_named_before_connecting(
    tmp_path: Path, line: str, expected: str
) -> None:
    users = tmp_path / "users"
    users.write_text(f"{line}\n")
    result = run_gateway(
        tmp_path, {PASSWORD_ENV: PASSWORD}, "--pool", "web", "--users-file", str(users)
    )
    assert result.returncode == 2, result.stderr
    assert "error: --users-file (or PROXY_OPERATOR_GATEWAY_USERS_FILE)" in result.stderr
    assert expected in result.stderr
    assert "my-plain-password" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["-1", "many", "1000001", "2.5"])
def test_a_bad_client_connection_cap_is_named(
    value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROXY_OPERATOR_GATEWAY_CLIENT_MAX_CONNECTIONS", raising=False)
    with pytest.raises(SystemExit) as caught:
        parse_args(["--pool", "web", "--client-max-connections", value])
    assert caught.value.code == 2
    assert f"--client-max-connections: {value!r} is not a whole number" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "cap"), [(None, 1000), ("0", None), ("64", 64)])
def test_the_client_connection_cap_defaults_and_turns_off(
    value: str | None, cap: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROXY_OPERATOR_GATEWAY_CLIENT_MAX_CONNECTIONS", raising=False)
    argv = ["--pool", "web", *(["--client-max-connections", value] if value else [])]
    assert parse_args(argv).client_max_connections == cap
