"""The Squid pool: real local Squids every probe of the fleet goes through."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from activities.probe import probe_connect
from bench.fleet.parameters import CAPACITY_CONCURRENCY, CAPACITY_SECONDS, INSTALLATION, PASSWORD
from providers.base import CreateRequest, Instance, InstanceState
from providers.config import Config
from providers.local import LocalProvider
from providers.naming import instance_name, owner_tags
from tests.helpers.tls_origin import TlsOrigin


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
