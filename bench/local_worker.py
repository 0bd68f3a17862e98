"""A worker on the local provider for a benchmark's pool: started, and torn down in order.

Shared by bench.ban_loop and bench.local_pool (bench.autoscale's). Teardown
waits until every instance the pool made is gone (the caller has terminated
the pool) while the worker still runs to delete them, then stops the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from temporalio.client import Client

from activities.provider import ProviderActivities
from providers.config import Config
from providers.local import LocalProvider
from tests.helpers.tls_origin import TlsOrigin
from worker import build_worker


@contextlib.asynccontextmanager
async def local_worker(client: Client, config: Config, origin: TlsOrigin) -> AsyncIterator[str]:
    """A worker serving `config`'s local provider; yields its task queue."""
    provider = LocalProvider.from_config(config.providers[0], config)
    activities = ProviderActivities(
        {"local": provider}, config, ssl_context=origin.client_ssl_context
    )
    task_queue = f"bench-{uuid.uuid4().hex[:8]}"
    worker = build_worker(client, activities, task_queue=task_queue)
    run = asyncio.create_task(worker.run())
    try:
        yield task_queue
    finally:
        while provider.list_by_tag("managed-by", "proxy-operator"):
            await asyncio.sleep(0.5)
        await worker.shutdown()
        await run
        activities.close()
