"""A lifecycle's monitors: Ready's watch over its instance, and the monitors on their way out.

A proxy of its own runs one long `monitor` activity per MONITOR_PERIOD,
which returns only when health changes, the instance vanishes, or the
period is over. A pool member (`monitor: "pool"`) runs none: its pool's
monitor watches it and signals `instance_failing`, which the member checks
with a probe of its own before it believes it, since anyone may send a
signal and none may replace a healthy proxy.

A rotation keeps the old instance's monitor running while the replacement
comes up (it serves until then), and cancels it once it is done: a
cancelled monitor ends at its next probe after its instance is deleted (or
at its next heartbeat) and is awaited then, so the workflow never closes
with one pending. At a terminate, one whose worker was lost is let go of
after MONITOR_LET_GO instead of the server's heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError
from temporalio.workflow import ActivityHandle

with workflow.unsafe.imports_passed_through():
    from activities.models import InstanceRef, MonitorInput, MonitorOutcome, MonitorReason
    from activities.provider import ProviderActivities
    from workflows import policies
    from workflows.inputs import HealthInput, ProxyInput
    from workflows.lifecycle_calls import CANCELLATION, Waits
    from workflows.lifecycle_carried import CarriedState
    from workflows.lifecycle_crash_budget import CrashBudget, ready_for
    from workflows.patches import LET_GO_OF_LOST_MONITOR, taken

# A pool member's check of its pool's word that its instance is failing: one
# probe and, if it fails, the provider's word on whether the instance is gone.
CONFIRM_TIMEOUT = timedelta(minutes=2)

# A cancelled monitor on a live worker ends at its next probe after its
# instance is gone (the probe fails and the provider says the instance is
# gone) or at its next heartbeat, which brings it the cancel. At a terminate,
# with every instance gone, the workflow waits for it a probe interval, the
# probe's timeout and this much more for the provider's word; one that has
# not ended by then lost its worker, and the server ends it at its heartbeat
# timeout with nothing left for it to watch.
MONITOR_LET_GO = timedelta(seconds=15)

# The summaries of Ready's two timers; the one that fired says which.
LIFETIME_SUMMARY = "max lifetime reached"
STABLE_SUMMARY = "stable: crash budget restored"

Monitor = ActivityHandle[MonitorOutcome]


class Monitors:
    """One lifecycle run's monitor activities, and the pool's word on its instance."""

    def __init__(
        self,
        waits: Waits,
        carried: CarriedState,
        budget: CrashBudget,
        *,
        publish: Callable[[], None],
        raise_if_stopping: Callable[[], None],
        hand_over_due: Callable[[], bool],
    ) -> None:
        # `hand_over_due`: the run's history is long and nothing holds its
        # hand-over back; it wakes a pool member's watch, which has no activity.
        self._waits = waits
        self._carried = carried
        self._budget = budget
        self._publish = publish
        self._raise_if_stopping = raise_if_stopping
        self._hand_over_due = hand_over_due
        # The monitor of the instance being rotated out, while its
        # replacement is brought up: it serves until then.
        self.old: Monitor | None = None
        # A monitor cancelled (rotated out, or at a terminate), awaited once
        # its instance is deleted, so its end is observed.
        self.retired: Monitor | None = None
        # A pool member: why its pool's monitor says its instance is failing,
        # until the member has probed the instance itself (`confirm_failing`).
        self.failing: str | None = None
        # What the pool's monitor said of the instance the member last probed at its word.
        self.pool_said: str | None = None
        # Whether a terminate stops waiting for a monitor lost with its worker
        # (LET_GO_OF_LOST_MONITOR): decided once the lifecycle has unwound.
        self._let_go_of_lost = False

    @property
    def retired_running(self) -> bool:
        """Whether a cancelled monitor has yet to end."""
        return self.retired is not None and not self.retired.done()

    def start(self, inp: ProxyInput, ref: InstanceRef) -> Monitor:
        """Start the long-running monitor of `ref` for one MONITOR_PERIOD."""
        return workflow.start_activity_method(
            ProviderActivities.monitor,
            MonitorInput(
                ref,
                inp.health.target,
                interval_seconds=inp.health.interval_seconds,
                failure_threshold=inp.health.failure_threshold,
                max_duration_seconds=policies.MONITOR_PERIOD.total_seconds(),
                probe_timeout_seconds=inp.health.timeout_seconds,
            ),
            summary=f"monitor {ref.endpoint} every {inp.health.interval_seconds:g}s",
            start_to_close_timeout=policies.MONITOR.start_to_close,
            heartbeat_timeout=policies.monitor_heartbeat(
                policies.MONITOR, inp.health.heartbeat_timeout_seconds
            ),
            retry_policy=policies.TRANSIENT_RETRY,
            cancellation_type=CANCELLATION,
        )

    async def watch(self, inp: ProxyInput) -> MonitorOutcome | None:
        """Run the monitor; None means rotate now: max lifetime reached, or a `rotate` signal."""
        await self.settle_retired()
        ref = self._carried.current
        assert ref is not None
        handle = self.start(inp, ref)

        def wake() -> bool:
            return handle.done() or self._carried.rotate_reason is not None

        while True:
            deadline = self._next_deadline(inp)
            if deadline is None:
                await self._wait_without_timer(handle, wake)
            else:
                timeout, summary = deadline
                try:
                    await workflow.wait_condition(wake, timeout=timeout, timeout_summary=summary)
                except asyncio.CancelledError:
                    # Terminate or cancel: this wait is cancelled, the monitor is
                    # not (it is a task of its own). Cancel it too, and have _terminating
                    # await it, so the workflow never closes with the monitor pending.
                    handle.cancel()
                    self.retired = handle
                    raise
                except TimeoutError:
                    if summary == STABLE_SUMMARY:
                        # Status says now that the crash budget is whole again.
                        self._budget.forgive_if_stable()
                        self._publish()
                        continue
                    self.old = handle  # a rotation is due: it watches until the replacement is up
                    return None
            if handle.done():
                break
            self.old = handle  # a rotate signal
            return None
        outcome: MonitorOutcome = await handle
        self._raise_if_stopping()
        self._carried.last_probe = outcome.last_probe
        return outcome

    async def watched_by_pool(self, inp: ProxyInput) -> MonitorOutcome | None:
        """Ready as a member its pool monitors: no activity, no timer but the lifetime's.

        Wakes for a rotation (None), or for the pool's word that the
        instance is failing, which the member checks itself before it
        believes it: an outcome only when its own probe fails too. Nothing
        else ends this wait, so a history grown long wakes it too (HANDOVER).
        """
        ref = self._carried.current
        assert ref is not None

        def woken() -> bool:
            return (
                self.failing is not None
                or self._carried.rotate_reason is not None
                or self._hand_over_due()
            )

        while True:
            deadline = self._next_deadline(inp)
            if deadline is None:
                await workflow.wait_condition(woken)
            else:
                timeout, summary = deadline
                try:
                    await workflow.wait_condition(woken, timeout=timeout, timeout_summary=summary)
                except TimeoutError:
                    if summary == LIFETIME_SUMMARY:
                        return None
                    self._budget.forgive_if_stable()  # status says the crash budget is whole again
                    self._publish()
                    continue
            if self._carried.rotate_reason is not None:
                return None
            if self.failing is None:
                # Woken by its history's length: `_ready` hands over.
                return MonitorOutcome(MonitorReason.HANDOVER, self._carried.last_probe)
            outcome = await self.confirm_failing(inp, ref)
            if outcome.reason in (MonitorReason.UNHEALTHY, MonitorReason.GONE):
                return outcome

    async def confirm_failing(self, inp: ProxyInput, ref: InstanceRef) -> MonitorOutcome:
        """Probe `ref` once, as the pool's monitor said it fails: the member's own verdict."""
        said, self.failing = self.failing, None
        self.pool_said = said
        outcome: MonitorOutcome = await workflow.execute_activity_method(
            ProviderActivities.monitor,
            MonitorInput(
                ref,
                inp.health.target,
                interval_seconds=inp.health.interval_seconds,
                failure_threshold=1,
                max_duration_seconds=0,
                probe_timeout_seconds=inp.health.timeout_seconds,
            ),
            summary=f"probe {ref.endpoint}: {said}",
            start_to_close_timeout=CONFIRM_TIMEOUT,
            retry_policy=policies.TRANSIENT_RETRY,
            # A terminate mid-probe waits for it, as for every activity: none
            # outlives the workflow.
            cancellation_type=CANCELLATION,
        )
        self._carried.last_probe = outcome.last_probe
        return outcome

    def _next_deadline(self, inp: ProxyInput) -> tuple[timedelta, str] | None:
        """Ready's nearer timer, with its summary: the lifetime's end or the crash budget whole."""
        deadlines = [
            (left, summary)
            for left, summary in (
                (self._lifetime_left(inp), LIFETIME_SUMMARY),
                (self._budget.stable_left(), STABLE_SUMMARY),
            )
            if left is not None
        ]
        return min(deadlines, key=lambda deadline: deadline[0]) if deadlines else None

    def _lifetime_left(self, inp: ProxyInput) -> timedelta | None:
        if inp.max_lifetime_seconds is None:
            return None
        return max(
            timedelta(0), timedelta(seconds=inp.max_lifetime_seconds) - ready_for(self._carried)
        )

    async def _wait_without_timer(self, handle: Monitor, wake: Callable[[], bool]) -> None:
        """Wait for the monitor or a rotate signal, with no timer.

        A terminate cancels the monitor here, as it does in `watch`.
        """
        try:
            await workflow.wait_condition(wake)
        except asyncio.CancelledError:
            handle.cancel()
            if taken(LET_GO_OF_LOST_MONITOR):
                # As in `watch`: _terminating awaits it, once the instance is gone.
                # A run that meets the question on replay without the marker
                # (a 0.3.10 terminate) awaited it here.
                self.retired = handle
                raise
            with contextlib.suppress(ActivityError, asyncio.CancelledError):
                await handle
            raise

    def stop_watching_old(self) -> None:
        """The rotation is over: the old monitor is retired."""
        watching, self.old = self.old, None
        if watching is not None:
            self.retire(watching)

    async def drop_old(self) -> None:
        """Cancel the old instance's monitor and wait for its end: the next run starts another."""
        watching, self.old = self.old, None
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(ActivityError):
                await watching

    def retire(self, handle: Monitor) -> None:
        """Make before break: the old monitor ends once its instance is deleted,
        and is awaited then (`settle_retired`)."""
        handle.cancel()
        self.retired = handle

    async def settle_retired(self) -> None:
        """Await a monitor cancelled for a rotation, so its ending is retrieved.

        With WAIT_CANCELLATION_COMPLETED this returns once the monitor has
        ended: at its next probe after its instance is deleted, or when its
        next heartbeat carries the cancel. Either way nothing stays pending.
        """
        handle, self.retired = self.retired, None
        if handle is not None:
            with contextlib.suppress(ActivityError):
                await handle

    def decide_let_go(self) -> None:
        """At a terminate, the lifecycle unwound: ask once whether a lost monitor is let go of."""
        if self.retired_running:
            self._let_go_of_lost = taken(LET_GO_OF_LOST_MONITOR)

    async def let_go_of_lost(self, health: HealthInput, *, delete_refused: bool) -> None:
        """At a terminate, every instance gone: stop waiting for a monitor its worker lost.

        A monitor on a live worker ends within its next probe (MONITOR_LET_GO);
        one that has not is left to the server's heartbeat timeout, up to
        600 s, which the proxy would otherwise spend in Terminating with
        nothing left to do. While a delete is refused the instance still
        answers, so its monitor is waited for as before.
        """
        handle = self.retired
        if handle is None or handle.done() or not self._let_go_of_lost or delete_refused:
            return
        grace = min(
            timedelta(seconds=health.interval_seconds + health.timeout_seconds) + MONITOR_LET_GO,
            policies.monitor_heartbeat(policies.MONITOR, health.heartbeat_timeout_seconds),
        )
        summary = f"monitor's end {int(grace.total_seconds())}s"
        self._waits.begin(summary, "the cancelled monitor to end (its worker may be lost)")
        try:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(handle.done, timeout=grace, timeout_summary=summary)
        finally:
            self._waits.end(summary)
        if not handle.done():
            self.retired = None  # lost with its worker: the server ends it
