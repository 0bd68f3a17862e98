"""Worker configs for tests and benchmarks: provider entries, a proxy open to loopback only.

One builder so every test and benchmark config has the same shape (auth from
an environment variable, the 127.0.0.0/8 allowlist, CONNECT to loopback
allowed for the test origin) and differs only in what it says it differs in.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from providers.config import Config, parse_config
from providers.local import LocalConfig
from providers.naming import instance_name
from squid.conf import DEFAULT_DENIED_DESTINATIONS
from tests.helpers.xdist import local_ports, scoped

# `test`, or `test-gw<N>` in xdist worker N: instance names (and so Squid's
# /dev/shm segments) never meet another worker's (tests/helpers/xdist.py).
INSTALLATION = scoped("test")
USERNAME = "proxy"
PASSWORD = "test-password-7f3a"
PASSWORD_ENV = "PROXY_PASSWORD"
# What a worker or a gateway may hold in its environment besides the fleet's
# password, none of which a process that parses clients' traffic may be
# given. TEMPORAL_TLS=false lets a process with the key still reach the dev
# server (a key alone turns TLS on).
CALLER_SECRETS = {
    "TEMPORAL_API_KEY": "temporal-api-key-5e1d0c",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-key-9b27e4",
    "GOOGLE_APPLICATION_CREDENTIALS": "/secret/gcp-service-account-41c8.json",
}
LOOPBACK = "127.0.0.0/8"
# The default list minus loopback: tests tunnel to an origin on 127.0.0.1,
# which a proxy refuses by default. Everything else stays refused.
LOOPBACK_ORIGIN_DENIED: tuple[str, ...] = tuple(
    cidr for cidr in DEFAULT_DENIED_DESTINATIONS if cidr not in (LOOPBACK, "::1/128")
)


def local_entry(state_dir: str | Path, name: str = "local") -> dict[str, Any]:
    """A `providers` entry for the local provider keeping its Squids under `state_dir`.

    Under xdist, on this worker's own port range (tests/helpers/xdist.py).
    """
    return {"name": name, "type": "local", "local": {"state_dir": str(state_dir), **local_ports()}}


def local_settings(state_dir: str | Path) -> LocalConfig:
    """The settings `local_entry(state_dir)` gives, for tests that build a provider directly."""
    return LocalConfig(state_dir=str(state_dir), **local_ports())


def raw_config(
    provider: dict[str, Any],
    *,
    connect_ports: Sequence[int],
    installation: str = INSTALLATION,
    username: str = USERNAME,
    also: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The config file's content: `provider` as the first entry (then `also`'s), CONNECT
    to `connect_ports`."""
    return {
        "installation": installation,
        "proxy": {
            "auth": {"username": username, "password_env": PASSWORD_ENV},
            "allowed_cidrs": [LOOPBACK],
            "allowed_connect_ports": list(connect_ports),
            "denied_destinations": list(LOOPBACK_ORIGIN_DENIED),
        },
        "providers": [provider, *also],
    }


def build_config(
    provider: dict[str, Any],
    *,
    connect_ports: Sequence[int],
    installation: str = INSTALLATION,
    password: str = PASSWORD,
    also: Sequence[dict[str, Any]] = (),
) -> Config:
    """`raw_config` parsed as the worker parses it, the password in its environment."""
    raw = raw_config(provider, connect_ports=connect_ports, installation=installation, also=also)
    return parse_config(raw, environ={PASSWORD_ENV: password})


def proxy_config(
    origin_port: int,
    provider: dict[str, Any],
    *,
    password: str = PASSWORD,
    also: Sequence[dict[str, Any]] = (),
) -> Config:
    """A workflow test's config: CONNECT allowed to 443 and to the test origin; `provider`
    first, then the entries `also` names."""
    return build_config(provider, connect_ports=[443, origin_port], password=password, also=also)


def stack_config(origin_port: int, state_dir: str | Path) -> Config:
    """`proxy_config` with the local provider, named `local`, on `state_dir`."""
    return proxy_config(origin_port, local_entry(state_dir))


def lifecycle_instance_name(
    workflow_id: str,
    generation: int,
    *,
    installation: str = INSTALLATION,
    namespace: str = "default",
) -> str:
    """The name a lifecycle started today gives an instance on the test servers.

    Scoped to the installation and the Temporal namespace (the test servers'
    `default`), as providers/naming.py describes.
    """
    return instance_name(workflow_id, generation, installation=installation, namespace=namespace)
