"""Which members the gateway forwards to: the pool's `endpoints` query, followed.

The pool lists its Ready members only, and takes a member out before its
instance is deleted (the drain); the gateway polls, and hands the router
the new members at once (or, with a debounce, once a change has held still
that long).

What it polls is cheap: Temporal Cloud bills every query as an action, and
a 2 s query poll was 1,800 actions an hour per gateway. So the gateway
describes the pool (DescribeWorkflowExecution, not billed) and queries
`endpoints` only when the describe says the answer may have changed since
the last query, and at least every REFRESH_SECONDS as a safety net:

- a pool that keeps a digest of its `endpoints` in its memo
  (contract.ENDPOINTS_DIGEST_MEMO, workflows/pool_feed.py) is queried when
  its run or that digest moved: once per change of its members, however
  busy its history;
- a pool without one (a run started before the pool kept it) is queried
  when its run or its history length moved: a workflow's state changes only
  through events in its history, but a busy pool's history moves at every
  member report, timer and signal, so several times per change.

While a change settles (the debounce), a describe also tells whether the
answer just fetched still stands, so a change that held still costs one query.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

from temporalio.client import Client, WorkflowExecutionDescription, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from contract import ENDPOINTS_DIGEST_MEMO
from gateway.placement import region_of, zone_of
from providers.base import split_endpoint
from squid.gateway import GatewayMember

log = logging.getLogger("proxy_operator.gateway")

ENDPOINTS_QUERY = "endpoints"
# However still the pool, its endpoints are queried this often (12 queries
# an hour): a net under the digest and history-length gates, never their load.
REFRESH_SECONDS = 300.0
# A membership that keeps changing is applied after this many debounce waits
# anyway, so a long rolling rotation does not keep the router on old members.
MAX_DEBOUNCE_ROUNDS = 5


Fetch = Callable[[], Awaitable[list[GatewayMember]]]


class Position(NamedTuple):
    """Where the pool stands, as a describe tells: what a query would answer depends on it."""

    run_id: str
    history_length: int
    # The digest of its `endpoints` in its memo; None for a pool that keeps none.
    endpoints_digest: str | None = None


Describe = Callable[[], Awaitable[Position]]


class PoolNotFound(Exception):
    """The pool id names no workflow (or one that cannot answer the endpoints query)."""


class PoolClosed(Exception):
    """The pool's latest run has closed: no member will come, no report or wake is taken."""


# A run that continued as new has a successor, which a describe by id finds.
CLOSED = frozenset(
    {
        WorkflowExecutionStatus.COMPLETED,
        WorkflowExecutionStatus.FAILED,
        WorkflowExecutionStatus.CANCELED,
        WorkflowExecutionStatus.TERMINATED,
        WorkflowExecutionStatus.TIMED_OUT,
    }
)


def parse_endpoints(raw: Any) -> list[GatewayMember]:
    """The pool's `endpoints` answer as members; entries that are not one are skipped, said so."""
    return Endpoints().parse(raw)


class Endpoints:
    """A pool's `endpoints` answers read as members, each entry read again only once it changed.

    A pool's answer changes by a member or two at a time; reading its 1,000
    entries anew at each change was most of what a change cost the gateway's
    process. An entry that names a member id but no host:port is said so once
    while it stays; one that names no member id, at every answer.
    """

    def __init__(self) -> None:
        # The last answer's entries that name a member id, with what each was read as.
        self._read: dict[str, tuple[dict[str, Any], GatewayMember | None]] = {}

    def parse(self, raw: Any) -> list[GatewayMember]:
        """The answer's members, sorted by id; ValueError for an answer that is no list."""
        entries = raw.get("endpoints", raw) if isinstance(raw, dict) else raw
        if not isinstance(entries, list):
            raise ValueError(f"endpoints query answered {type(raw).__name__}, not a list")
        read: dict[str, tuple[dict[str, Any], GatewayMember | None]] = {}
        members = []
        for entry in entries:
            member_id = entry.get("member") if isinstance(entry, dict) else None
            if not isinstance(member_id, str) or not member_id:
                _entry_member(entry)  # says why it is skipped
                continue
            before = self._read.get(member_id)
            member = before[1] if before and before[0] == entry else _entry_member(entry)
            read[member_id] = (entry, member)
            if member is not None:
                members.append(member)
        self._read = read
        return sorted(set(members), key=lambda m: m.member)


def _entry_member(entry: Any) -> GatewayMember | None:
    """One entry of the answer as a member; None, said so, if it is not one."""
    member = entry.get("member") if isinstance(entry, dict) else None
    endpoint = entry.get("endpoint") if isinstance(entry, dict) else None
    parsed = split_endpoint(endpoint) if isinstance(endpoint, str) else None
    if not isinstance(member, str) or not member or parsed is None:
        log.warning("ignoring endpoints entry %r: needs a member id and host:port", entry)
        return None
    provider, exit_address = entry.get("provider"), entry.get("exit_address")
    return GatewayMember(
        member,
        *parsed,
        zone=zone_of(entry.get("placement")),
        region=region_of(entry.get("placement")),
        provider=provider if isinstance(provider, str) and provider else None,
        exit_address=_address_or_none(exit_address),
    )


def _address_or_none(value: Any) -> str | None:
    """An entry's exit address if it is one IP address (it only labels a metric)."""
    try:
        return str(ipaddress.ip_address(value)) if isinstance(value, str) else None
    except ValueError:
        return None


async def query_members(
    client: Client, pool: str, endpoints: Endpoints | None = None
) -> list[GatewayMember]:
    """One `endpoints` query, read by `endpoints` (the pool's reader, which remembers its
    last answer); PoolNotFound if the pool does not exist."""
    try:
        raw = await client.get_workflow_handle(pool).query(ENDPOINTS_QUERY)
    except RPCError as err:
        if err.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT):
            raise PoolNotFound(f"pool {pool!r}: {err.message}") from err
        raise
    return (endpoints or Endpoints()).parse(raw)


async def pool_position(client: Client, pool: str) -> Position:
    """The pool's current run, its history length and its endpoints' digest: one describe,
    which Temporal does not bill.

    PoolClosed if that run has closed (the message says how and when).
    """
    try:
        described = await client.get_workflow_handle(pool).describe()
    except RPCError as err:
        if err.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT):
            raise PoolNotFound(f"pool {pool!r}: {err.message}") from err
        raise
    if described.status in CLOSED:
        when = f" at {described.close_time:%Y-%m-%d %H:%M:%S %Z}" if described.close_time else ""
        raise PoolClosed(
            f"pool {pool!r} has closed ({described.status.name.lower()}{when}): it lists no "
            "member and takes no demand report or wake"
        )
    return Position(
        described.run_id or "", described.history_length, await _endpoints_digest(described)
    )


async def _endpoints_digest(described: WorkflowExecutionDescription) -> str | None:
    """The digest the pool keeps in its memo; None for none, or for one that is not a digest."""
    try:
        value = await described.memo_value(ENDPOINTS_DIGEST_MEMO, None)
    except Exception as err:  # a value this client cannot decode: the history gate
        # At debug: a describe every poll would repeat it 1,800 times an hour.
        log.debug("pool memo %r unreadable, following history: %s", ENDPOINTS_DIGEST_MEMO, err)
        return None
    return value if isinstance(value, str) and value else None


def _same_answer(before: Position | None, now: Position) -> bool:
    """Whether a query at `now` surely answers as one at `before` did.

    The same run and, where both describes carry the pool's digest, the same
    digest; otherwise the same history length, as a pool's state changes only
    through events in its history.
    """
    if before is None or before.run_id != now.run_id:
        return False
    if before.endpoints_digest is not None and now.endpoints_digest is not None:
        return before.endpoints_digest == now.endpoints_digest
    return before.history_length == now.history_length


class HistoryGate:
    """Whether the pool may have changed since the endpoints were last fetched.

    It may have unless the describe finds the same run with the same
    endpoints' digest (or, for a pool that keeps none, the same history
    length) as just before the last successful fetch, or it is
    REFRESH_SECONDS since that fetch. The position is read before the fetch,
    so a change that lands between the two makes the next poll fetch again:
    a change can cost a second query, never be missed.
    """

    def __init__(self, describe: Describe, *, refresh_seconds: float = REFRESH_SECONDS) -> None:
        self._describe = describe
        self._refresh_seconds = refresh_seconds
        self._fetched_at: Position | None = None
        self._fetched_when = 0.0
        self._pending: Position | None = None

    async def may_have_changed(self) -> bool:
        """Describe the pool; False only when a fetch now would surely answer as the last one."""
        self._pending = await self._describe()
        stale = asyncio.get_running_loop().time() - self._fetched_when >= self._refresh_seconds
        return stale or not _same_answer(self._fetched_at, self._pending)

    async def moved(self) -> bool:
        """Describe the pool again; False when a fetch now would answer as the latest one.

        The latest fetch is the one after the last describe (`may_have_changed`
        or this), whether or not its answer was taken in.
        """
        before = self._pending
        self._pending = await self._describe()
        return not _same_answer(before, self._pending)

    def fetched(self) -> None:
        """The fetch after `may_have_changed` succeeded and its answer was taken in."""
        self._fetched_at = self._pending
        self._fetched_when = asyncio.get_running_loop().time()

    def forget(self) -> None:
        """Fetch at the next poll whatever the describe says (a failed fetch or change)."""
        self._fetched_at = None


async def follow(
    fetch: Fetch,
    apply: Callable[[Sequence[GatewayMember]], Awaitable[bool]],
    current: Sequence[GatewayMember],
    *,
    poll_seconds: float,
    debounce_seconds: float,
    on_error: Callable[[BaseException], None],
    gate: HistoryGate,
) -> None:
    """Poll `fetch` forever; `apply` a new membership once it held still for the debounce.

    `apply` says whether the gateway now serves that membership. A poll
    fetches only when `gate` says the pool may have changed, and a debounce
    round only when it says the pool moved since the last fetch.

    A failed poll keeps the members the gateway has: a pool that cannot be
    asked for a moment has not lost them. A pool that has closed ends it
    (PoolClosed): the gateway stops rather than poll a pool that is gone.
    """
    applied = set(current)
    while True:
        await asyncio.sleep(poll_seconds)
        try:
            if not await gate.may_have_changed():
                continue
            members = await fetch()
            if set(members) == applied:
                gate.fetched()
                continue
            # With a debounce, wait for the change to stop changing.
            for _ in range(MAX_DEBOUNCE_ROUNDS if debounce_seconds > 0 else 0):
                await asyncio.sleep(debounce_seconds)
                if not await gate.moved():
                    break  # held still: the answer fetched stands, no query
                again = await fetch()
                if set(again) == set(members):
                    break
                members = again
        except (RPCError, PoolNotFound, ValueError) as err:
            gate.forget()
            on_error(err)
            continue
        if await apply(members):
            applied = set(members)
            gate.fetched()
        else:
            gate.forget()  # a change that failed is tried again at the next poll
