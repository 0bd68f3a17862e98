"""A Ready proxy's rotation, make before break: the old instance serves until the new one is Ready.

Max lifetime or a `rotate` signal replaces the instance while the proxy
stays Ready: its replacement is brought up (which may wait for quota for
days) while the old instance, still what status and the pool advertise,
stays monitored. If the old one fails first it is withdrawn (Unhealthy, then
Replacing) and the bring-up goes on as its replacement; if the replacement
fails, the old one keeps serving and the rotation is tried again after a
backoff. Once the new instance is Ready, the old one is drained (when the
input asks) and deleted, and its monitor's end awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.models import InstanceRef, MonitorOutcome, MonitorReason
    from contract import ProxyState
    from workflows import lifecycle_view
    from workflows.failures import InstanceFailed
    from workflows.inputs import ProxyInput
    from workflows.lifecycle_calls import ProviderCalls
    from workflows.lifecycle_carried import CarriedState, InstanceCause
    from workflows.lifecycle_crash_budget import CrashBudget
    from workflows.lifecycle_deletions import Deletions
    from workflows.lifecycle_monitors import Monitor, Monitors


class Rotation:
    """Carries out one lifecycle run's rotations; the lifecycle keeps its states and instances."""

    def __init__(
        self,
        carried: CarriedState,
        calls: ProviderCalls,
        deletions: Deletions,
        monitors: Monitors,
        budget: CrashBudget,
        *,
        bring_up: Callable[[ProxyInput], Coroutine[Any, Any, InstanceRef]],
        become_ready: Callable[[InstanceRef], None],
        retire: Callable[[InstanceRef | None], None],
        withdraw: Callable[[InstanceRef, MonitorOutcome], None],
        cause: Callable[[str], InstanceCause],
    ) -> None:
        # The lifecycle's own steps: `bring_up` a generation (raising
        # InstanceFailed), `become_ready` with it, `retire` an instance,
        # `withdraw` the old one when it failed first, and the `cause` of
        # the next generation, decided now.
        self._carried = carried
        self._calls = calls
        self._deletions = deletions
        self._monitors = monitors
        self._budget = budget
        self._bring_up = bring_up
        self._become_ready = become_ready
        self._retire = retire
        self._withdraw = withdraw
        self._cause = cause

    async def rotate(self, inp: ProxyInput) -> ProxyState:
        """Make before break: the old instance serves until the new one is Ready.

        Returns Ready, or Replacing when the old instance failed while its
        replacement was being brought up and that replacement failed too.
        """
        old = self._carried.current
        assert old is not None
        if self._carried.next_cause is None:  # else a rotation tried again after a failure
            why = lifecycle_view.rotation(self._carried.rotate_reason, inp.max_lifetime_seconds)
            self._carried.next_cause = self._cause(why)
        try:
            new = await self._bring_up_watching(inp, old)
        except InstanceFailed as failed:
            if self._carried.current is None:  # the old one failed meanwhile
                why = lifecycle_view.failed_to_come_up(f"rotation failed: {failed}")
                self._carried.next_cause = self._cause(why)
            self._retire(failed.ref)
            await self._budget.count_failure(
                f"rotation failed: {failed}", disrupted=failed.disrupted
            )
            if self._carried.current is None:
                return ProxyState.REPLACING  # the old one failed meanwhile: none serves
            return ProxyState.READY  # keep serving from the old one; try again after a backoff
        old_failed = self._carried.current is None  # and is already being deleted
        self._become_ready(new)
        if old_failed:
            return ProxyState.READY
        if inp.drain_seconds:
            # The new endpoint is published (and told to the pool); gateways
            # drop the old one before it goes. No timer without a drain, so
            # histories recorded before drains existed replay unchanged.
            await self._calls.wait(
                f"draining {old.name} ({old.endpoint}) for {inp.drain_seconds}s before deleting it",
                timedelta(seconds=inp.drain_seconds),
                summary=f"drain {old.name} {inp.drain_seconds}s",
                interruptible=True,
            )
        await self._deletions.delete_and_wait(old)
        await self._monitors.settle_retired()
        return ProxyState.READY

    async def _bring_up_watching(self, inp: ProxyInput, old: InstanceRef) -> InstanceRef:
        """Bring up the replacement while the old instance, still serving, stays monitored.

        The bring-up may wait for quota for days; the old instance is what
        status and the pool advertise meanwhile. Its monitor is restarted
        every MONITOR_PERIOD; if it finds the old instance failing, the old
        one is withdrawn (Unhealthy, then Replacing) and the bring-up goes
        on as its replacement.
        """
        if inp.monitor == "pool":
            return await self._bring_up_watched_by_pool(inp, old)
        monitors = self._monitors
        if monitors.old is None:
            # Recorded rotations cancelled the old monitor and brought up inline.
            return await self._bring_up(inp)
        bring_up = asyncio.create_task(self._bring_up(inp))
        try:
            while not bring_up.done():
                watching = monitors.old
                await self._until_done_or_ended(bring_up, watching)
                if bring_up.done() or watching is None or monitors.old is not watching:
                    continue  # done, or the monitor taken by a hand-over
                monitors.old = None
                outcome: MonitorOutcome | None = None
                with contextlib.suppress(ActivityError):
                    outcome = await watching
                if outcome is not None:
                    self._carried.last_probe = outcome.last_probe
                if outcome is not None and outcome.reason in (
                    MonitorReason.UNHEALTHY,
                    MonitorReason.GONE,
                ):
                    self._withdraw(old, outcome)
                else:
                    monitors.old = monitors.start(inp, old)  # another period
        except BaseException:
            bring_up.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApplicationError, ActivityError):
                await bring_up
            monitors.stop_watching_old()
            raise
        monitors.stop_watching_old()
        return await bring_up

    async def _bring_up_watched_by_pool(self, inp: ProxyInput, old: InstanceRef) -> InstanceRef:
        """A pool member's rotation: the pool monitors the old instance while it advertises it.

        Its word that the old instance fails is checked here as in Ready; a
        confirmed failure withdraws the old instance, as a monitor's would.
        """
        monitors = self._monitors
        bring_up = asyncio.create_task(self._bring_up(inp))
        try:
            # Until the bring-up is done, or the old instance failed (withdrawn).
            while self._carried.current == old:
                await workflow.wait_condition(
                    lambda: bring_up.done() or monitors.failing is not None
                )
                if bring_up.done():
                    break
                outcome = await monitors.confirm_failing(inp, old)
                if outcome.reason in (MonitorReason.UNHEALTHY, MonitorReason.GONE):
                    self._withdraw(old, outcome)
        except BaseException:
            bring_up.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApplicationError, ActivityError):
                await bring_up
            raise
        finally:
            monitors.failing = None  # about the old instance: the new one is checked afresh
        return await bring_up

    async def _until_done_or_ended(
        self, bring_up: asyncio.Task[InstanceRef], watching: Monitor | None
    ) -> None:
        """Until the bring-up is done, or the old monitor ended or was taken by a hand-over."""
        await workflow.wait_condition(
            lambda: (
                bring_up.done()
                or self._monitors.old is not watching
                or (watching is not None and watching.done())
            )
        )
