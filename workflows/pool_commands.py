"""A pool's commands: member starts, signals and reconciles, each in a task of its own.

A step issues its commands (drains then terminates, child starts, rotate
signals, endpoint checks, the reconcile) without waiting for any: each runs
in a task of its own, and the pool steps again when one ends. The pool
hands over to its next run, and ends, only when none is left, and waits for
the members it started to close, as their closing is an event of its run.
What a command's failure changes is written into the pool's record
(workflows/pool_record.py): a start refused is retried after a backoff, a
signal to a member already gone calls the reconcile, which finds out how.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Container, Coroutine
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import FailureError, WorkflowAlreadyStartedError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.pool import MembersInput, MembersOutput, PoolActivities
    from contract import POOL, PROXY_LIFECYCLE, TERMINATE_SIGNAL, ProxyState
    from workflows import policies, pool_view
    from workflows.pool_plan import RECONCILE_BUSY, Member, Start
    from workflows.pool_record import PoolRecord

# A member id missing from visibility this soon after its start is not
# suspect: visibility lags.
VISIBILITY_LAG = timedelta(seconds=30)
RECONCILE = policies.ActivityProfile(
    start_to_close=timedelta(seconds=30), schedule_to_close=timedelta(minutes=2)
)


class Commands:
    """The tasks under way, the member starts among them, and the commands themselves."""

    def __init__(
        self,
        *,
        record: Callable[[], PoolRecord],
        ended: Callable[[], None],
        monitored: Callable[[], bool],
        member_closed: Callable[[Member, str, str], None],
    ) -> None:
        # `record`: the pool's record now. `ended`: a command ended, so the
        # pool steps again. `monitored`: the pool's monitor watches its
        # members. `member_closed`: the reconcile found a member closed
        # without a report (its state, and why).
        self._record = record
        self._ended = ended
        self._monitored = monitored
        self._member_closed = member_closed
        self._tasks: set[asyncio.Task[None]] = set()
        # Set once the run has its input: where members and activities run
        # (None: the pool's own queue).
        self.task_queue: str | None = None
        # Members whose start command has not been answered yet.
        self.starting: set[str] = set()
        # Members this run started: their closing is an event of this run.
        self.children: dict[str, workflow.ChildWorkflowHandle[Any, Any]] = {}
        self.reconciling = False

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in a task of its own; the pool steps again when it ends."""
        task: asyncio.Task[None] = asyncio.create_task(work)
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self._ended()

        task.add_done_callback(done)

    @property
    def idle(self) -> bool:
        """No command is under way."""
        return not self._tasks

    @property
    def under_way(self) -> int:
        """How many commands are under way."""
        return len(self._tasks)

    def children_closed(self, members: Container[str]) -> bool:
        """Every member this run started and no longer has among `members` has closed."""
        return all(h.done() for m, h in self.children.items() if m not in members)

    def start(self, start: Start) -> None:
        """Start a member."""
        self.starting.add(start.member.member)
        self.spawn(self._start_child(start))

    def drain_then_terminate(self, member: str, reason: str, drain: int) -> None:
        """Tell a member to terminate once gateways have had `drain` seconds to drop it."""
        self.spawn(self._drain_then_terminate(member, reason, drain))

    def signal(self, member: str, name: str, payload: dict[str, str]) -> None:
        """Signal a member."""
        self.spawn(self._signal(member, name, payload))

    def reconcile(self, now: datetime) -> None:
        """Catch members that closed without a report, and strays nobody started."""
        self.reconciling = True
        self._record().last_reconcile = now
        self.spawn(self._reconcile())

    async def reconcile_when_due(self) -> None:
        """A reconcile while members end, if none ran for RECONCILE_BUSY; waited for."""
        record = self._record()
        if (
            record.last_reconcile is None
            or workflow.now() - record.last_reconcile >= RECONCILE_BUSY
        ):
            record.last_reconcile = workflow.now()
            await self._reconcile()

    async def _drain_then_terminate(self, member: str, reason: str, drain: int) -> None:
        if drain:
            await workflow.sleep(drain, summary=pool_view.drain_summary(member, drain, reason))
        await self._signal(member, TERMINATE_SIGNAL, {"reason": f"pool: {reason}"})

    async def _start_child(self, start: Start) -> None:
        member = start.member.member
        # A member the pool monitors runs no monitor of its own.
        body = {**start.body, "monitor": "pool"} if self._monitored() else start.body
        try:
            self.children[member] = await workflow.start_child_workflow(
                PROXY_LIFECYCLE,
                body,
                id=member,
                task_queue=self.task_queue or workflow.info().task_queue,
                # Members outlive the pool's run: continue-as-new must not end them.
                parent_close_policy=ParentClosePolicy.ABANDON,
                search_attributes=TypedSearchAttributes(
                    [SearchAttributePair(POOL, workflow.info().workflow_id)]
                ),
                static_summary=pool_view.start_summary(start.member, start.cause),
                static_details=pool_view.start_details(
                    workflow.info().workflow_id, start.member, start.cause
                ),
            )
        except (WorkflowAlreadyStartedError, FailureError) as err:
            # Say, an id still used by an earlier pool of this name (the
            # reconcile ends such strays): the next member gets the next id.
            record = self._record()
            record.members.pop(member, None)
            record.last_error = f"could not start {member}: {err}"
            record.vacancies.append(f"{start.cause}; retried after {member} could not start")
            record.start_after = workflow.now() + policies.REPLACE_BACKOFF.first
        finally:
            self.starting.discard(member)

    async def _signal(self, member: str, name: str, payload: dict[str, str]) -> None:
        handle = workflow.get_external_workflow_handle(member)
        label = pool_view.signal_label(name, member, payload.get("reason", ""))
        try:
            # The label names the member and the cause in the pool's history.
            await handle.signal(
                name, payload, event_groups=[workflow.create_event_group(member, label=label)]
            )
        except FailureError:
            # Already closed: the reconcile finds out how, and soon.
            self._record().last_reconcile = None

    async def _reconcile(self) -> None:
        now = workflow.now()
        listed = [
            m.member
            for m in self._record().members.values()
            if now - datetime.fromisoformat(m.started_at) >= VISIBILITY_LAG
        ]
        try:
            found: MembersOutput = await workflow.execute_activity_method(
                PoolActivities.closed_members,
                MembersInput(workflow.info().workflow_id, listed),
                summary="reconcile members",
                task_queue=self.task_queue,
                start_to_close_timeout=RECONCILE.start_to_close,
                schedule_to_close_timeout=RECONCILE.schedule_to_close,
                retry_policy=policies.TRANSIENT_RETRY,
            )
        except FailureError as err:
            self._record().last_error = f"reconcile failed: {err}"
            return
        finally:
            self.reconciling = False
        for closed in found.closed:
            member = self._record().members.get(closed.member)
            if member is not None:
                failed = closed.status == "FAILED" or closed.state == ProxyState.FAILED
                state = ProxyState.FAILED if failed else ProxyState.TERMINATED
                self._member_closed(
                    member, state, f"closed {closed.status.lower()} without a report"
                )
        for stray in found.strays:
            if stray not in self._record().members and stray not in self.starting:
                handle = workflow.get_external_workflow_handle(stray)
                with contextlib.suppress(FailureError):
                    await handle.signal(TERMINATE_SIGNAL, {"reason": "pool: not a member"})
