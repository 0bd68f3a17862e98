"""deploy/kubernetes, rendered and checked offline.

The kustomization uses nothing but a resources list, so a few lines here
render it without kubectl; where kubectl is installed, its `kustomize` output
must be the same objects. Every object is validated against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict: unknown fields fail) for an
older and the newest bundled version, and the policy that matters is asserted:
RBAC grants exactly the provider's verbs, the worker is locked down and
probed, and proxies accept connections only from whom the NetworkPolicy names.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.main import UsageError, member_networks, parse_args
from providers.config import parse_config
from providers.kubernetes import PORT_NAME, RBAC_VERBS, KubernetesConfig, labels
from providers.naming import MANAGED_BY_KEY, MANAGED_BY_VALUE, owner_tags
from worker import SERVE_POOLS, SERVE_PROXIES
from worker import parse_args as worker_args

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
SCHEMA_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
# All this renderer understands; a kustomization that needs more fails here first.
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "namespace"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}

Object = dict[str, Any]
# What a proxy must never be a way into: RFC 1918, CGNAT, loopback, link-local
# (cloud metadata), IPv6 loopback, ULA and link-local.
PRIVATE_RANGES = [
    ipaddress.ip_network(cidr)
    for cidr in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "::1/128",
        "fc00::/7",
        "fe80::/10",
    )
]


def render(base: Path = BASE) -> list[Object]:
    """`kubectl kustomize` for kustomizations that list resources (files or
    directories with a kustomization of their own) and may set a namespace."""
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - KUSTOMIZATION_KEYS
    assert not unsupported, f"the test renderer does not support {sorted(unsupported)}"
    objects: list[Object] = []
    for resource in kustomization["resources"]:
        path = base / resource
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


OBJECTS = render()
# Optional: applied on its own after the operator sets minAvailable.
DISRUPTION_BUDGET = render(BASE / "disruption-budget")
WORKER = "proxy-operator-worker"
# Pools on the pools' task queue, in a process of their own (docs/operations.md).
POOLS_WORKER = "proxy-operator-worker-pools"
WORKERS = (WORKER, POOLS_WORKER)
GATEWAY = "proxy-operator-gateway"


def key(obj: Object) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def the(kind: str, name: str | None = None) -> Object:
    (found,) = [o for o in OBJECTS if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return found


def worker_pod_spec(name: str = WORKER) -> Object:
    spec: Object = the("Deployment", name)["spec"]["template"]["spec"]
    return spec


def worker_container(name: str = WORKER) -> Object:
    container: Object
    (container,) = worker_pod_spec(name)["containers"]
    return container


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_renderer_agrees_with_kubectl_kustomize() -> None:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(BASE)], capture_output=True, text=True, check=True, timeout=60
    ).stdout

    expected = {key(o): o for o in yaml.safe_load_all(rendered)}

    assert {key(o): o for o in OBJECTS} == expected


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("obj", OBJECTS, ids=["/".join(key(o)) for o in OBJECTS])
def test_every_object_is_valid_kubernetes(obj: Object, version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize(
    "obj", DISRUPTION_BUDGET, ids=["/".join(key(o)) for o in DISRUPTION_BUDGET]
)
def test_the_optional_disruption_budget_is_valid_kubernetes(obj: Object, version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def test_the_disruption_budget_covers_every_proxy_pod_and_never_blocks_a_drain_for_good() -> None:
    (budget,) = DISRUPTION_BUDGET
    spec = budget["spec"]
    proxy_labels = labels(owner_tags("prod", "proxy-eu-1", 3, {"team": "crawl"}))

    assert budget["kind"] == "PodDisruptionBudget"
    assert budget["metadata"]["namespace"] in provider_settings().namespaces
    assert spec["selector"] == {"matchLabels": {MANAGED_BY_KEY: MANAGED_BY_VALUE}}
    assert spec["selector"]["matchLabels"].items() <= proxy_labels.items()
    # Bare Pods have no controller to count them by: with maxUnavailable or a
    # percentage the disruption controller allows no eviction at all.
    assert "maxUnavailable" not in spec and isinstance(spec["minAvailable"], int)
    # A proxy that is not Ready never holds up a drain.
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_there_are_no_duplicates_and_no_secrets_in_git() -> None:
    keys = [key(o) for o in OBJECTS]

    assert len(keys) == len(set(keys))
    assert not [o for o in OBJECTS if o["kind"] == "Secret"]


def test_both_namespaces_exist_and_enforce_the_restricted_pod_security_standard() -> None:
    namespaces = {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == "Namespace"}

    assert set(namespaces) == {"proxy-operator", "proxies"}
    for namespace in namespaces.values():
        labels = namespace["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    namespaced = [o for o in OBJECTS if o["kind"] not in CLUSTER_SCOPED]
    assert {o["metadata"]["namespace"] for o in namespaced} <= set(namespaces)


# --- RBAC --------------------------------------------------------------------


def provider_settings() -> KubernetesConfig:
    raw = yaml.safe_load(the("ConfigMap")["data"]["providers.yaml"])
    password_env = raw["proxy"]["auth"]["password_env"]
    config = parse_config(raw, source="ConfigMap", environ={password_env: "not-a-real-password"})
    (provider,) = config.providers
    assert isinstance(provider.settings, KubernetesConfig)
    return provider.settings


def in_namespace(kind: str, namespace: str) -> list[Object]:
    return [o for o in OBJECTS if o["kind"] == kind and o["metadata"]["namespace"] == namespace]


def test_nothing_is_granted_cluster_wide() -> None:
    assert not [o for o in OBJECTS if o["kind"] in {"ClusterRole", "ClusterRoleBinding"}]


@pytest.mark.parametrize("namespace", provider_settings().namespaces)
def test_each_allowed_namespace_grants_exactly_the_verbs_the_provider_uses(
    namespace: str,
) -> None:
    (role,) = in_namespace("Role", namespace)
    rules = role["rules"]

    granted: dict[str, set[str]] = {}
    for rule in rules:
        assert rule["apiGroups"] == [""], rule
        for resource in rule["resources"]:
            granted.setdefault(resource, set()).update(rule["verbs"])

    assert granted == {resource: set(verbs) for resource, verbs in RBAC_VERBS.items()}
    assert not any("resourceNames" in rule or "nonResourceURLs" in rule for rule in rules)


@pytest.mark.parametrize("namespace", provider_settings().namespaces)
def test_each_allowed_namespaces_role_is_bound_to_the_workers_service_account(
    namespace: str,
) -> None:
    (role,) = in_namespace("Role", namespace)
    (binding,) = in_namespace("RoleBinding", namespace)
    account = the("ServiceAccount", worker_pod_spec()["serviceAccountName"])

    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    assert worker_pod_spec()["serviceAccountName"] == account["metadata"]["name"]
    assert the("Deployment", WORKER)["metadata"]["namespace"] == account["metadata"]["namespace"]


# --- the worker ----------------------------------------------------------------


@pytest.mark.parametrize("name", WORKERS)
def test_the_worker_is_probed_and_scraped_on_its_metrics_port(name: str) -> None:
    container = worker_container(name)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # The listener defaults to loopback: the Pod's IP, where probes and
    # Prometheus come, must be asked for.
    assert worker_args(container["command"][1:]).metrics_address == "0.0.0.0:9464"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz", probe
        assert ports[container[probe]["httpGet"]["port"]] == 9464, probe
    annotations = the("Deployment", name)["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9464",
        "prometheus.io/path": "/metrics",
    }


@pytest.mark.parametrize("name", WORKERS)
def test_the_worker_runs_unprivileged_with_limits(name: str) -> None:
    pod = worker_pod_spec(name)
    container = worker_container(name)

    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert set(container["resources"]["limits"]) == {"cpu", "memory"}


@pytest.mark.parametrize("name", WORKERS)
def test_the_worker_reads_the_config_map_and_the_password_from_a_secret(name: str) -> None:
    container = worker_container(name)
    command = container["command"]
    config_path = Path(command[command.index("--providers-config") + 1])
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    (volume,) = [v for v in worker_pod_spec(name)["volumes"] if v["name"] == mount["name"]]
    config_map = the("ConfigMap", volume["configMap"]["name"])
    env = {e["name"]: e for e in container["env"]}

    assert command[0] == "proxy-operator-worker"
    assert config_path.name in config_map["data"]
    raw = yaml.safe_load(config_map["data"][config_path.name])
    password_env = raw["proxy"]["auth"]["password_env"]
    assert set(env[password_env]) == {"name", "valueFrom"}, "the password must not be a literal"
    assert "secretKeyRef" in env[password_env]["valueFrom"]
    assert env["TEMPORAL_ADDRESS"]["value"]
    config = parse_config(raw, source="ConfigMap", environ={password_env: "not-a-real-password"})
    (provider,) = config.providers
    assert provider.type == "kubernetes"
    assert isinstance(provider.settings, KubernetesConfig)
    assert provider.settings.namespace == "proxies"
    assert "@sha256:" in provider.settings.image, "the proxy image is pinned by digest"


def test_pools_on_the_pools_queue_run_in_a_worker_of_their_own_that_is_granted_nothing() -> None:
    serves = {name: worker_args(worker_container(name)["command"][1:]).serve for name in WORKERS}
    pools_account = worker_pod_spec(POOLS_WORKER)["serviceAccountName"]
    bound = [
        subject["name"]
        for binding in OBJECTS
        if binding["kind"] in {"RoleBinding", "ClusterRoleBinding"}
        for subject in binding["subjects"]
    ]

    assert serves == {WORKER: SERVE_PROXIES, POOLS_WORKER: SERVE_POOLS}
    assert the("ServiceAccount", pools_account)["metadata"]["namespace"] == "proxy-operator"
    assert pools_account != worker_pod_spec()["serviceAccountName"]
    assert pools_account not in bound


def test_the_dockerfile_runs_the_deployments_command_as_the_same_numeric_user() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()

    # Every stage (the worker, and the compose variant that installs Squid as
    # root first) ends as the same numeric user: Kubernetes verifies
    # runAsNonRoot only for numeric users.
    stages = re.split(r"^FROM ", dockerfile, flags=re.MULTILINE)[1:]
    security = worker_pod_spec()["securityContext"]
    for stage in stages:
        users = re.findall(r"^USER (\S+)$", stage, re.MULTILINE)
        assert users[-1] == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert re.search(r"^FROM python:3\.11-slim AS worker$", dockerfile, re.MULTILINE)
    assert '"proxy-operator-worker", "--providers-config"' in dockerfile


def test_the_worker_image_has_its_bytecode_compiled_although_python_writes_none() -> None:
    # PYTHONDONTWRITEBYTECODE=1 stops some pips writing .pyc files too (23.2
    # writes none; 26.3 does), and the workflow sandbox re-imports the
    # workflow modules for every new run: without bytecode each run compiles
    # them again. The image compiles its checkout, where the code runs from,
    # once, in the step that installs the project on top of its locked
    # dependencies.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ENV PYTHONDONTWRITEBYTECODE=1", dockerfile, re.MULTILINE)
    assert re.search(r"^WORKDIR /app$", dockerfile, re.MULTILINE)
    (install,) = [step for step in dockerfile.split("\nRUN ") if "--no-deps" in step]
    assert "python -m compileall -q /app " in install


def test_the_dockerfile_copies_every_package_pip_installs() -> None:
    # `pip install .` fails on a package pyproject.toml names but the image lacks.
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    copied = re.findall(r"^COPY (.+) \S+$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    sources = {source.rstrip("/") for line in copied for source in line.split()}
    top_level = {package.split(".")[0] for package in setuptools["packages"]}
    modules = {f"{module}.py" for module in setuptools["py-modules"]}
    # The scrapers' client, whose username grammar the operator imports.
    client = {"clients/python"}
    assert top_level | modules | client <= sources, (top_level | modules | client) - sources


# --- who reaches the proxies -------------------------------------------------


def network_policies() -> Iterator[Object]:
    return (o for o in OBJECTS if o["kind"] == "NetworkPolicy")


@pytest.mark.parametrize("namespace", provider_settings().namespaces)
def test_each_allowed_namespace_denies_all_traffic_by_default(namespace: str) -> None:
    (deny,) = [
        p for p in in_namespace("NetworkPolicy", namespace) if p["spec"]["podSelector"] == {}
    ]

    assert deny["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in deny["spec"] and "egress" not in deny["spec"]


def proxy_policy(namespace: str, direction: str) -> Object:
    (policy,) = [
        p
        for p in in_namespace("NetworkPolicy", namespace)
        if p["spec"]["podSelector"] != {} and p["spec"]["policyTypes"] == [direction]
    ]
    # The label every proxy Pod carries (the managed-by tag).
    assert policy["spec"]["podSelector"] == {"matchLabels": {MANAGED_BY_KEY: MANAGED_BY_VALUE}}
    return policy


@pytest.mark.parametrize("namespace", provider_settings().namespaces)
def test_proxy_pods_admit_only_the_worker_and_labelled_clients_on_the_proxy_port(
    namespace: str,
) -> None:
    allow = proxy_policy(namespace, "Ingress")
    deployment = the("Deployment", WORKER)

    (rule,) = allow["spec"]["ingress"]
    # The container port the provider names, whatever number a workflow chose.
    assert rule["ports"] == [{"protocol": "TCP", "port": PORT_NAME}]
    worker, clients = rule["from"]
    # The worker by its Pod label, in whatever namespace an overlay puts it.
    assert worker == {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": deployment["spec"]["template"]["metadata"]["labels"]},
    }
    assert clients == {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"proxy-operator/client": "true"}},
    }


@pytest.mark.parametrize("namespace", provider_settings().namespaces)
def test_proxy_pods_reach_only_dns_and_the_connect_ports_of_public_addresses(
    namespace: str,
) -> None:
    egress = proxy_policy(namespace, "Egress")["spec"]["egress"]
    raw = yaml.safe_load(the("ConfigMap")["data"]["providers.yaml"])

    dns, connect = egress
    assert dns == {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    assert connect["ports"] == [
        {"protocol": "TCP", "port": port} for port in raw["proxy"]["allowed_connect_ports"]
    ]
    blocks = [peer["ipBlock"] for peer in connect["to"]]
    assert set(connect["to"][0]) == {"ipBlock"} and len(blocks) == len(connect["to"])
    for block in blocks:
        network = ipaddress.ip_network(block["cidr"])
        assert network.prefixlen == 0, "public means everything but the exceptions"
        excluded = [ipaddress.ip_network(cidr) for cidr in block["except"]]
        for private in PRIVATE_RANGES:
            if private.version == network.version:
                assert any(private.subnet_of(e) for e in excluded), private  # type: ignore[arg-type]


# --- the gateway -----------------------------------------------------------------


def gateway_container() -> Object:
    container: Object
    (container,) = the("Deployment", GATEWAY)["spec"]["template"]["spec"]["containers"]
    return container


def test_the_gateway_runs_its_console_script_on_the_workers_config_and_password() -> None:
    container = gateway_container()
    command = container["command"]
    worker_command = worker_container()["command"]
    env = {e["name"]: e for e in container["env"]}
    worker_env = {e["name"]: e for e in worker_container()["env"]}
    pod = the("Deployment", GATEWAY)["spec"]["template"]["spec"]

    assert command[0] == "proxy-operator-gateway"
    config = command[command.index("--providers-config") + 1]
    assert config == worker_command[worker_command.index("--providers-config") + 1]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == the("ConfigMap")["metadata"]["name"]
    assert env["PROXY_PASSWORD"] == worker_env["PROXY_PASSWORD"], "the same Secret"
    assert env["TEMPORAL_ADDRESS"] == worker_env["TEMPORAL_ADDRESS"]
    assert env["PROXY_OPERATOR_GATEWAY_POOL"]["value"]
    # Squid's and the router's files need a writable directory on a read-only root.
    state = command[command.index("--state-dir") + 1]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert state in mounts
    assert pod["automountServiceAccountToken"] is False


def test_the_gateway_forwards_only_to_the_pod_cidr_the_proxies_live_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Kubernetes config says nothing of Pod IPs: the manifest must name the networks."""
    raw = yaml.safe_load(the("ConfigMap")["data"]["providers.yaml"])
    password_env = raw["proxy"]["auth"]["password_env"]
    config = parse_config(raw, source="ConfigMap", environ={password_env: "not-a-real-password"})
    args = gateway_container()["command"][1:]
    env = {e["name"]: e["value"] for e in gateway_container()["env"] if "value" in e}
    setting = "PROXY_OPERATOR_GATEWAY_MEMBER_NETWORKS"

    monkeypatch.delenv(setting, raising=False)
    with pytest.raises(UsageError):  # without it the gateway would not start
        member_networks(parse_args(args), config)
    monkeypatch.setenv(setting, env[setting])
    allowed = member_networks(parse_args(args), config)
    assert [str(n) for n in allowed.networks] == config.proxy.allowed_cidrs
    assert not allowed.allow_hostnames


def test_the_gateway_is_reachable_through_its_service_and_reaches_the_proxies() -> None:
    deployment = the("Deployment", GATEWAY)
    service = the("Service", GATEWAY)
    container = gateway_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    command = container["command"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]

    assert command[command.index("--listen") + 1] == f"0.0.0.0:{ports['proxy']}"
    # Loopback unless asked: the probes below and Prometheus come to the Pod's IP.
    assert parse_args(command[1:]).metrics_address == f"0.0.0.0:{ports['metrics']}"
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "proxy"
    # Live while it runs; ready while it can route (gateway/health.py).
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    # The proxies' NetworkPolicy admits Pods with this label (see above).
    assert labels["proxy-operator/client"] == "true"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])


def test_the_gateway_runs_unprivileged_with_limits() -> None:
    pod = the("Deployment", GATEWAY)["spec"]["template"]["spec"]
    security = gateway_container()["securityContext"]

    assert pod["securityContext"] == worker_pod_spec()["securityContext"]
    assert security == worker_container()["securityContext"]
    assert set(gateway_container()["resources"]["limits"]) == {"cpu", "memory"}
