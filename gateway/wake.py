"""Scale to zero, the gateway's half: hold a client while the pool wakes, then tunnel it.

A pool at zero lists no member, and a gateway with no member answers every
CONNECT 503 at once. For an autoscaled pool the gateway instead gives its
router one stand-in member while the pool lists no member (with several
pools: while no pool lists one, gateway/pools.py): the `Holder`, a
listener on loopback in the gateway's own process (`HOLD_MEMBER`, given to
the router like any member: it checks the client's credentials as usual and
sends the CONNECT on with the fleet's, as to a member). For each CONNECT it
gets, the holder

1. asks the pool to `wake` (at most one update in flight, and one per
   WAKE_RESEND: the pool's handler starts one member for any number of
   wakes, so several gateways waking together start one member). Behind
   a gateway of several pools, every autoscaled one is woken: the holder
   sees the CONNECT with the fleet's credentials, not the client's
   username, so it cannot tell which pool's filters the client asked for;
2. polls the autoscaled pools' `endpoints` until a member is listed, for up to the
   wake timeout (`--wake-timeout`, default 30 s);
3. then opens the tunnel through that member itself (the CONNECT as the
   router sent it, fleet credentials included) and relays the member's
   answer and the bytes both ways; or, past the timeout, answers 503 with
   `Retry-After`, which Squid passes on to the client. Squid may try a
   CONNECT its parent answered 503 again, so for RETRY_GRACE after a
   timeout the holder answers 503 at once: the client waits one timeout,
   not two.

Meanwhile the gateway's membership follower sees the member too and gives
it to the router: tunnels already relayed by the holder carry on, new
CONNECTs go to the member directly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from temporalio.client import (
    Client,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.service import RPCError

import cli
from gateway import metrics
from gateway.relay import read_head, relay
from squid.gateway import GatewayMember
from workflows.pool_autoscale import AUTOSCALED

log = logging.getLogger("proxy_operator.gateway")

WAKE_UPDATE = "wake"
DEFAULT_WAKE_TIMEOUT = 30.0
MAX_WAKE_TIMEOUT = 600.0
# Between wakes of one gateway: a pool still starting its member need not
# be asked again on every held CONNECT (each is an action).
WAKE_RESEND = 10.0
POLL_SECONDS = 0.5
# After a hold timed out, CONNECTs are refused at once for this long: Squid
# may retry a CONNECT its parent answered 503 at once.
RETRY_GRACE = 5.0
# A stand-in member id no pool member can have (theirs are `<pool>/<n>`).
HOLD_MEMBER = "wake-hold"
CONNECT_TIMEOUT = 10.0

Fetch = Callable[[], Awaitable[list[GatewayMember]]]


class Holder:
    """The stand-in parent: holds CONNECTs while no pool has a member, waking `pools`."""

    def __init__(
        self, client: Client, pools: Sequence[str], gateway: str, fetch: Fetch, timeout: float
    ) -> None:
        """`fetch` lists the members of the autoscaled `pools`, which the holder wakes."""
        self.client = client
        self.pools = tuple(pools)
        self.gateway = gateway
        self.fetch = fetch
        self.timeout = timeout
        self.port = 0
        self._server: asyncio.Server | None = None
        self._wake: asyncio.Task[None] | None = None
        self._woken_at = -WAKE_RESEND
        # Until then, a CONNECT is answered 503 at once: a retry of one that timed out.
        self._gave_up_until = 0.0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def stand_in(self) -> GatewayMember:
        return GatewayMember(HOLD_MEMBER, "127.0.0.1", self.port)

    # ---- one held CONNECT -----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await read_head(reader)
            if head is None or not head.startswith(b"CONNECT "):
                return  # Squid's probe of its parent, or not a tunnel
            if time.monotonic() < self._gave_up_until:
                # Squid may try a CONNECT its parent answered 503 again:
                # answered at once, the client waits one timeout.
                upstream = None
                metrics.WAKES.labels(outcome=metrics.WAKE_RETRY_REFUSED).inc()
            else:
                upstream = await self._held(head, writer)
            if upstream is None:
                retry = max(1, round(self.timeout))
                writer.write(
                    f"HTTP/1.1 503 Service Unavailable\r\nRetry-After: {retry}\r\n"
                    f"Content-Length: 0\r\nConnection: close\r\n\r\n".encode()
                )
                await writer.drain()
                return
            metrics.WAKES.labels(outcome=metrics.WAKE_SERVED).inc()
            await relay(reader, writer, *upstream)
        except (OSError, asyncio.IncompleteReadError) as err:
            log.info("held CONNECT ended: %s", err)
        finally:
            writer.close()

    async def _held(
        self, head: bytes, client: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """`_tunnel`; past the wake timeout, the next CONNECTs are refused for a while."""
        upstream = await self._tunnel(head, client)
        if upstream is None:
            metrics.WAKES.labels(outcome=metrics.WAKE_TIMED_OUT).inc()
            self._gave_up_until = time.monotonic() + RETRY_GRACE
        return upstream

    async def _tunnel(
        self, head: bytes, client: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A member's connection with `head` sent and its answer relayed; None past the timeout."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            members = await self._members()
            if members:
                return await self._through(members[0], head, client)
            self._wake_pool()
            await asyncio.sleep(POLL_SECONDS)
        return None

    async def _members(self) -> list[GatewayMember]:
        try:
            return await self.fetch()
        except Exception as err:  # a failed poll is a poll with no member yet
            log.warning("endpoints query failed while holding a client: %s", err)
            return []

    async def _through(
        self, member: GatewayMember, head: bytes, client: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """`head` sent to `member`, and its answer relayed to `client`: the tunnel is open."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(member.host, member.port), CONNECT_TIMEOUT
        )
        try:
            writer.write(head)
            await writer.drain()
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT)
            client.write(answer)
            await client.drain()
        except BaseException:
            writer.close()
            raise
        log.info("held CONNECT sent to %s: %s", member.member, answer.split(b"\r\n", 1)[0])
        return reader, writer

    def _wake_pool(self) -> None:
        if self._wake is not None and not self._wake.done():
            return
        if time.monotonic() - self._woken_at < WAKE_RESEND:
            return
        self._woken_at = time.monotonic()
        self._wake = asyncio.create_task(self._send_wake())

    async def _send_wake(self) -> None:
        await asyncio.gather(*(self._wake_one(pool) for pool in self.pools))

    async def _wake_one(self, pool: str) -> None:
        try:
            answer: Any = await self.client.get_workflow_handle(pool).execute_update(
                WAKE_UPDATE, {"gateway": self.gateway}
            )
        except (
            WorkflowUpdateFailedError,
            WorkflowUpdateRPCTimeoutOrCancelledError,
            RPCError,
        ) as err:
            log.warning("wake of pool %s refused or failed: %s", pool, _cause(err))
            return
        log.info("woke pool %s: %s", pool, answer)


def _cause(err: BaseException) -> object:
    """What a failed update says: the workflow's own error if it gave one."""
    return getattr(err, "cause", None) or err


def real(members: Sequence[GatewayMember]) -> list[GatewayMember]:
    """The pool's members among what the router has: not the holder."""
    return [m for m in members if m.member != HOLD_MEMBER]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.seconds_argument(
        parser,
        "--wake-timeout",
        DEFAULT_WAKE_TIMEOUT,
        "seconds a client waits at an autoscaled pool with no member while it wakes, "
        "then 503 with Retry-After",
        "0 answers 503 at once",
    )


def usage_problems(args: argparse.Namespace) -> list[str]:
    if 0 <= args.wake_timeout <= MAX_WAKE_TIMEOUT:
        return []
    return [
        f"--wake-timeout: {args.wake_timeout} is not between 0 and {MAX_WAKE_TIMEOUT:g} seconds"
    ]


async def autoscaled(client: Client, pool: str) -> bool:
    """Whether the pool says it is autoscaled (`status.scaling.mode`)."""
    try:
        status = await client.get_workflow_handle(pool).query("status")
    except (RPCError, WorkflowQueryFailedError) as err:
        log.warning("cannot tell whether pool %s is autoscaled: %s", pool, err)
        return False
    scaling = status.get("scaling") if isinstance(status, dict) else None
    return isinstance(scaling, dict) and scaling.get("mode") == AUTOSCALED


@contextlib.asynccontextmanager
async def holding(
    args: argparse.Namespace,
    client: Client,
    pools: Sequence[str],
    gateway: str,
    fetch: Callable[[Sequence[str]], Awaitable[list[GatewayMember]]],
) -> AsyncIterator[Holder | None]:
    """A `Holder` for the autoscaled ones among `pools` (`fetch` lists some pools' members),
    or None when none is autoscaled or `--wake-timeout` is 0."""
    woken = [pool for pool in pools if args.wake_timeout and await autoscaled(client, pool)]
    if not woken:
        yield None
        return
    holder = Holder(client, woken, gateway, lambda: fetch(woken), args.wake_timeout)
    await holder.start()
    log.info(
        "holding clients up to %gs while no pool has a member, waking %s",
        args.wake_timeout,
        ", ".join(woken),
    )
    try:
        yield holder
    finally:
        await holder.stop()
