"""Several pools behind one gateway: each followed on its own, the router given their union.

    proxy-operator-gateway --pool pool-eu --pool pool-us ...
    PROXY_OPERATOR_GATEWAY_POOL=pool-eu,pool-us proxy-operator-gateway ...

Each pool is followed as a gateway of one pool follows it
(gateway/membership.py): its own describe gate, `endpoints` query and
debounce, and its own Gatekeeper for the member networks. The router gets
the union of what the pools admit, so rotation, sessions (one userhash over
the union: a key's member is the same on every gateway of the same pools),
pins and the zone/region/provider filters reach across pools as they do
within one; member ids are `<pool>/<n>`, so they do not collide (an id
listed by two pools is kept for the first given, and logged). A change in
any pool is one apply of the whole union, one at a time.

A pool whose workflow closes while the gateway runs takes its members out
of rotation, said by an error in the log, `proxy_operator_gateway_pool_open
{pool}` at 0 and the ProxyOperatorGatewayPoolClosed alert; the gateway
keeps serving the other pools and stops (exit 1) once none is open. With
one pool that is at once, as it has always been. A pool id Temporal does
not know at start is a usage error naming --pool; at start a pool that has
closed is taken as one that closes then.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence

from temporalio.client import Client, WorkflowQueryFailedError

from gateway import membership, metrics
from gateway.health import GatewayHealth
from gateway.member_networks import Gatekeeper, MemberNetworks
from gateway.wake import Holder
from squid.gateway import GatewayMember

log = logging.getLogger("proxy_operator.gateway")

POOL_ENV = "PROXY_OPERATOR_GATEWAY_POOL"
POOL_FLAG = f"--pool (or {POOL_ENV})"
# Ten pools at a pool's most members is the 10,000 the gateway is built for;
# the bound keeps a mistyped list from starting a follower per entry.
MAX_POOLS = 64
MAX_SHOWN_ID = 100

Apply = Callable[[Sequence[GatewayMember]], Awaitable[bool]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pool",
        action="append",
        metavar="POOL",
        help="a ProxyPool's workflow id; repeat it to serve several pools from one endpoint "
        f"(env {POOL_ENV}, comma-separated)",
    )


def from_environment(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> None:
    """`args.pool` from POOL_ENV's comma-separated list when no `--pool` was given."""
    if args.pool is None and environ.get(POOL_ENV):
        args.pool = [entry.strip() for entry in environ[POOL_ENV].split(",")]


def usage_problems(ids: Sequence[str] | None) -> list[str]:
    """What is wrong with the pool ids given, each naming the flag."""
    if not ids:
        return [f"{POOL_FLAG} is required"]
    problems = []
    if any(not pool for pool in ids):
        problems.append(f"{POOL_FLAG}: an empty pool id (a stray comma?)")
    twice = sorted({pool for pool in ids if pool and ids.count(pool) > 1})
    if twice:
        shown = ", ".join(repr(pool[:MAX_SHOWN_ID]) for pool in twice)
        problems.append(f"{POOL_FLAG}: {shown} given more than once")
    if len(ids) > MAX_POOLS:
        problems.append(f"{POOL_FLAG}: {len(ids)} pools, more than {MAX_POOLS}")
    return problems


def named(pools: Sequence[str]) -> str:
    """`pool a` or `pools a, b`, for log lines and /readyz."""
    return f"pool{'s' if len(pools) > 1 else ''} {', '.join(pools)}"


class Pools:
    """The gateway's pools: what each admits now, which are open, and their union.

    `apply` is what puts a membership in force (the router's); the union goes
    to it whole, one call at a time, with an autoscaled pool's wake holder
    standing in for it while it lists no member (gateway/wake.py).
    """

    def __init__(
        self,
        client: Client,
        ids: Sequence[str],
        allowed: MemberNetworks,
        health: GatewayHealth,
    ) -> None:
        self.client = client
        self.ids = tuple(ids)
        self.health = health
        # The autoscaled pools' wake holders, by pool.
        self.holders: dict[str, Holder] = {}
        self._gatekeepers = {pool: Gatekeeper(allowed) for pool in ids}
        self._endpoints = {pool: membership.Endpoints() for pool in ids}
        self._admitted: dict[str, tuple[GatewayMember, ...]] = dict.fromkeys(ids, ())
        self._closed: set[str] = set()
        # Each routed member's pool, as `routed` last gave them.
        self._pool_of: dict[str, str] = {}
        self._applying = asyncio.Lock()
        for pool in ids:
            metrics.MEMBERSHIP_ERRORS.labels(pool=pool)

    def open(self) -> list[str]:
        """The pools whose workflow still runs, in the order given."""
        return [pool for pool in self.ids if pool not in self._closed]

    async def start(self) -> None:
        """Each pool's position, then its members: PoolNotFound for a pool that does not exist;
        a pool that has closed counts as closing now (PoolClosed once none is open)."""
        for pool in self.ids:
            try:
                await membership.pool_position(self.client, pool)
            except membership.PoolClosed as err:
                self._close(pool, err)
            else:
                metrics.POOL_OPEN.labels(pool=pool).set(1)
        for pool in self.open():
            self._admitted[pool] = tuple(await self.fetch(pool))

    async def fetch(self, pool: str) -> list[GatewayMember]:
        """`pool`'s members as its `endpoints` query lists them, less any outside the networks."""
        try:
            listed = await membership.query_members(self.client, pool, self._endpoints[pool])
        except WorkflowQueryFailedError as err:
            raise membership.PoolNotFound(f"pool {pool!r}: {err}") from err
        self.health.answered(pool)
        return self._gatekeepers[pool].admit(listed)

    def routed(self) -> list[GatewayMember]:
        """What the router gets: every pool's members, then a stand-in for each autoscaled
        open pool that lists none, in the pools' order (the order they are tried in)."""
        members: dict[str, GatewayMember] = {}
        pools: dict[str, str] = {}
        stand_ins = []
        for pool in self.ids:
            holder = self.holders.get(pool)
            if not self._admitted[pool] and holder is not None and pool not in self._closed:
                stand_ins.append(holder.stand_in())
                pools[stand_ins[-1].member] = pool
            for member in self._admitted[pool]:
                kept = members.setdefault(member.member, member)
                if kept is not member:
                    log.warning(
                        "pool %s lists member %s, which another pool listed first: ignored",
                        pool,
                        member.member[:MAX_SHOWN_ID],
                    )
                else:
                    pools[member.member] = pool
        self._pool_of = pools
        return sorted(members.values(), key=lambda m: m.member) + stand_ins

    def pool_of(self, member: str) -> str | None:
        """The pool whose member (or stand-in) `member` is in what `routed` last gave."""
        return self._pool_of.get(member)

    async def follow(self, apply: Apply, *, poll_seconds: float, debounce_seconds: float) -> None:
        """Follow every open pool until cancelled; PoolClosed once none is open."""
        tasks = [
            asyncio.create_task(self._follow(pool, apply, poll_seconds, debounce_seconds))
            for pool in self.open()
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises what ended it
        finally:
            for task in tasks:
                task.cancel()

    async def _follow(
        self, pool: str, apply: Apply, poll_seconds: float, debounce_seconds: float
    ) -> None:
        async def position() -> membership.Position:
            found = await membership.pool_position(self.client, pool)
            self.health.answered(pool)
            return found

        async def applied(new: Sequence[GatewayMember]) -> bool:
            self._admitted[pool] = tuple(new)
            return await self.apply(apply)

        def on_error(err: BaseException) -> None:
            metrics.MEMBERSHIP_ERRORS.labels(pool=pool).inc()
            self.health.failed(pool, err)
            log.warning(
                "endpoints query for pool %s failed, keeping its %d members: %s",
                pool,
                len(self._admitted[pool]),
                err,
            )

        try:
            await membership.follow(
                lambda: self.fetch(pool),
                applied,
                self._admitted[pool],
                poll_seconds=poll_seconds,
                debounce_seconds=debounce_seconds,
                on_error=on_error,
                gate=membership.HistoryGate(position),
            )
        except membership.PoolClosed as err:
            self._close(pool, err)
            await self.apply(apply)

    async def apply(self, apply: Apply) -> bool:
        """The union to `apply`, one change at a time; each pool's gauge once it is in force."""
        async with self._applying:
            if not await apply(self.routed()):
                return False
        self.count()
        return True

    def count(self) -> None:
        """Each pool's members in rotation, into its gauge."""
        for pool in self.ids:
            metrics.POOL_MEMBERS.labels(pool=pool).set(len(self._admitted[pool]))

    def _close(self, pool: str, err: membership.PoolClosed) -> None:
        """`pool` has closed: out of rotation; PoolClosed again once no pool is open."""
        self._closed.add(pool)
        self._admitted[pool] = ()
        self.health.closed(pool)
        metrics.POOL_OPEN.labels(pool=pool).set(0)
        if not self.open():
            raise err
        log.error("%s; the gateway serves %s", err, named(self.open()))
