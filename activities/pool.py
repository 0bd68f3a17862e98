"""ProxyPool's safety net: which of its members have closed without telling it?

Members report every change to their pool by signal, so the pool never polls
them. A member can still close without a word: `temporal workflow terminate`
runs no code, and a member whose workflow task keeps failing may time out.
Now and then the pool hands this activity the members it believes are
running; one paged visibility query lists the ones that are, and only the
few missing from it are described directly (visibility lags, describe does
not). Running members carrying the pool's id that the pool does not know
(strays, say from an earlier pool of the same name) are reported too.

OrphanGC asks the opposite question (`pool_end_orphaned_members`): which
running members belong to a pool that is closed? A pool hard-terminated with
`temporal workflow terminate` runs no code, so its members, started to
outlive the pool's runs, live on. Once the pool has been closed for the grace
period, each is signalled `terminate` and deletes its own instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from contract import POOL, PROXY_LIFECYCLE, STATE, TERMINATE_SIGNAL

VISIBILITY_PAGE_SIZE = 1000


@dataclass(frozen=True)
class MembersInput:
    """`pool_closed_members`: which expected members have closed, and any strays running."""

    pool_id: str
    # Members the pool believes are running.
    expected: list[str]


@dataclass(frozen=True)
class ClosedMember:
    """A member the pool believes running that Temporal says has closed."""

    member: str
    # How the workflow closed (TERMINATED, FAILED, ...), or NOT_FOUND.
    status: str
    # Its last ProxyState ("" when it never set one).
    state: str


@dataclass(frozen=True)
class MembersOutput:
    closed: list[ClosedMember] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)
    # Temporal calls made: visibility pages and describes.
    lookups: int = 0


@dataclass(frozen=True)
class OrphanedMembersInput:
    grace_period_seconds: float
    dry_run: bool = False


@dataclass(frozen=True)
class OrphanedMembersOutput:
    # Members of closed pools: signalled `terminate`, unless a dry run.
    members: list[str] = field(default_factory=list)
    lookups: int = 0


class PoolActivities:
    """Look-ups a pool makes about its members, over the worker's Temporal client."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn(name="pool_closed_members")
    async def closed_members(self, inp: MembersInput) -> MembersOutput:
        """The expected members that have closed, and running members nobody expects."""
        # Pool ids are checked at start to need no quoting (workflows/pool_input.py).
        query = (
            f"{POOL.name} = '{inp.pool_id}' AND WorkflowType = '{PROXY_LIFECYCLE}' "
            "AND ExecutionStatus = 'Running'"
        )
        running: set[str] = set()
        listing = self._client.list_workflows(query, page_size=VISIBILITY_PAGE_SIZE)
        try:
            async for execution in listing:
                running.add(execution.id)
        except RPCError as err:
            # A server without visibility (the time-skipping test server):
            # describe every member instead, and find no strays.
            if err.status != RPCStatusCode.UNIMPLEMENTED:
                raise
        lookups = 1 + len(running) // VISIBILITY_PAGE_SIZE
        closed: list[ClosedMember] = []
        for member in inp.expected:
            if member in running:
                continue
            lookups += 1
            try:
                described = await self._client.get_workflow_handle(member).describe()
            except RPCError as err:
                if err.status != RPCStatusCode.NOT_FOUND:
                    raise
                closed.append(ClosedMember(member, "NOT_FOUND", ""))
                continue
            if described.status in (None, WorkflowExecutionStatus.RUNNING):
                continue  # visibility had not caught up
            state = described.typed_search_attributes.get(STATE) or ""
            closed.append(ClosedMember(member, described.status.name, state))
        expected = set(inp.expected)
        return MembersOutput(closed, sorted(running - expected), lookups)

    @activity.defn(name="pool_end_orphaned_members")
    async def end_orphaned_members(self, inp: OrphanedMembersInput) -> OrphanedMembersOutput:
        """Signal `terminate` to every running member of a pool closed for the grace period."""
        query = (
            f"{POOL.name} IS NOT NULL AND WorkflowType = '{PROXY_LIFECYCLE}' "
            "AND ExecutionStatus = 'Running'"
        )
        by_pool: dict[str, list[str]] = {}
        listing = self._client.list_workflows(query, page_size=VISIBILITY_PAGE_SIZE)
        async for execution in listing:
            pool_id = execution.typed_search_attributes.get(POOL)
            if pool_id:
                by_pool.setdefault(pool_id, []).append(execution.id)
        lookups = 1 + sum(map(len, by_pool.values())) // VISIBILITY_PAGE_SIZE
        grace = timedelta(seconds=inp.grace_period_seconds)
        orphaned: list[str] = []
        for pool_id, members in sorted(by_pool.items()):
            lookups += 1
            if not await self._closed_for(pool_id, grace):
                continue
            orphaned += sorted(members)
            if inp.dry_run:
                continue
            for member in sorted(members):
                lookups += 1
                try:
                    await self._client.get_workflow_handle(member).signal(
                        TERMINATE_SIGNAL, {"reason": f"orphan GC: pool {pool_id} is closed"}
                    )
                except RPCError as err:
                    if err.status != RPCStatusCode.NOT_FOUND:
                        raise  # retried; a member already gone is what we wanted
        return OrphanedMembersOutput(orphaned, lookups)

    async def _closed_for(self, pool_id: str, grace: timedelta) -> bool:
        """Whether the pool has been closed (or is unknown) for at least `grace`."""
        try:
            described = await self._client.get_workflow_handle(pool_id).describe()
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            return True  # gone past the namespace's retention: closed long ago
        if described.status in (None, WorkflowExecutionStatus.RUNNING):
            return False
        closed = described.close_time
        return closed is None or datetime.now(UTC) - closed >= grace
