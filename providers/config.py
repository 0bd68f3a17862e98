"""The worker's providers config (DESIGN.md section 5), validated strictly.

`load_config` fails before the worker connects anywhere and reports every
problem in one ConfigError, each with its path (`providers[2].gcp.project:
field required`). Secrets are read from the environment or a file named in
the YAML, never from the YAML itself, and never leave the worker.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from providers.squid import ProxySettings

PROVIDER_TYPES = ("local", "kubernetes", "gcp")
LABEL_VALUE = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
Port = Annotated[int, Field(ge=1, le=65535)]


class StrictModel(BaseModel):
    """No coercion, no unknown keys, no mutation after load."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class AuthConfig(StrictModel):
    username: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] = "proxy"
    password_env: str | None = None
    password_file: str | None = None


class ProxyDefaults(StrictModel):
    """Defaults every proxy gets; the workflow input may override the port only."""

    port: Port = 3128
    auth: AuthConfig
    allowed_cidrs: Annotated[list[str], Field(min_length=1)]
    allowed_connect_ports: Annotated[list[Port], Field(min_length=1)] = [443]

    @field_validator("allowed_cidrs")
    @classmethod
    def _cidrs_are_networks(cls, cidrs: list[str]) -> list[str]:
        # Report every bad entry, not just the first: the config fails once.
        bad = []
        for cidr in cidrs:
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError as exc:
                bad.append(f"bad CIDR {cidr!r}: {exc}")
        if bad:
            raise ValueError("; ".join(bad))
        return cidrs


class LocalConfig(StrictModel):
    """Squid processes on this machine, one directory each under `state_dir`."""

    state_dir: str = ".data/local-proxies"
    bind_address: str = "127.0.0.1"
    # Local proxies cannot all listen on the proxy port, so each gets a free
    # port from first_port..last_port instead.
    first_port: Port = 20000
    last_port: Port = 20999
    squid_binary: str = "squid"


class KubernetesConfig(StrictModel):
    """Squid Pods in the cluster the worker runs in (or the kubeconfig's)."""

    namespace: Annotated[str, Field(pattern=LABEL_VALUE)] = "proxies"
    # The only namespaces a workflow's `placement.namespace` may name, and the
    # only ones orphan GC lists; the worker's Role is granted in each of them.
    # None means `namespace` alone.
    allowed_namespaces: (
        Annotated[list[Annotated[str, Field(pattern=LABEL_VALUE)]], Field(min_length=1)] | None
    ) = None
    # Canonical's Squid on Ubuntu 24.04 LTS, pinned by digest: the tag is a
    # channel Canonical rebuilds, the digest is one build (docs/providers.md
    # says how to move the pin).
    image: str = (
        "ubuntu/squid:6.6-24.04_beta"
        "@sha256:6a097f68bae708cedbabd6188d68c7e2e7a38cedd05a176e1cc0ba29e3bbe029"
    )
    # The uid (and gid, fsGroup) Squid runs as: the image's `proxy` user.
    # None leaves all three to the platform, as OpenShift's restricted SCC
    # requires (it assigns a uid from the namespace's range).
    run_as_user: Annotated[int, Field(ge=1, le=2147483647)] | None = 13
    # A Pod the scheduler cannot place for this long is written off, so its
    # workflow replaces it (and says why) instead of waiting for capacity.
    unschedulable_timeout_seconds: Annotated[float, Field(gt=0, le=600)] = 300.0
    # Every API call gives up after this long; Temporal's retry policy retries.
    request_timeout_seconds: Annotated[float, Field(gt=0, le=120)] = 10.0
    service_account: str | None = None
    cpu_request: str = "50m"
    cpu_limit: str = "500m"
    memory_request: str = "64Mi"
    memory_limit: str = "256Mi"
    node_selector: dict[str, str] = {}

    @model_validator(mode="after")
    def _namespace_is_allowed(self) -> KubernetesConfig:
        if self.allowed_namespaces is not None:
            if self.namespace not in self.allowed_namespaces:
                raise ValueError(
                    f"namespace {self.namespace!r} must be one of allowed_namespaces "
                    f"{self.allowed_namespaces}"
                )
            if len(set(self.allowed_namespaces)) != len(self.allowed_namespaces):
                raise ValueError(f"allowed_namespaces has duplicates: {self.allowed_namespaces}")
        return self

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Where this provider may create, list and delete Pods."""
        return tuple(self.allowed_namespaces or [self.namespace])

    def placement_problems(self, placement: Mapping[str, str]) -> list[str]:
        """Why a workflow's placement is not allowed here, each naming its field."""
        namespace = placement.get("namespace")
        if namespace is None or namespace in self.namespaces:
            return []
        return [
            f"placement.namespace: {namespace!r} is not one of this provider's "
            f"allowed_namespaces ({', '.join(self.namespaces)})"
        ]


class GcpConfig(StrictModel):
    """Compute Engine VMs with public IPs; credentials come from ADC only."""

    project: str
    zone: str
    zones: list[str] = []
    machine_type: str = "e2-micro"
    image_project: str = "debian-cloud"
    image_family: str = "debian-12"
    spot: bool = False
    network: str = "global/networks/default"
    subnetwork: str | None = None
    # The network tag the installation's firewall rule targets. The default,
    # `proxy-operator-<installation>`, keeps two installations sharing a network
    # from opening each other's VMs to their own allowed_cidrs.
    network_tag: Annotated[str, Field(pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")] | None = None


class ProviderEntry(StrictModel):
    name: Annotated[str, Field(pattern=LABEL_VALUE)]
    type: str
    local: LocalConfig | None = None
    kubernetes: KubernetesConfig | None = None
    gcp: GcpConfig | None = None

    @property
    def settings(self) -> BaseModel:
        """The config block that belongs to this entry's type."""
        block = getattr(self, self.type)
        if block is None:  # only reachable for the local default
            block = LocalConfig()
        assert isinstance(block, BaseModel)
        return block


class Config(StrictModel):
    installation: Annotated[str, Field(pattern=LABEL_VALUE)]
    proxy: ProxyDefaults
    providers: Annotated[list[ProviderEntry], Field(min_length=1)]

    _password: str = PrivateAttr(default="")

    def proxy_settings(self, port: int | None = None) -> ProxySettings:
        """The settings a provider renders Squid from; the only place the password goes."""
        return ProxySettings(
            port=port or self.proxy.port,
            username=self.proxy.auth.username,
            password=self._password,
            allowed_cidrs=tuple(self.proxy.allowed_cidrs),
            allowed_connect_ports=tuple(self.proxy.allowed_connect_ports),
        )

    def provider(self, name: str) -> ProviderEntry:
        for entry in self.providers:
            if entry.name == name:
                return entry
        raise KeyError(name)


class ConfigError(Exception):
    """Every problem found in a config file, one per line with its path."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(
            f"invalid providers config {source}:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Read, validate and resolve secrets; raise ConfigError listing every problem."""
    source = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(source, [f"cannot read file: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
    return parse_config(raw, source=source, environ=os.environ if environ is None else environ)


def parse_config(raw: Any, *, source: str = "<config>", environ: Mapping[str, str]) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(source, ["top level: must be a mapping"])
    problems = _structure_problems(raw)
    config: Config | None = None
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        problems += [_describe(err) for err in exc.errors()]
    password, secret_problems = _resolve_password(raw, environ)
    problems += secret_problems
    # One problem may be found by both passes; report it once, in order.
    problems = list(dict.fromkeys(problems))
    if problems or config is None:
        raise ConfigError(source, problems)
    config._password = password
    return config


def _structure_problems(raw: dict[str, Any]) -> list[str]:
    """Cross-entry rules pydantic's per-field validation cannot see."""
    problems: list[str] = []
    entries = raw.get("providers")
    if not isinstance(entries, list):
        return problems
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        where = f"providers[{i}]"
        name, kind = entry.get("name"), entry.get("type")
        if isinstance(name, str):
            if name in seen:
                problems.append(f"{where}.name: duplicate {name!r}")
            seen.add(name)
        if not isinstance(kind, str) or kind not in PROVIDER_TYPES:
            problems.append(
                f"{where}.type: unknown type {kind!r} (expected one of {', '.join(PROVIDER_TYPES)})"
            )
            continue
        for other in PROVIDER_TYPES:
            if other != kind and other in entry:
                problems.append(f"{where}.{other}: block belongs to type {other!r}, not {kind!r}")
        if kind != "local" and kind not in entry:
            problems.append(f"{where}.{kind}: field required for type {kind!r}")
    return problems


def _resolve_password(raw: dict[str, Any], environ: Mapping[str, str]) -> tuple[str, list[str]]:
    proxy = raw.get("proxy")
    auth = proxy.get("auth") if isinstance(proxy, dict) else None
    if not isinstance(auth, dict):
        return "", []
    env_name, file_name = auth.get("password_env"), auth.get("password_file")
    where = "proxy.auth"
    if (env_name is None) == (file_name is None):
        return "", [f"{where}: set exactly one of password_env, password_file"]
    if isinstance(env_name, str):
        value = environ.get(env_name, "")
        if not value:
            return "", [f"{where}.password_env: environment variable {env_name} is not set"]
        return value, []
    if isinstance(file_name, str):
        try:
            value = Path(file_name).read_text().strip()
        except OSError as exc:
            return "", [f"{where}.password_file: cannot read {file_name}: {exc.strerror}"]
        if not value:
            return "", [f"{where}.password_file: {file_name} is empty"]
        return value, []
    return "", []  # a wrong type is reported by pydantic


def _describe(err: Mapping[str, Any]) -> str:
    path = ""
    for part in err["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    kind = err["type"]
    if kind == "missing":
        message = "field required"
    elif kind == "extra_forbidden":
        message = "unknown key"
    else:
        message = str(err["msg"]).removeprefix("Value error, ")
        message = message[:1].lower() + message[1:]
    return f"{path or 'top level'}: {message}"
