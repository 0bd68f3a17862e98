"""The worker's providers config (docs/architecture.md, "Contracts"), validated strictly.

`load_config` fails before the worker connects anywhere and reports every
problem in one ConfigError, each with its path (`providers[2].gcp.project:
field required`). Secrets are read from the environment or a file named in
the YAML, never from the YAML itself, and never leave the worker.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from providers.catalog import TYPE_NAMES, provider_type
from proxy_operator.username import PROXY_USERNAME
from squid.conf import DEFAULT_DENIED_DESTINATIONS, ProxySettings

log = logging.getLogger(__name__)

LABEL_VALUE = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
Port = Annotated[int, Field(ge=1, le=65535)]
# Anything shorter is within reach of offline guessing from the htpasswd hash,
# which GCP instance metadata and Kubernetes Secrets show to their readers.
MIN_PASSWORD_LENGTH = 16


class StrictModel(BaseModel):
    """No coercion, no unknown keys, no mutation after load."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ProviderSettings(StrictModel):
    """A provider type's block in an entry (`PROVIDER_TYPE.settings`)."""

    def placement_problems(self, placement: Mapping[str, str]) -> list[str]:
        """What is wrong with a workflow's placement values for this entry, each naming its field.

        Only keys in the type's `placement_keys` reach here. The default finds
        nothing; a type whose values depend on its settings (a Kubernetes
        namespace outside `allowed_namespaces`) overrides it.
        """
        return []

    def member_networks(self) -> tuple[str, ...] | None:
        """The networks (CIDRs) this entry's instances get addresses in, or None if unknown.

        A gateway makes only endpoints in these networks its parents
        (gateway/member_networks.py). The default knows nothing: a type whose
        settings say where its instances listen (the local bind address)
        overrides it.
        """
        return None


class AuthConfig(StrictModel):
    # Case-sensitive: the rendered squid.conf tells Squid not to lowercase it.
    username: Annotated[str, Field(pattern=PROXY_USERNAME)] = "proxy"
    password_env: str | None = None
    password_file: str | None = None


class ProxyDefaults(StrictModel):
    """Defaults every proxy gets; the workflow input may override the port only."""

    port: Port = 3128
    auth: AuthConfig
    allowed_cidrs: Annotated[list[str], Field(min_length=1)]
    allowed_connect_ports: Annotated[list[Port], Field(min_length=1)] = [443]
    # None: squid/conf.py's DEFAULT_DENIED_DESTINATIONS. A list replaces it
    # whole; [] lets CONNECT reach every address, private ones included.
    denied_destinations: list[str] | None = None
    # `IPv4:port` pairs CONNECT may reach although `denied_destinations`
    # covers the address and `allowed_connect_ports` lacks the port: one
    # service (make run's demo site on loopback), not its network at large.
    destination_exceptions: list[str] = []

    @field_validator("allowed_cidrs", "denied_destinations")
    @classmethod
    def _cidrs_are_networks(cls, cidrs: list[str] | None) -> list[str] | None:
        """Every entry a network, kept in canonical prefix form.

        `0.0.0.0/0.0.0.0` becomes `0.0.0.0/0`, so what reads the settings
        (Squid's renderer, the GCP firewall rule) sees every network one way.
        """
        if cidrs is None:
            return None
        # Report every bad entry, not just the first: the config fails once.
        bad, canonical = [], []
        for cidr in cidrs:
            try:
                canonical.append(ipaddress.ip_network(cidr, strict=True).with_prefixlen)
            except ValueError as exc:
                bad.append(f"bad CIDR {cidr!r}: {exc}")
        if bad:
            raise ValueError("; ".join(bad))
        return canonical

    @field_validator("destination_exceptions")
    @classmethod
    def _exceptions_are_address_and_port(cls, pairs: list[str]) -> list[str]:
        """Every entry an IPv4 address and a port, kept as `address:port`."""
        bad, canonical = [], []
        for pair in pairs:
            try:
                address, port = destination_exception(pair)
            except ValueError:
                bad.append(f"{pair!r} is not an IPv4 address and port, such as 127.0.0.1:8443")
                continue
            canonical.append(f"{address}:{port}")
        if bad:
            raise ValueError("; ".join(bad))
        return canonical

    def warnings(self) -> list[str]:
        """Settings that are valid but open more than an operator may mean to."""
        found = [
            f"proxy.allowed_cidrs: {cidr} admits every {kind} client; anyone on the "
            "network who has the password can use the proxies"
            for cidr, kind in (("0.0.0.0/0", "IPv4"), ("::/0", "IPv6"))
            if cidr in self.allowed_cidrs
        ]
        if self.denied_destinations == []:
            found.append(
                "proxy.denied_destinations: empty, so proxy users can reach loopback, "
                "the cloud metadata server and private networks through the proxies"
            )
        return found


def destination_exception(pair: str) -> tuple[str, int]:
    """`127.0.0.1:8443` as (address, port); ValueError unless an IPv4 address and a port.

    IPv4 only: Squid matches the exception against the CONNECT's host as
    written, and an IPv4 address has one spelling there.
    """
    host, _, port = pair.rpartition(":")
    number = int(port) if port.isdigit() else 0
    if not 1 <= number <= 65535:
        raise ValueError(pair)
    return str(ipaddress.IPv4Address(host)), number


class ProviderEntry(StrictModel):
    """One configured provider: its name, its type, and the block of that type.

    The block sits under a key named after the type (`gcp: {project: ...}`) and
    is validated by the model the type's module declares, so only the modules
    of types a config uses are ever imported.
    """

    name: Annotated[str, Field(pattern=LABEL_VALUE)]
    type: str
    settings: ProviderSettings

    @model_validator(mode="wrap")
    @classmethod
    def _block_of_its_type(
        cls, raw: Any, handler: ModelWrapValidatorHandler[ProviderEntry]
    ) -> ProviderEntry:
        """Validate the type's block in place of `settings`; report its problems under its key."""
        if not isinstance(raw, dict):
            return handler(raw)
        problems: list[InitErrorDetails] = []
        settings = _settings_block(raw, problems)
        if "settings" in raw:  # the field's name, not a key users may write
            problems.append(_problem(("settings",), "extra_forbidden", "unknown key"))
        rest = {k: v for k, v in raw.items() if k not in TYPE_NAMES and k != "settings"}
        try:
            entry = handler({**rest, "settings": settings or ProviderSettings()})
        except ValidationError as exc:
            problems = _relocated(exc, ()) + problems
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return entry


def _settings_block(
    raw: dict[str, Any], problems: list[InitErrorDetails]
) -> ProviderSettings | None:
    """The entry's validated block, or None with the reasons added to `problems`."""
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in TYPE_NAMES:
        expected = ", ".join(TYPE_NAMES)
        problems.append(
            _problem(
                ("type",), "provider_type", f"unknown type {kind!r} (expected one of {expected})"
            )
        )
        return None
    for other in TYPE_NAMES:
        if other != kind and other in raw:
            problems.append(
                _problem(
                    (other,), "provider_block", f"block belongs to type {other!r}, not {kind!r}"
                )
            )
    declared = provider_type(kind)
    block = raw.get(kind)
    if block is None and not declared.block_optional:
        problems.append(_problem((kind,), "provider_block", f"field required for type {kind!r}"))
        return None
    try:
        settings: ProviderSettings = declared.settings.model_validate(
            {} if block is None else block
        )
    except ValidationError as exc:
        problems.extend(_relocated(exc, (kind,)))
        return None
    return settings


def _problem(loc: tuple[str | int, ...], kind: str, message: str) -> InitErrorDetails:
    """One validation error of type `kind`, worded as `_describe` prints it."""
    return InitErrorDetails(
        type=PydanticCustomError(kind, "{message}", {"message": message}), loc=loc, input=None
    )


def _relocated(exc: ValidationError, prefix: tuple[str | int, ...]) -> list[InitErrorDetails]:
    """`exc`'s errors under `prefix`, with their types and messages kept."""
    return [
        InitErrorDetails(
            type=PydanticCustomError(err["type"], "{message}", {"message": err["msg"]}),
            loc=(*prefix, *err["loc"]),
            input=err["input"],
        )
        for err in exc.errors()
    ]


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
            denied_destinations=(
                DEFAULT_DENIED_DESTINATIONS
                if self.proxy.denied_destinations is None
                else tuple(self.proxy.denied_destinations)
            ),
            destination_exceptions=tuple(
                destination_exception(pair) for pair in self.proxy.destination_exceptions
            ),
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
    """Read, validate and resolve secrets; raise ConfigError listing every problem.

    What is valid but risky (a proxy open to every address) is logged as a
    warning, once, when the worker loads its config at start.
    """
    source = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(source, [f"cannot read file: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
    config = parse_config(raw, source=source, environ=os.environ if environ is None else environ)
    for warning in config.proxy.warnings():
        log.warning("%s: %s", source, warning)
    return config


def parse_config(raw: Any, *, source: str = "<config>", environ: Mapping[str, str]) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(source, ["top level: must be a mapping"])
    problems = _structure_problems(raw)
    config: Config | None = None
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        problems += [_describe(err) for err in exc.errors()]
    if config is not None:
        problems += _type_problems(config)
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
        name = entry.get("name")
        if isinstance(name, str):
            if name in seen:
                problems.append(f"providers[{i}].name: duplicate {name!r}")
            seen.add(name)
    return problems


def _type_problems(config: Config) -> list[str]:
    """What each provider type in use finds wrong across the config (providers/catalog.py)."""
    problems: list[str] = []
    for kind in dict.fromkeys(entry.type for entry in config.providers):
        check = provider_type(kind).config_problems
        if check is not None:
            problems += check(config)
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
        return _long_enough(value, f"{where}.password_env", f"environment variable {env_name}")
    if isinstance(file_name, str):
        try:
            value = Path(file_name).read_text().strip()
        except OSError as exc:
            return "", [f"{where}.password_file: cannot read {file_name}: {exc.strerror}"]
        if not value:
            return "", [f"{where}.password_file: {file_name} is empty"]
        return _long_enough(value, f"{where}.password_file", file_name)
    return "", []  # a wrong type is reported by pydantic


def _long_enough(password: str, path: str, where: str) -> tuple[str, list[str]]:
    """The password, or a problem naming where it came from (never the password)."""
    if len(password) < MIN_PASSWORD_LENGTH:
        return "", [
            f"{path}: the password in {where} has {len(password)} characters, "
            f"at least {MIN_PASSWORD_LENGTH} are required (e.g. openssl rand -base64 24)"
        ]
    return password, []


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
