"""A pool's ending: every member told to terminate, and waited for until it has ended.

A pool ends by `terminate` or a cancel, and ends its members with it: each
is told to terminate (it deletes its instance), a batch of signals per
workflow task, and the pool completes once every one has closed. Members
that close without a report are caught by a reconcile now and then.

Ending a thousand members writes more history than one run may hold (its
event budget, workflows/pool_budget.py), so a terminated pool's ending may
span runs: a run past its budget stops telling members, waits until those
told have ended, so no report of theirs can cross the continue-as-new (the
server would refuse it and the worker replay the run), and hands the rest
over to its next run, which goes on ending them. A cancelled pool has no
next run, and ends all in its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NoReturn

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from contract import PoolState
    from workflows import pool_plan
    from workflows.pool_alarm import Alarm
    from workflows.pool_budget import EventBudget
    from workflows.pool_commands import Commands
    from workflows.pool_monitor import PoolMonitor
    from workflows.pool_plan import RECONCILE_BUSY, Member, MemberPhase, Wake


class Ending:
    """Ends a pool's members; `end` returns once all have closed, or hands over."""

    def __init__(
        self,
        *,
        members: Callable[[], Mapping[str, Member]],
        commands: Commands,
        alarm: Alarm,
        budget: EventBudget,
        publish: Callable[[PoolState | None], None],
        tell_to_end: Callable[[Member, str], None],
    ) -> None:
        # `members`: the pool's members now. `publish`: show the pool's state
        # (None: as its members make it). `tell_to_end`: a member is told to
        # terminate for a reason.
        self._members = members
        self._commands = commands
        self._alarm = alarm
        self._budget = budget
        self._publish = publish
        self._tell_to_end = tell_to_end

    async def end(
        self,
        reason: Callable[[], str],
        monitor: PoolMonitor | None,
        continue_as_new: Callable[[], NoReturn] | None = None,
    ) -> None:
        """Terminate every member and wait until each has ended (its instance deleted).

        `reason`: why, as the pool has it once no start is under way.
        `continue_as_new`: once the run is past its budget, the rest go to the next run.
        """
        if monitor is not None:
            monitor.cancel()  # waited for below, while the members end
        self._publish(None)
        await workflow.wait_condition(lambda: not self._commands.starting)
        why = reason()
        members = list(self._members().values())
        if continue_as_new is not None:
            # Those still on their way to a report (starting, rotating) are told
            # first, so a continue-as-new waits for them as for the others told.
            members.sort(key=lambda m: m.served and m.phase is not MemberPhase.ROTATING)
        told = 0
        for member in members:
            # Not before a first batch: a pool told to end on a long run
            # starts ending at once, and the monitor's shards end meanwhile.
            if continue_as_new is not None and told and self._budget.spent():
                await self._continue_as_new(monitor, continue_as_new)
            # A batch of signals per workflow task, not a thousand at once.
            await workflow.wait_condition(
                lambda: self._commands.under_way < pool_plan.COMMAND_BATCH
            )
            if member.phase is not MemberPhase.REMOVING and member.member in self._members():
                self._tell_to_end(member, why)
                told += 1
        self._publish(None)
        await self._until_ended(lambda: bool(self._members()))
        self._alarm.cancel()
        await workflow.wait_condition(lambda: self._commands.idle)
        if monitor is not None:
            await monitor.stop()  # its shards end within a heartbeat, mostly long before
        self._publish(PoolState.TERMINATED)

    async def _continue_as_new(
        self, monitor: PoolMonitor | None, continue_as_new: Callable[[], NoReturn]
    ) -> NoReturn:
        """Wait until the members told have ended and nothing is in flight, then continue
        as new: the next run goes on telling the rest."""
        await self._until_ended(lambda: any(map(_is_removing, self._members().values())))
        # A member this run started closes as an event of it too, after its last report.
        await workflow.wait_condition(lambda: self._commands.children_closed(self._members()))
        await workflow.wait_condition(lambda: self._commands.idle)
        if monitor is not None:
            # A shard's cancellation landing would cross it too.
            await monitor.stop()
        await workflow.wait_condition(workflow.all_handlers_finished)
        continue_as_new()

    async def _until_ended(self, ending: Callable[[], bool]) -> None:
        """Wait while `ending` (members told to end still there), reconciling now and then
        in case one closed without a report."""
        while ending():
            self._alarm.set(
                Wake(workflow.now() + RECONCILE_BUSY, "check on the members still ending")
            )
            self._alarm.changed = False
            await workflow.wait_condition(lambda: self._alarm.changed or not ending())
            if ending():
                await self._commands.reconcile_when_due()
            self._publish(None)


def _is_removing(member: Member) -> bool:
    return member.phase is MemberPhase.REMOVING
