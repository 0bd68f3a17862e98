"""A gateway's membership loop (gateway/membership.py) over a pool, counted.

The loop is the gateway's own (`membership.follow`, `HistoryGate`,
`query_members`, `pool_position`) on a client whose queries are counted:
Temporal Cloud bills each query, so how many the loop sends is behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from temporalio.client import Client, Interceptor, OutboundInterceptor, QueryWorkflowInput

from gateway import membership
from squid.gateway import GatewayMember


class _CountQueries(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, counter: QueryCounter) -> None:
        super().__init__(next)
        self._counter = counter

    async def query_workflow(self, input: QueryWorkflowInput) -> Any:
        self._counter.queries += 1
        return await super().query_workflow(input)


class QueryCounter(Interceptor):
    """Client interceptor: how many queries the client sent."""

    def __init__(self) -> None:
        self.queries = 0

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _CountQueries(next, self)


def counted_client(client: Client) -> tuple[Client, QueryCounter]:
    """A client like `client` whose queries are counted."""
    counter = QueryCounter()
    config = client.config()
    config["interceptors"] = [counter]
    return Client(**config), counter


class Following:
    """A gateway's follow loop over `pool`, recording what it applied and what it described."""

    def __init__(self, client: Client, pool: str, counter: QueryCounter) -> None:
        self.client = client
        self.pool = pool
        self.counter = counter
        self.applied: list[list[str]] = []
        # The members of the last membership applied.
        self.serving: list[GatewayMember] = []
        self.errors: list[BaseException] = []
        # Every position the loop's describes found, in order.
        self.described: list[membership.Position] = []
        # Reloads fail while this is set, as a Squid that rejects a config would.
        self.refuse = False

    async def fetch(self) -> list[GatewayMember]:
        return await membership.query_members(self.client, self.pool)

    async def describe(self) -> membership.Position:
        position = await membership.pool_position(self.client, self.pool)
        self.described.append(position)
        return position

    async def apply(self, members: Sequence[GatewayMember]) -> bool:
        self.applied.append([m.member for m in members])
        self.serving = list(members)
        return not self.refuse

    async def run(self, *, poll_seconds: float, refresh_seconds: float) -> None:
        await membership.follow(
            self.fetch,
            self.apply,
            await self.fetch(),
            poll_seconds=poll_seconds,
            debounce_seconds=poll_seconds,
            on_error=self.errors.append,
            gate=membership.HistoryGate(self.describe, refresh_seconds=refresh_seconds),
        )
