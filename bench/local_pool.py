"""A Temporal dev server and a worker with the local provider, for the pool benchmarks.

What bench.autoscale stands on: the server, real local Squids as members,
a worker on a queue of its own, a gateway over a pool, and a teardown that
waits until every member's Squid is gone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from temporalio.client import Client

from bench.local_worker import local_worker
from tests.helpers.config import local_entry, proxy_config, raw_config
from tests.helpers.gateway import GatewayProcess
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin


@dataclass(frozen=True)
class LocalStack:
    client: Client
    task_queue: str
    state_dir: Path
    gateway_dir: Path
    origin: TlsOrigin

    def gateway(self, pool: str, extra_args: Sequence[str] = ()) -> GatewayProcess:
        """A gateway (not started) over `pool`."""
        return GatewayProcess(
            pool=pool,
            raw_config=raw_config(
                local_entry(self.state_dir), connect_ports=[443, self.origin.port]
            ),
            temporal_address=self.client.service_client.config.target_host,
            namespace=self.client.namespace,
            directory=self.gateway_dir,
            extra_args=extra_args,
        )


@asynccontextmanager
async def local_stack(origin: TlsOrigin) -> AsyncIterator[LocalStack]:
    """The server and the worker; on exit, waits for every local instance to be gone."""
    env = await start_dev_server()
    try:
        with (
            local_state_dir("proxy-operator-bench-") as state_dir,
            local_state_dir("proxy-operator-bench-gateway-") as gateway_dir,
        ):
            config = proxy_config(origin.port, local_entry(state_dir))
            async with local_worker(env.client, config, origin) as task_queue:
                yield LocalStack(env.client, task_queue, state_dir, gateway_dir, origin)
    finally:
        await env.shutdown()
