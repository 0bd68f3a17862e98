"""The Squid pool: real local Squids every probe of the fleet goes through."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from activities.probe import probe_connect
from bench.fleet.parameters import (
    CAPACITY_CONCURRENCY,
    CAPACITY_SECONDS,
    INSTALLATION,
    PASSWORD,
    SQUID_PROVIDER,
    config_for,
)
from providers.base import CreateRequest, Instance, InstanceState
from providers.config import Config
from providers.local import LocalConfig, LocalProvider
from providers.naming import instance_name, owner_tags
from tests.helpers.state_dir import local_state_dir
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin


@dataclass(frozen=True)
class SquidGround:
    """What a benchmark over real local Squids stands on (`squid_ground`)."""

    origin: TlsOrigin
    config: Config
    squids: LocalProvider
    workdir: Path
    # Where the provider keeps each Squid's directory (its access.log among them).
    state_dir: Path


@contextlib.asynccontextmanager
async def squid_ground(
    name: str,
    bind_address: str = "127.0.0.1",
    origin: TlsOrigin | None = None,
    more_ports: Sequence[int] = (),
) -> AsyncIterator[SquidGround]:
    """A TLS origin, the config of a local provider for it, that provider and a scratch directory.

    Every Squid the provider made is deleted at the end, however the benchmark
    ends; `name` tells the benchmark's directories apart. `bind_address`
    0.0.0.0 makes each Squid answer on every loopback address, for members
    that must each be a distinct host:port (bench/gateway.py). `origin`: one
    served elsewhere (bench/request_side.py); by default one on this
    process's threads. The Squids tunnel to its port and to `more_ports`.
    """
    with (
        contextlib.nullcontext(origin) if origin is not None else serve_tls_origin() as origin,
        local_state_dir(f"proxy-operator-{name}-") as state_dir,
        tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as workdir,
    ):
        config = config_for([origin.port, *more_ports], str(state_dir), SQUID_PROVIDER)
        squids = LocalProvider(
            LocalConfig(state_dir=str(state_dir), bind_address=bind_address), config.installation
        )
        try:
            yield SquidGround(origin, config, squids, Path(workdir), Path(state_dir))
        finally:
            await delete_squids(squids)


async def create_squids(
    provider: LocalProvider, config: Config, count: int
) -> list[tuple[str, int]]:
    def create(k: int) -> Instance:
        owner = f"fleet-squid-{k}"
        return provider.create(
            CreateRequest(
                name=instance_name(owner, 0),
                proxy=config.proxy_settings(),
                tags=owner_tags(INSTALLATION, owner, 0),
            )
        )

    instances = await asyncio.gather(*(asyncio.to_thread(create, k) for k in range(count)))
    endpoints = []
    for instance in instances:
        while instance.state is not InstanceState.RUNNING:
            await asyncio.sleep(0.05)
            instance = await asyncio.to_thread(provider.get, instance.provider_id)
        endpoints.append((instance.ip, instance.port))
    return endpoints


async def delete_squids(provider: LocalProvider) -> None:
    instances = await asyncio.to_thread(provider.list_by_tag, "managed-by", "proxy-operator")
    await asyncio.gather(
        *(asyncio.to_thread(provider.delete, i.provider_id) for i in instances),
        return_exceptions=True,
    )


@dataclass
class Capacity:
    probes: int
    failed: int
    seconds: float
    millis: list[float]


async def squid_capacity(endpoints: list[tuple[str, int]], origin: TlsOrigin) -> Capacity:
    """Probes as fast as CAPACITY_CONCURRENCY loops can go, round-robin over the pool.

    This process also serves the TLS origin, so the figure is a floor on what
    the Squids can do, not their limit.
    """
    deadline = time.monotonic() + CAPACITY_SECONDS
    millis: list[float] = []
    failed = 0

    async def loop(k: int) -> None:
        nonlocal failed
        while time.monotonic() < deadline:
            ip, port = endpoints[k % len(endpoints)]
            k += 1
            result = await probe_connect(
                ip, port, "proxy", PASSWORD, origin.url, ssl_context=origin.client_ssl_context
            )
            if result.ok and result.total_ms is not None:
                millis.append(result.total_ms)
            else:
                failed += 1

    start = time.monotonic()
    await asyncio.gather(*(loop(k) for k in range(CAPACITY_CONCURRENCY)))
    return Capacity(len(millis) + failed, failed, time.monotonic() - start, millis)
