"""Scale to zero, the gateway's half: hold a client while a pool wakes, then tunnel it.

A pool at zero lists no member, and a gateway with no member answers every
CONNECT 503 at once. For each autoscaled pool the gateway instead gives its
router a stand-in member while that pool lists no member: the pool's
`Holder`, a listener on loopback in the gateway's own process (given to the
router like any member: it checks the client's credentials as usual and
sends the CONNECT on with the fleet's, as to a member). The router tries a
stand-in only when no member in rotation is admitted, and stand-ins in the
order the pools were given (gateway/routing.py), so:

- a request some pool's member can serve is served, and wakes nobody;
- a request no member is admitted for goes to the first pool at zero whose
  stand-in its filters admit, and wakes that pool alone: with every pool at
  zero, a plain request wakes the first autoscaled pool given (`--pool`);
- a request no pool could ever serve gets 503 at once, as without a pool
  at zero.

A stand-in carries the zone, region and provider that every member its
pool can start would have (`placed`), read from the pool's input (its
`template`, or every entry of its `spread`): a filter admits it only where
the member woken is sure to match. A value the input does not fix (a
template with no zone, whose provider picks one; a spread over several
zones or providers) is none on the stand-in, so a filter on it wakes
nothing and gets 503 at once, unless the pool has members. A pin never goes
to a stand-in: it names one member, and a wake would start another.

A holder's port is open to every process on the gateway's host, not to the
router alone, so it takes only what the router sends: a CONNECT carrying
exactly the fleet's credentials (squid/gateway.py, `fleet_login`). Any other
gets 407 at once and wakes nothing; a socket that sends no head within
HEAD_TIMEOUT is cut. For each CONNECT with them, a pool's holder

1. asks its pool to `wake` (at most one update in flight, and one per
   WAKE_RESEND, per pool: the pool's handler starts one member for any
   number of wakes, so a flood of requests, or several gateways waking
   together, start one member);
2. polls its pool's `endpoints` until a member is listed, for up to the
   wake timeout (`--wake-timeout`, default 30 s);
3. then opens the tunnel through that member itself (the CONNECT as the
   router sent it, fleet credentials included) and relays the member's
   answer and the bytes both ways; or, past the timeout, answers 503 with
   `Retry-After`, which Squid passes on to the client. Squid may try a
   CONNECT its parent answered 503 again, so for RETRY_GRACE after a
   timeout the holder answers 503 at once: the client waits one timeout,
   not two.

Meanwhile the gateway's membership follower sees the member too and gives
it to the router in place of the stand-in: tunnels already relayed by the
holder carry on, new CONNECTs go to the member directly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
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
from gateway.placement import region_of, zone_of
from gateway.relay import HEAD_TIMEOUT, read_head, relay
from gateway.routing import STAND_IN, is_stand_in
from squid.gateway import REALM, GatewayMember
from workflows.pool_autoscale import AUTOSCALED
from workflows.pool_input import PoolInput

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
CONNECT_TIMEOUT = 10.0

Fetch = Callable[[], Awaitable[list[GatewayMember]]]


class Holder:
    """A pool's stand-in parent: holds CONNECTs while the pool lists no member, waking it."""

    def __init__(
        self,
        client: Client,
        pool: str,
        where: Placed,
        gateway: str,
        fetch: Fetch,
        timeout: float,
        login: str,
    ) -> None:
        """`fetch` lists `pool`'s members; `where` is what its stand-in matches filters by;
        `login` is the fleet's Proxy-Authorization value, the only one taken."""
        self.client = client
        self.pool = pool
        self.where = where
        self.gateway = gateway
        self.fetch = fetch
        self.timeout = timeout
        self._login = login.encode()
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
        """The pool's stand-in in the router while it lists no member."""
        return GatewayMember(
            STAND_IN + self.pool,
            "127.0.0.1",
            self.port,
            self.where.zone,
            self.where.region,
            self.where.provider,
        )

    # ---- one held CONNECT -----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(read_head(reader), HEAD_TIMEOUT)
            if head is None or not head.startswith(b"CONNECT "):
                return  # Squid's probe of its parent, or not a tunnel
            if not self._from_router(head):
                # Not the router: a client without the fleet's credentials costs nothing.
                metrics.WAKES.labels(outcome=metrics.WAKE_REFUSED).inc()
                await _refuse(
                    writer,
                    "407 Proxy Authentication Required",
                    f'Proxy-Authenticate: Basic realm="{REALM}"',
                )
                return
            if time.monotonic() < self._gave_up_until:
                # Squid may try a CONNECT its parent answered 503 again:
                # answered at once, the client waits one timeout.
                upstream = None
                metrics.WAKES.labels(outcome=metrics.WAKE_RETRY_REFUSED).inc()
            else:
                upstream = await self._held(head, writer)
            if upstream is None:
                retry = max(1, round(self.timeout))
                await _refuse(writer, "503 Service Unavailable", f"Retry-After: {retry}")
                return
            metrics.WAKES.labels(outcome=metrics.WAKE_SERVED).inc()
            await relay(reader, writer, *upstream)
        except (OSError, asyncio.IncompleteReadError) as err:
            log.info("held CONNECT ended: %s", err)
        finally:
            writer.close()

    def _from_router(self, head: bytes) -> bool:
        """Whether `head`'s Proxy-Authorization is the fleet's, as the router sends it: any
        other process on the host may reach the port, and only the router has them."""
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"proxy-authorization":
                return hmac.compare_digest(value.strip(), self._login)
        return False

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
        pool = self.pool
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


async def _refuse(writer: asyncio.StreamWriter, status: str, header: str) -> None:
    """Answer `status` with `header` and no body; the caller closes the connection."""
    writer.write(
        f"HTTP/1.1 {status}\r\n{header}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
    )
    await writer.drain()


def _cause(err: BaseException) -> object:
    """What a failed update says: the workflow's own error if it gave one."""
    return getattr(err, "cause", None) or err


def real(members: Sequence[GatewayMember]) -> list[GatewayMember]:
    """The pools' members among what the router has: not the stand-ins."""
    return [m for m in members if not is_stand_in(m.member)]


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


@dataclass(frozen=True)
class Placed:
    """Where every member a pool starts is: a value its input does not fix is None."""

    zone: str | None = None
    region: str | None = None
    provider: str | None = None


def placed_by(inp: PoolInput) -> Placed:
    """What the template, or every spread entry, gives each member alike."""
    places = (
        [(e.provider, e.placement.as_dict()) for e in inp.spread]
        if inp.spread
        else [(inp.template.provider, inp.template.placement.as_dict())]
    )

    def shared(values: list[str | None]) -> str | None:
        return values[0] if len(set(values)) == 1 else None

    return Placed(
        shared([zone_of(placement) for _, placement in places]),
        shared([region_of(placement) for _, placement in places]),
        shared([provider for provider, _ in places]),
    )


async def placed(client: Client, pool: str) -> Placed:
    """Where `pool`'s members are, by the input its current run started with (the run's
    first history event: a read, not billed); nothing fixed if it cannot be read."""
    try:
        async for event in client.get_workflow_handle(pool).fetch_history_events(page_size=1):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            raw = (await client.data_converter.decode(payloads[:1]))[0] if payloads else None
            return placed_by(PoolInput.model_validate(raw))
    except Exception as err:  # anyone in the namespace may start a pool with any payload
        log.warning("cannot read pool %s's input, so its stand-in matches no filter: %s", pool, err)
    return Placed()


@contextlib.asynccontextmanager
async def holding(
    args: argparse.Namespace,
    client: Client,
    pools: Sequence[str],
    gateway: str,
    fetch: Callable[[str], Awaitable[list[GatewayMember]]],
    login: str,
) -> AsyncIterator[dict[str, Holder]]:
    """A `Holder` for each autoscaled one among `pools` (`fetch` lists a pool's members,
    `login` is the fleet's Proxy-Authorization value), none when `--wake-timeout` is 0."""
    holders: dict[str, Holder] = {}
    async with contextlib.AsyncExitStack() as started:
        for pool in pools:
            if not (args.wake_timeout and await autoscaled(client, pool)):
                continue
            where = await placed(client, pool)
            holder = Holder(
                client,
                pool,
                where,
                gateway,
                functools.partial(fetch, pool),
                args.wake_timeout,
                login,
            )
            await holder.start()
            started.push_async_callback(holder.stop)
            holders[pool] = holder
            log.info(
                "holding clients up to %gs while pool %s has no member, waking it (%s)",
                args.wake_timeout,
                pool,
                ", ".join(f"{k}={v}" for k, v in vars(where).items() if v) or "no filter",
            )
        yield holders
