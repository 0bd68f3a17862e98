"""ProxyLifecycle: one durable workflow per proxy, from create to gone.

Its states and every transition between them, rendered from the table the
workflow enforces (workflows/lifecycle_states.py; a test keeps this copy true):

    Provisioning -> Ready         the first instance passed its first probe
    Provisioning -> Replacing     the first instance failed, crash budget left
    Provisioning -> Terminating   terminate signal or workflow cancel
    Provisioning -> Failed        invalid input, a Permanent error, or the crash budget spent
    Ready        -> Unhealthy     the monitor found the instance failing or gone
    Ready        -> Terminating   terminate signal or workflow cancel
    Ready        -> Failed        invalid input, a Permanent error, or the crash budget spent
    Unhealthy    -> Replacing     the failed instance retired (backoff if failures repeat)
    Unhealthy    -> Terminating   terminate signal or workflow cancel
    Unhealthy    -> Failed        invalid input, a Permanent error, or the crash budget spent
    Replacing    -> Ready         a new generation passed its first probe
    Replacing    -> Terminating   terminate signal or workflow cancel
    Replacing    -> Failed        invalid input, a Permanent error, or the crash budget spent
    Terminating  -> Terminated    every instance the workflow owned is gone
    Terminating  -> Failed        the provider refused an instance's delete for good (Permanent)

Each state is one method of ProxyLifecycle (`_provisioning`, `_replacing`,
`_ready`, `_unhealthy`, `_terminating`, `_failed`). What outlives a run is
one CarriedState (workflows/lifecycle_carried.py), from which `status` is
computed; StatusPublisher (workflows/lifecycle_publish.py) is the one step
that tells search attributes, the Web UI and a parent pool of a change.

The workflow id is the proxy's identity. Steady state costs a handful of
history events an hour: a single long-running `monitor` activity probes and
heartbeats, and returns only when health changes, the instance vanishes, or
two hours have passed. Every instance the workflow creates is remembered in
`CarriedState.owned` until it is confirmed gone, so terminate, cancel and
failure all end with nothing left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType, ActivityHandle

with workflow.unsafe.imports_passed_through():
    from activities.errors import invalid_input
    from activities.models import (
        CreateInstanceInput,
        InstanceInput,
        InstanceRef,
        MonitorInput,
        MonitorOutcome,
        MonitorReason,
        ProbeInput,
        ProbeSummary,
    )
    from activities.provider import ProviderActivities
    from contract import (
        INSTANCE_FAILING_SIGNAL,
        PERMANENT_DELETE_RETRY_DELAY,
        PROXY_LIFECYCLE,
        QUOTA_RETRY_DELAY,
        ROTATE_SIGNAL,
        TERMINATE_SIGNAL,
        ErrorType,
        ProxyState,
    )
    from providers.naming import instance_name
    from workflows import failures, lifecycle_view, policies
    from workflows.deletion import delete_until_gone
    from workflows.early_signals import EarlySignals
    from workflows.inputs import ProxyInput, continued_state, signal_reason
    from workflows.lifecycle_carried import (
        CarriedState,
        InstanceCause,
        ProviderWait,
        ProxyStatus,
        instance_cause,
        status_of,
    )
    from workflows.lifecycle_input import checked_input
    from workflows.lifecycle_publish import StatusPublisher
    from workflows.lifecycle_states import check_transition
    from workflows.patches import (
        DISRUPTIONS_SPARE_THE_CRASH_BUDGET,
        LET_GO_OF_LOST_MONITOR,
        LIFECYCLE_FLOOR,
        keep_floor,
        taken,
    )
    from workflows.policies import REPLACE_BACKOFF

A = TypeVar("A")
R = TypeVar("R")

# Crash-loop budget: this many instances in a row that fail before staying
# healthy for STABLE_AFTER end the workflow as Failed. Between them the
# workflow waits REPLACE_BACKOFF (10 s doubling to 5 minutes); the first
# replacement after a healthy spell starts at once.
CRASH_BUDGET = 5
STABLE_AFTER = timedelta(minutes=10)
FIRST_PROBE_DEADLINE = timedelta(minutes=2)
# A failing first probe is reported to the workflow (and so to `status`)
# after this long, then every FIRST_PROBE_REPORT_EVERY until the deadline.
FIRST_PROBE_FIRST_REPORT = timedelta(seconds=10)
FIRST_PROBE_REPORT_EVERY = timedelta(seconds=20)
# A provider that keeps failing (5xx, 429, timeouts, refused connections) is
# waited out on a visible timer: PROVIDER_WAIT (5 s doubling to 10 minutes),
# or the provider's own Retry-After. Never given up on, however long.
PROVIDER_WAIT = policies.Backoff(first=timedelta(seconds=5), cap=timedelta(minutes=10))

# A pool member's check of its pool's word that its instance is failing: one
# probe and, if it fails, the provider's word on whether the instance is gone.
CONFIRM_TIMEOUT = timedelta(minutes=2)

# A run continues as new once its history has this many events, whether or
# not the server suggests it (its default suggestion comes at about 4,000
# too; a test server may never suggest): far below the 51,200-event limit.
EVENT_BUDGET = 4_000

# A cancelled monitor on a live worker ends at its next probe after its
# instance is gone (the probe fails and the provider says the instance is
# gone) or at its next heartbeat, which brings it the cancel. At a terminate,
# with every instance gone, the workflow waits for it a probe interval, the
# probe's timeout and this much more for the provider's word; one that has
# not ended by then lost its worker, and the server ends it at its heartbeat
# timeout with nothing left for it to watch.
MONITOR_LET_GO = timedelta(seconds=15)

# The summaries of the monitor's two timers; the one that fired says which.
LIFETIME_SUMMARY = "max lifetime reached"
STABLE_SUMMARY = "stable: crash budget restored"


@dataclass(frozen=True)
class ProxyResult:
    """What a finished ProxyLifecycle returns."""

    state: ProxyState
    reason: str
    generation: int
    replacements: int


class _InstanceFailed(Exception):
    """An instance could not be brought to Ready; the workflow replaces it."""

    def __init__(
        self, reason: str, ref: InstanceRef | None = None, *, disrupted: bool = False
    ) -> None:
        super().__init__(reason)
        self.ref = ref
        # The platform took the instance away: no failure of the proxy's.
        self.disrupted = disrupted


@workflow.defn(name=PROXY_LIFECYCLE)
class ProxyLifecycle:
    def __init__(self) -> None:
        # What outlives this run; `status` is computed from it. The rest is this run's.
        self._carried = CarriedState()
        self._terminate_reason: str | None = None
        self._input: ProxyInput | None = None
        self._creating: asyncio.Task[InstanceRef] | None = None
        self._deletions: dict[str, asyncio.Task[None]] = {}
        self._pending_name: str | None = None
        # Every wait in progress (provider, quota, backoff), by its timer's
        # summary: status.waiting_for shows the newest.
        self._waits: dict[str, str] = {}
        # The monitor of an instance that is being rotated out: cancelled,
        # then awaited once its instance is deleted, so its end is observed.
        self._retired_monitor: ActivityHandle[MonitorOutcome] | None = None
        # Why Ready's monitor found the instance failing, for Unhealthy to record,
        # and whether its platform took it away.
        self._unhealthy_cause = ""
        # What the pool's monitor said of the instance the member last probed
        # at its word (_confirm_failing).
        self._pool_said: str | None = None
        self._unhealthy_disrupted = False
        # Set when the provider refused to delete an instance for good: the
        # proxy then ends as Failed with this reason (_give_up_deleting).
        self._delete_refused: str | None = None
        # The monitor of the instance being rotated out, while its
        # replacement is brought up: it serves until then.
        self._old_monitor: ActivityHandle[MonitorOutcome] | None = None
        # Provider activities running now, of every task: a run hands over
        # only when none is, so none reports to a closed run.
        self._in_flight = 0
        self._publisher = StatusPublisher()
        self._early = EarlySignals()
        # A pool member: why its pool's monitor says its instance is failing,
        # until the member has probed the instance itself (_confirm_failing).
        self._failing: str | None = None
        # A pool member's first run, whose start its pool knows.
        self._quiet_start = False
        # Whether a terminate stops waiting for a monitor lost with its worker
        # (LET_GO_OF_LOST_MONITOR): decided once the lifecycle has unwound.
        self._let_go_of_lost_monitor = False

    # ---- the contract: run, signal, query ------------------------------------------

    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> ProxyResult:
        # Untyped, so no argument can fail to decode outside our validation.
        state, problems = continued_state(CarriedState, carried, extra)
        if not problems:
            # Where 0.3.10's runs recorded their release marker: before the
            # first command, ahead of the input check's local-activity marker.
            keep_floor(LIFECYCLE_FLOOR)
        self._quiet_start = state is None and workflow.info().parent is not None
        self._early.decide(continued=state is not None)
        if state is not None:
            self._restore(state)
            # Handed over while Terminating: terminate again, deleting what is still owned.
            self._terminate_reason = state.terminating
            self._delete_refused = state.delete_refused
        self._early.took_over()
        # A continued run was validated when it first started; checking the
        # worker's config again could fail it while it still owns instances.
        inp = await self._validated(raw, problems, against_worker=state is None)
        self._input = inp
        self._carried.provider = inp.provider
        self._publisher.only_news = inp.monitor == "pool"
        if self._quiet_start and self._publisher.only_news:
            self._publisher.started_by_pool()
        # After the input check: a run that fails it upserts Failed at once.
        self._publisher.upsert_as_tasks_wait()
        self._publish()

        lifecycle = asyncio.create_task(self._lifecycle(inp))
        try:
            await workflow.wait_condition(
                lambda: self._terminate_reason is not None or lifecycle.done()
            )
        except asyncio.CancelledError:
            # `temporal workflow cancel`: clean up, then end as cancelled.
            self._terminate_reason = self._terminate_reason or "workflow cancelled"
            await self._terminating(lifecycle)
            self._raise_if_delete_refused()
            raise
        # Also when the lifecycle has ended already: a terminate that came
        # before its first step ends it at once (_raise_if_stopping), and
        # must still end the proxy Terminated, not Cancelled.
        if not lifecycle.done() or self._terminate_reason is not None:
            await self._terminating(lifecycle)
            self._raise_if_delete_refused()
            return self._result(ProxyState.TERMINATED, self._terminate_reason or "terminated")
        try:
            lifecycle.result()
        except (ApplicationError, ActivityError) as err:
            raise await self._failed(err) from err
        raise AssertionError("the lifecycle only ends by failure or continue-as-new")

    @workflow.signal(name=TERMINATE_SIGNAL)
    def terminate(self, request: Any = None, *_extra: Any) -> None:
        """Delete the instance, wait until it is gone, complete.

        Input optional: `{"reason": "..."}`, or just the reason as a string.
        Further arguments are ignored: a handler that cannot take them would
        fail the workflow task on every retry, and the proxy could no longer
        be terminated cleanly.
        """
        self._terminate_reason = signal_reason(request, "terminate signal")
        self._early.hold(lambda: self.terminate(request))

    @workflow.signal(name=ROTATE_SIGNAL)
    def rotate(self, request: Any = None, *_extra: Any) -> None:
        """Replace the instance make-before-break now, as max lifetime does.

        Input optional: `{"reason": "..."}`, or just the reason as a string.
        Rotates sent while a rotation is under way are absorbed by it.
        """
        self._carried.rotate_reason = signal_reason(request, lifecycle_view.ROTATE_SIGNAL_DEFAULT)
        self._early.hold(lambda: self.rotate(request))

    @workflow.signal(name=INSTANCE_FAILING_SIGNAL)
    def instance_failing(self, request: Any = None, *_extra: Any) -> None:
        """A pool member's pool found its instance failing: probe it now.

        Input: `{"endpoint": "<ip:port>", "reason": "..."}`. Anyone may send
        a signal, so this only makes the member probe its own instance: taken
        only by a member watched by its pool (`monitor: "pool"`) and only
        about the instance it serves from now; anything else is ignored.
        """
        current = self._carried.current
        if (
            self._input is None
            or self._input.monitor != "pool"
            or current is None
            or not isinstance(request, dict)
            or request.get("endpoint") != current.endpoint
        ):
            return
        self._failing = signal_reason(request, "the pool's monitor")

    @workflow.query(name="status")
    def status(self) -> ProxyStatus:
        return self._status_now()

    # ---- validation ----------------------------------------------------------------

    async def _validated(
        self, raw: Any, argument_problems: list[str], *, against_worker: bool
    ) -> ProxyInput:
        """The input; else the workflow fails at once, naming every problem."""
        inp, problems, installation = await checked_input(
            raw, argument_problems, against_worker=against_worker
        )
        if installation is not None:
            self._carried.installation = installation
        if problems or inp is None:
            message = "invalid input: " + "; ".join(problems)
            self._note_error(message)
            self._set_state(ProxyState.FAILED)
            raise invalid_input(message)
        return inp

    # ---- the states: one method each -----------------------------------------------

    async def _lifecycle(self, inp: ProxyInput) -> None:
        """Run the state machine until the lifecycle fails or continues as new.

        Each state's method does that state's work and returns the state to go
        to next. The ending states are run()'s: `_terminating` (terminate or
        cancel, which stop this task from outside) and `_failed`.
        """
        steps: dict[ProxyState, Callable[[ProxyInput], Awaitable[ProxyState]]] = {
            ProxyState.PROVISIONING: self._provisioning,
            ProxyState.REPLACING: self._replacing,
            ProxyState.READY: self._ready,
            ProxyState.UNHEALTHY: self._unhealthy,
        }
        state = self._resumed_state()
        while True:
            state = await steps[state](inp)
            # A step can end normally after terminate began: a rotation whose
            # old instance's deletion completed as the cancel arrived. Its
            # instance is being deleted (run() deletes them all): nothing to go on with.
            self._raise_if_terminating(state)

    def _resumed_state(self) -> ProxyState:
        """Where this run's lifecycle starts: with no instance, or a continued run's."""
        if self._carried.current is not None:
            return ProxyState.READY  # a rotation under way resumes from Ready
        if self._carried.bringing_up is not None and self._carried.state in (
            ProxyState.PROVISIONING,
            ProxyState.REPLACING,
        ):
            return self._carried.state  # handed over in the middle of a bring-up
        if self._carried.next_generation == 0:
            return ProxyState.PROVISIONING
        return ProxyState.REPLACING  # continued after its instance went Unhealthy

    async def _provisioning(self, inp: ProxyInput) -> ProxyState:
        """Provisioning: bring up the first generation."""
        if self._carried.next_cause is None:
            self._carried.next_cause = self._cause(lifecycle_view.FIRST_START)
        self._enter(ProxyState.PROVISIONING)
        return await self._new_generation(inp)

    async def _replacing(self, inp: ProxyInput) -> ProxyState:
        """Replacing: bring up the next generation after one failed."""
        self._enter(ProxyState.REPLACING)
        return await self._new_generation(inp)

    async def _ready(self, inp: ProxyInput) -> ProxyState:
        """Ready: monitor the instance for a cycle; rotate it when due or asked.

        A rotation stays Ready: the old instance serves until the new one has
        passed its first probe (make before break).
        """
        if inp.monitor == "pool":
            outcome = await self._watched_by_pool(inp)
        else:
            outcome = await self._monitor(inp)
        if outcome is None:
            if await self._rotate(inp) == ProxyState.REPLACING:
                return ProxyState.REPLACING  # the old instance failed during the rotation
        elif outcome.reason in (MonitorReason.UNHEALTHY, MonitorReason.GONE):
            self._forgive_if_stable()
            self._unhealthy_cause = f"{outcome.reason}: {outcome.detail}"
            said = self._pool_said if inp.monitor == "pool" else None
            self._carried.next_cause = self._cause(
                lifecycle_view.failed_probes(self._unhealthy_cause, said)
            )
            self._unhealthy_disrupted = outcome.disruption is not None
            return ProxyState.UNHEALTHY
        else:
            self._forgive_if_stable()  # a monitor period passed with nothing to report
        await self._continue_as_new_if_suggested()
        return ProxyState.READY

    async def _unhealthy(self, inp: ProxyInput) -> ProxyState:
        """Unhealthy: retire the failed instance and spend the crash budget on it
        (not on one its platform took away)."""
        self._enter(ProxyState.UNHEALTHY)
        self._retire(self._carried.current)
        await self._count_failure(self._unhealthy_cause, disrupted=self._unhealthy_disrupted)
        await self._continue_as_new_if_suggested()
        return ProxyState.REPLACING

    async def _terminating(self, lifecycle: asyncio.Task[None]) -> None:
        """Terminating, then Terminated: stop the lifecycle, delete everything, record why."""
        if self._carried.state != ProxyState.TERMINATING:  # else a run handed over in it
            self._set_state(ProxyState.TERMINATING)
        lifecycle.cancel()
        # Deleting the instances at once is what ends the activities still
        # running on them (a monitor's or first probe's next probe finds
        # its instance gone), so the workflow closes with none pending.
        deleting = asyncio.create_task(self._cleanup())
        with contextlib.suppress(asyncio.CancelledError, ApplicationError, ActivityError):
            await lifecycle
        monitor = self._retired_monitor
        if monitor is not None and not monitor.done():
            self._let_go_of_lost_monitor = taken(LET_GO_OF_LOST_MONITOR)
        await deleting
        # Again: the lifecycle may have made or retired an instance while it unwound.
        await self._cleanup()
        await self._let_go_of_monitor()
        await self._settle_retired_monitor()
        self._carried.current = None
        self._show_instance(None)
        if self._delete_refused is not None:
            self._note_error(self._delete_refused)
            self._set_state(ProxyState.FAILED)
        else:
            self._set_state(ProxyState.TERMINATED)
        await self._publisher.delivered()

    def _raise_if_delete_refused(self) -> None:
        """After Terminating: a delete refused for good ends the proxy as Failed, saying why."""
        if self._delete_refused is not None:
            raise ApplicationError(
                self._delete_refused, type=ErrorType.PERMANENT, non_retryable=True
            )

    async def _failed(self, err: ApplicationError | ActivityError) -> ApplicationError:
        """Failed: delete everything; the error run() ends the workflow with."""
        reason = err.message if isinstance(err, ApplicationError) else failures.message(err)
        self._note_error(reason)
        await self._cleanup()
        if self._delete_refused is not None:
            reason = f"{reason}; {self._delete_refused}"
            self._note_error(reason)
        self._show_instance(None)
        self._set_state(ProxyState.FAILED)
        await self._publisher.delivered()
        return ApplicationError(reason, type=failures.ending_type(err), non_retryable=True)

    # ---- entering states -----------------------------------------------------------

    async def _new_generation(self, inp: ProxyInput) -> ProxyState:
        """Bring up a generation: Ready with it, or Replacing it within the crash budget."""
        try:
            ref = await self._bring_up(inp)
        except _InstanceFailed as failed:
            self._carried.next_cause = self._cause(lifecycle_view.failed_to_come_up(str(failed)))
            self._retire(failed.ref)
            await self._count_failure(str(failed), disrupted=failed.disrupted)
            return ProxyState.REPLACING
        self._become_ready(ref)
        return ProxyState.READY

    def _become_ready(self, ref: InstanceRef) -> None:
        """Enter Ready (or stay Ready, after a rotation) with `ref` serving."""
        self._raise_if_terminating(ProxyState.READY)
        carried = self._carried
        carried.current = ref
        carried.ready_since = workflow.now().isoformat()
        carried.rotate_reason = None  # a new instance is what a rotate asks for
        carried.disruptions_in_a_row = 0
        carried.cause, carried.next_cause = carried.next_cause, None
        carried.shown = ref
        carried.generation = ref.generation
        self._set_state(ProxyState.READY)

    def _enter(self, state: ProxyState) -> None:
        """Move the lifecycle (not run()'s ending) to `state`."""
        self._raise_if_terminating(state)
        self._set_state(state)

    def _raise_if_terminating(self, state: ProxyState) -> None:
        """End the lifecycle instead of moving it once terminate has begun.

        A lifecycle being stopped may still learn something late: a first
        probe that passed as terminate cancelled it. Terminating leads only
        to Terminated, so that news ends the lifecycle instead.
        """
        if self._carried.state == ProxyState.TERMINATING:
            raise asyncio.CancelledError(f"terminating, not entering {state}")

    def _set_state(self, state: ProxyState) -> None:
        """Change state as the transition table allows; publish it."""
        check_transition(self._carried.state, state)
        self._carried.state = state
        self._publish()

    # ---- bringing up a generation --------------------------------------------------

    async def _bring_up(self, inp: ProxyInput) -> InstanceRef:
        """Create a new generation, wait until it runs and passes one probe.

        Raises _InstanceFailed (carrying the instance, if one was made) for
        anything a replacement could fix; a Permanent error fails the workflow.
        """
        generation = self._carried.bringing_up
        if generation is None:
            generation = self._carried.next_generation
            self._carried.next_generation += 1
            self._carried.bringing_up = generation
        # While rotating, status keeps showing the instance that still serves.
        visible = self._carried.current is None
        ref = await self._create(inp, generation)
        if visible:
            self._show_instance(ref)
        try:
            ref = await self._provider_call(
                ProviderActivities.wait_running,
                InstanceInput(ref),
                policies.WAIT_RUNNING,
                f"wait for {ref.name} to run",
            )
            self._carried.own(ref)
            if visible:
                self._show_instance(ref)
            probe = await self._first_probe(inp, ref)
        except ActivityError as err:
            if failures.cancelled(err) or failures.cause_type(err) == ErrorType.PERMANENT:
                raise
            self._carried.bringing_up = None
            raise _InstanceFailed(
                f"{ref.name}: {failures.message(err)}",
                ref,
                disrupted=failures.cause_type(err) == ErrorType.INSTANCE_DISRUPTED,
            ) from err
        self._carried.last_probe = probe
        self._carried.bringing_up = None
        if not probe.ok:
            raise _InstanceFailed(
                f"{ref.name} never passed a probe: {probe.failure} ({probe.error})", ref
            )
        return ref

    async def _first_probe(self, inp: ProxyInput, ref: InstanceRef) -> ProbeSummary:
        """Probe until one passes or FIRST_PROBE_DEADLINE has passed.

        While the probes fail (a VM still booting, a target unreachable), the
        activity reports back now and then, so `status` shows the last failure,
        the attempts so far and when the instance will be written off.
        """
        what = f"first probe of {ref.endpoint} via {inp.health.target}"
        deadline = workflow.now() + FIRST_PROBE_DEADLINE
        report_after = FIRST_PROBE_FIRST_REPORT
        attempts = 0
        try:
            while True:
                left = max(timedelta(0), deadline - workflow.now())
                probe = await self._provider_call(
                    ProviderActivities.wait_healthy,
                    ProbeInput(
                        ref,
                        inp.health.target,
                        timeout_seconds=inp.health.timeout_seconds,
                        deadline_seconds=left.total_seconds(),
                        report_after_seconds=report_after.total_seconds(),
                    ),
                    policies.WAIT_HEALTHY,
                    what,
                )
                attempts += probe.attempts or 1
                probe = replace(probe, attempts=attempts)
                # The activity returns a failure early only while time is left.
                if probe.ok or left <= report_after:
                    return probe
                self._carried.last_probe = probe
                written_off = (deadline - workflow.now()).total_seconds()
                self._begin_wait(
                    what,
                    f"waiting for the {what}: {attempts} attempts failed, last "
                    f"{probe.failure}: {probe.error}; written off in {max(0, written_off):.0f}s "
                    f"(at {deadline.isoformat(timespec='seconds')})",
                )
                report_after = FIRST_PROBE_REPORT_EVERY
        finally:
            self._end_wait(what)

    async def _create(self, inp: ProxyInput, generation: int) -> InstanceRef:
        """Create the instance; shielded so terminate never orphans a half-made one.

        If terminate arrives mid-create, cleanup awaits this same task and
        deletes what it made.
        """
        info = workflow.info()
        workflow_id = info.workflow_id
        # Published before the create starts, so orphan GC never mistakes an
        # instance for an orphan in the moment between create and record.
        # create_instance derives the same name from the same scope.
        self._pending_name = instance_name(
            workflow_id,
            generation,
            installation=self._carried.installation,
            namespace=info.namespace,
        )
        self._publish()
        self._creating = asyncio.create_task(
            self._provider_call(
                ProviderActivities.create_instance,
                CreateInstanceInput(
                    provider=inp.provider,
                    owner_id=workflow_id,
                    generation=generation,
                    port=inp.port,
                    labels=dict(inp.labels),
                    placement=inp.placement.as_dict(),
                    installation=self._carried.installation or "",
                ),
                policies.CREATE,
                f"create generation {generation} on {inp.provider}",
            )
        )
        try:
            ref: InstanceRef = await asyncio.shield(self._creating)
        except ActivityError as err:
            self._creating = None
            self._pending_name = None
            if failures.cause_type(err) == ErrorType.PERMANENT:
                raise ApplicationError(
                    f"provider {inp.provider!r} refused to create: {failures.message(err)}",
                    type=ErrorType.PERMANENT,
                    non_retryable=True,
                ) from err
            # Quota and provider trouble are waited out in _provider_call: any
            # other failure writes this generation off.
            self._carried.bringing_up = None
            raise _InstanceFailed(f"create failed: {failures.message(err)}") from err
        self._creating = None
        self._pending_name = None
        # A bring-up resumed after continue-as-new adopts what it made before.
        made_before = any(known.provider_id == ref.provider_id for known in self._carried.owned)
        self._carried.own(ref)
        if generation > 0 and not made_before:
            self._carried.replacements += 1
        self._publish()
        return ref

    # ---- Ready's work: monitor, rotate ---------------------------------------------

    async def _monitor(self, inp: ProxyInput) -> MonitorOutcome | None:
        """Run the monitor; None means rotate now: max lifetime reached, or a `rotate` signal."""
        await self._settle_retired_monitor()
        ref = self._carried.current
        assert ref is not None
        handle = self._start_monitor(inp, ref)

        def wake() -> bool:
            return handle.done() or self._carried.rotate_reason is not None

        while True:
            deadline = self._next_deadline(inp)
            if deadline is None:
                await self._wait_untimed(handle, wake)
            else:
                timeout, summary = deadline
                try:
                    await workflow.wait_condition(wake, timeout=timeout, timeout_summary=summary)
                except asyncio.CancelledError:
                    # Terminate or cancel: this wait is cancelled, the monitor is
                    # not (it is a task of its own). Cancel it too, and have _terminating
                    # await it, so the workflow never closes with the monitor pending.
                    handle.cancel()
                    self._retired_monitor = handle
                    raise
                except TimeoutError:
                    if summary == STABLE_SUMMARY:
                        # Status says now that the crash budget is whole again.
                        self._forgive_if_stable()
                        self._publish()
                        continue
                    self._rotation_due(handle)
                    return None
            if handle.done():
                break
            self._rotation_due(handle)  # a rotate signal
            return None
        outcome: MonitorOutcome = await handle
        self._raise_if_stopping()
        self._carried.last_probe = outcome.last_probe
        return outcome

    def _next_deadline(self, inp: ProxyInput) -> tuple[timedelta, str] | None:
        """Ready's nearer timer, with its summary: the lifetime's end or the crash budget whole."""
        deadlines = [
            (left, summary)
            for left, summary in (
                (self._lifetime_left(inp), LIFETIME_SUMMARY),
                (self._stable_left(), STABLE_SUMMARY),
            )
            if left is not None
        ]
        return min(deadlines, key=lambda deadline: deadline[0]) if deadlines else None

    def _start_monitor(self, inp: ProxyInput, ref: InstanceRef) -> ActivityHandle[MonitorOutcome]:
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
            cancellation_type=self._cancellation(),
        )

    async def _watched_by_pool(self, inp: ProxyInput) -> MonitorOutcome | None:
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
                self._failing is not None
                or self._carried.rotate_reason is not None
                or self._may_hand_over()
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
                    self._forgive_if_stable()  # status says the crash budget is whole again
                    self._publish()
                    continue
            if self._carried.rotate_reason is not None:
                return None
            if self._failing is None:
                # Woken by its history's length: `_ready` hands over.
                return MonitorOutcome(MonitorReason.HANDOVER, self._carried.last_probe)
            outcome = await self._confirm_failing(inp, ref)
            if outcome.reason in (MonitorReason.UNHEALTHY, MonitorReason.GONE):
                return outcome

    async def _confirm_failing(self, inp: ProxyInput, ref: InstanceRef) -> MonitorOutcome:
        """Probe `ref` once, as the pool's monitor said it fails: the member's own verdict."""
        said, self._failing = self._failing, None
        self._pool_said = said
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
            cancellation_type=self._cancellation(),
        )
        self._carried.last_probe = outcome.last_probe
        return outcome

    async def _rotate(self, inp: ProxyInput) -> ProxyState:
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
        except _InstanceFailed as failed:
            if self._carried.current is None:  # the old one failed meanwhile
                why = lifecycle_view.failed_to_come_up(f"rotation failed: {failed}")
                self._carried.next_cause = self._cause(why)
            self._retire(failed.ref)
            await self._count_failure(f"rotation failed: {failed}", disrupted=failed.disrupted)
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
            await self._wait(
                f"draining {old.name} ({old.endpoint}) for {inp.drain_seconds}s before deleting it",
                timedelta(seconds=inp.drain_seconds),
                summary=f"drain {old.name} {inp.drain_seconds}s",
                interruptible=True,
            )
        await self._delete_and_wait(old)
        await self._settle_retired_monitor()
        return ProxyState.READY

    def _rotation_due(self, handle: ActivityHandle[MonitorOutcome]) -> None:
        """A rotation begins: the old monitor goes on watching until the replacement is Ready."""
        self._old_monitor = handle

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
        if self._old_monitor is None:
            # Recorded rotations cancelled the old monitor and brought up inline.
            return await self._bring_up(inp)
        bring_up = asyncio.create_task(self._bring_up(inp))
        try:
            while not bring_up.done():
                watching = self._old_monitor
                await self._until_done_or_ended(bring_up, watching)
                if bring_up.done() or watching is None or self._old_monitor is not watching:
                    continue  # done, or the monitor taken by a hand-over
                self._old_monitor = None
                outcome: MonitorOutcome | None = None
                with contextlib.suppress(ActivityError):
                    outcome = await watching
                if outcome is not None:
                    self._carried.last_probe = outcome.last_probe
                if outcome is not None and outcome.reason in (
                    MonitorReason.UNHEALTHY,
                    MonitorReason.GONE,
                ):
                    self._old_instance_failed(old, outcome)
                else:
                    self._old_monitor = self._start_monitor(inp, old)  # another period
        except BaseException:
            bring_up.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApplicationError, ActivityError):
                await bring_up
            self._stop_watching_old()
            raise
        self._stop_watching_old()
        return await bring_up

    async def _bring_up_watched_by_pool(self, inp: ProxyInput, old: InstanceRef) -> InstanceRef:
        """A pool member's rotation: the pool monitors the old instance while it advertises it.

        Its word that the old instance fails is checked here as in Ready; a
        confirmed failure withdraws the old instance, as a monitor's would.
        """
        bring_up = asyncio.create_task(self._bring_up(inp))
        try:
            # Until the bring-up is done, or the old instance failed (withdrawn).
            while self._carried.current == old:
                await workflow.wait_condition(lambda: bring_up.done() or self._failing is not None)
                if bring_up.done():
                    break
                outcome = await self._confirm_failing(inp, old)
                if outcome.reason in (MonitorReason.UNHEALTHY, MonitorReason.GONE):
                    self._old_instance_failed(old, outcome)
        except BaseException:
            bring_up.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApplicationError, ActivityError):
                await bring_up
            raise
        finally:
            self._failing = None  # about the old instance: the new one is checked afresh
        return await bring_up

    async def _until_done_or_ended(
        self, bring_up: asyncio.Task[InstanceRef], watching: ActivityHandle[MonitorOutcome] | None
    ) -> None:
        """Until the bring-up is done, or the old monitor ended or was taken by a hand-over."""
        await workflow.wait_condition(
            lambda: (
                bring_up.done()
                or self._old_monitor is not watching
                or (watching is not None and watching.done())
            )
        )

    def _old_instance_failed(self, old: InstanceRef, outcome: MonitorOutcome) -> None:
        """The instance being rotated out failed first: withdraw it; the rotation replaces it."""
        self._forgive_if_stable()
        self._note_error(
            f"{old.name} failed while being rotated out: {outcome.reason}: {outcome.detail}"
        )
        self._enter(ProxyState.UNHEALTHY)
        self._retire(old)  # no longer shown nor advertised
        self._enter(ProxyState.REPLACING)

    def _stop_watching_old(self) -> None:
        """The rotation is over: the old monitor ends as _rotate_now's does."""
        watching, self._old_monitor = self._old_monitor, None
        if watching is not None:
            self._rotate_now(watching)

    async def _wait_untimed(self, handle: ActivityHandle[MonitorOutcome], wake: Any) -> None:
        """Wait for the monitor or a rotate signal, with no timer.

        A terminate cancels the monitor here, as it does in `_monitor`.
        """
        try:
            await workflow.wait_condition(wake)
        except asyncio.CancelledError:
            handle.cancel()
            if taken(LET_GO_OF_LOST_MONITOR):
                # As in _monitor: _terminating awaits it, once the instance is gone.
                # A run that meets the question on replay without the marker
                # (a 0.3.10 terminate) awaited it here.
                self._retired_monitor = handle
                raise
            with contextlib.suppress(ActivityError, asyncio.CancelledError):
                await handle
            raise

    def _rotate_now(self, handle: ActivityHandle[MonitorOutcome]) -> None:
        """Make before break: the old monitor ends once its instance is deleted,
        and is awaited then (_settle_retired_monitor)."""
        handle.cancel()
        self._retired_monitor = handle

    async def _let_go_of_monitor(self) -> None:
        """At a terminate, every instance gone: stop waiting for a monitor its worker lost.

        A monitor on a live worker ends within its next probe (MONITOR_LET_GO);
        one that has not is left to the server's heartbeat timeout, up to
        600 s, which the proxy would otherwise spend in Terminating with
        nothing left to do. While a delete is refused the instance still
        answers, so its monitor is waited for as before.
        """
        handle = self._retired_monitor
        if (
            handle is None
            or handle.done()
            or not self._let_go_of_lost_monitor
            or self._delete_refused is not None
        ):
            return
        assert self._input is not None
        health = self._input.health
        grace = min(
            timedelta(seconds=health.interval_seconds + health.timeout_seconds) + MONITOR_LET_GO,
            policies.monitor_heartbeat(policies.MONITOR, health.heartbeat_timeout_seconds),
        )
        summary = f"monitor's end {int(grace.total_seconds())}s"
        self._begin_wait(summary, "the cancelled monitor to end (its worker may be lost)")
        try:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(handle.done, timeout=grace, timeout_summary=summary)
        finally:
            self._end_wait(summary)
        if not handle.done():
            self._retired_monitor = None  # lost with its worker: the server ends it

    async def _settle_retired_monitor(self) -> None:
        """Await a monitor cancelled for a rotation, so its ending is retrieved.

        With WAIT_CANCELLATION_COMPLETED this returns once the monitor has
        ended: at its next probe after its instance is deleted, or when its
        next heartbeat carries the cancel. Either way nothing stays pending.
        """
        handle, self._retired_monitor = self._retired_monitor, None
        if handle is not None:
            with contextlib.suppress(ActivityError):
                await handle

    # ---- retiring instances, the crash budget --------------------------------------

    def _retire(self, ref: InstanceRef | None) -> None:
        """Stop using an instance and delete it in the background."""
        if ref is None:
            return
        if ref == self._carried.current:
            self._carried.current = None
            self._show_instance(None)
        if ref.provider_id not in self._deletions:
            self._deletions[ref.provider_id] = asyncio.create_task(self._delete_and_wait(ref))

    def _stable_left(self) -> timedelta | None:
        """Time until the current instance has been Ready for STABLE_AFTER, if that matters."""
        carried = self._carried
        if carried.failures_in_a_row == 0 or carried.ready_since is None:
            return None
        return max(timedelta(0), STABLE_AFTER - self._ready_for())

    def _forgive_if_stable(self) -> None:
        """An instance that stayed healthy long enough resets the crash budget."""
        if self._ready_for() >= STABLE_AFTER:
            self._carried.failures_in_a_row = 0

    async def _count_failure(self, reason: str, *, disrupted: bool = False) -> None:
        """Spend the crash budget; fail the workflow when it is gone, else back off.

        The first failure after a healthy spell is replaced at once; repeated
        ones wait longer each time. An instance its platform took away
        (`disrupted`: preempted, interrupted, evicted) is no failure of the
        proxy's: it is counted apart and never fails the proxy
        (DISRUPTIONS_SPARE_THE_CRASH_BUDGET), but a platform that keeps taking instances away
        before one is Ready is backed off from the same way, so it costs a
        create every few minutes, not a loop of them.
        """
        self._raise_if_stopping()
        carried = self._carried
        if disrupted and taken(DISRUPTIONS_SPARE_THE_CRASH_BUDGET):
            carried.disruptions += 1
            carried.disruptions_in_a_row += 1
            self._note_error(f"platform disruption, no crash counted: {reason}")
            await self._back_off(carried.disruptions_in_a_row, "instances taken away")
            return
        carried.failures_in_a_row += 1
        self._note_error(reason)
        in_a_row = carried.failures_in_a_row
        if in_a_row >= CRASH_BUDGET:
            raise ApplicationError(
                f"gave up after {in_a_row} failed instances in a row; last: {reason}",
                type=ErrorType.CRASH_LOOP,
                non_retryable=True,
            )
        await self._back_off(in_a_row, "failed instances")

    async def _back_off(self, in_a_row: int, what: str) -> None:
        """Replace the first of a row at once; wait REPLACE_BACKOFF before each after."""
        if in_a_row == 1:
            return
        delay = REPLACE_BACKOFF.delay(in_a_row - 2)
        await self._wait(
            f"backing off after {in_a_row} {what} in a row",
            delay,
            summary=f"back off {int(delay.total_seconds())}s",
            interruptible=False,  # the lifecycle is cancelled on terminate, and this timer with it
        )

    # ---- provider calls ------------------------------------------------------------

    async def _provider_call(
        self,
        activity: Callable[[ProviderActivities, A], Awaitable[R]],
        arg: A,
        profile: policies.ActivityProfile,
        summary: str,
        *,
        interruptible: bool = True,
    ) -> R:
        """Execute one provider activity; wait out quota and provider trouble on visible timers.

        Transient errors (5xx, 429, timeouts, a refused API connection) and
        activity timeouts are not retried inside Temporal, where nothing shows
        them, but waited out here: `status.waiting_for` says "waiting for
        provider: <message>", for PROVIDER_WAIT, doubling each time. An
        outage never spends the crash budget. Terminate and cancel end an
        `interruptible` call between attempts at once; a completed activity's
        result is never thrown away, so a create that succeeded is cleaned up.
        """
        # The lifecycle's own calls (interruptible: one at a time) carry their
        # wait across continue-as-new; cleanup's deletions, several at once,
        # each keep their own and start again in the next run.
        carried = interruptible
        wait = (self._carried.provider_wait if carried else None) or ProviderWait(since="")
        try:
            return await self._call_waiting_out_the_provider(
                activity, arg, profile, summary, interruptible=interruptible, wait=wait
            )
        finally:
            # The wait is over, however it ended (a hand-over carried a copy);
            # status shows it no more from the next publish on.
            self._waits.pop(summary, None)
            if carried:
                self._carried.provider_wait = None

    async def _call_waiting_out_the_provider(
        self,
        activity: Callable[[ProviderActivities, A], Awaitable[R]],
        arg: A,
        profile: policies.ActivityProfile,
        summary: str,
        *,
        interruptible: bool,
        wait: ProviderWait,
    ) -> R:
        """_provider_call's loop; `wait` is its progress, carried for the lifecycle's calls."""
        carried = interruptible
        while True:
            if interruptible:
                self._raise_if_stopping()
            if wait.shown:  # a wait this run took over
                self._show_calling_again(summary, wait)
            try:
                self._in_flight += 1
                try:
                    result = await policies.execute(
                        activity,
                        arg,
                        profile,
                        summary,
                        retry_policy=policies.PROVIDER_RETRY,
                        cancellation_type=self._cancellation(),
                    )
                finally:
                    self._in_flight -= 1
                return result
            except ActivityError as err:
                if interruptible and not failures.cancelled(err):
                    self._raise_if_stopping()
                if failures.cause_type(err) == ErrorType.QUOTA_EXCEEDED:
                    waiting_for = "quota"
                    delay = failures.next_retry_delay(err) or QUOTA_RETRY_DELAY
                elif failures.provider_trouble(err):
                    waiting_for = "provider"
                    delay = failures.next_retry_delay(err) or PROVIDER_WAIT.delay(
                        wait.provider_failures
                    )
                    wait.provider_failures += 1
                else:
                    raise
                wait.failed_calls += 1
                wait.since = wait.since or workflow.now().isoformat(timespec="seconds")
                if carried:
                    self._carried.provider_wait = wait
                self._note_error(failures.message(err))
                wait.shown = (
                    f"waiting for {waiting_for}: {failures.message(err)} "
                    f"(since {wait.since}, {wait.failed_calls} failed calls)"
                )
                self._show_calling_again(summary, wait)
                await self._wait(
                    wait.shown,
                    delay,
                    summary=f"waiting for {waiting_for} ({summary})",
                    interruptible=interruptible,
                )
                if carried:
                    await self._hand_over_if_long()
                elif self._carried.state == ProxyState.TERMINATING:
                    await self._hand_over_terminating_if_long()

    async def _cleanup_call(
        self,
        activity: Callable[[ProviderActivities, A], Awaitable[R]],
        arg: A,
        profile: policies.ActivityProfile,
        summary: str,
    ) -> R:
        """A provider call that terminate does not interrupt: the deletes that end a proxy."""
        return await self._provider_call(activity, arg, profile, summary, interruptible=False)

    async def _wait(
        self, waiting_for: str, delay: timedelta, *, summary: str, interruptible: bool
    ) -> None:
        """Sleep on a timer while status and the Web UI say what for.

        An interruptible wait ends at once on terminate or cancel (raising
        CancelledError), instead of when its timer fires.
        """
        self._begin_wait(summary, waiting_for)
        try:
            if interruptible:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: self._terminate_reason is not None,
                        timeout=delay,
                        timeout_summary=summary,
                    )
                self._raise_if_stopping()
            else:
                await workflow.sleep(delay, summary=summary)
        finally:
            self._end_wait(summary)

    async def _delete_and_wait(self, ref: InstanceRef) -> None:
        """Delete and wait until gone; gives up only when the provider refuses for good.

        Quota and provider trouble are waited out however long they last (a
        leaked instance bills every hour). A Permanent refusal (the provider
        says the instance is not ours: its tags name another owner) would be
        refused again every time: the proxy stops trying and ends as Failed.
        """
        while True:
            try:
                await delete_until_gone(ref, self._cleanup_call, policies.DELETION, ref.name)
            except ActivityError as err:
                if failures.cancelled(err):
                    raise  # the caller was cancelled; cleanup deletes what is still owned
                self._note_error(f"deleting {ref.name}: {failures.message(err)}")
                if failures.cause_type(err) == ErrorType.PERMANENT:
                    self._give_up_deleting(ref, failures.message(err))
                    return
                await workflow.sleep(
                    PERMANENT_DELETE_RETRY_DELAY, summary=f"retry deleting {ref.name}"
                )
                continue
            self._carried.disown(ref)
            self._deletions.pop(ref.provider_id, None)
            self._publish()
            return

    def _give_up_deleting(self, ref: InstanceRef, refusal: str) -> None:
        """Stop deleting an instance the provider refuses to delete; end the proxy as Failed.

        The instance is forgotten (no cleanup asks again) and named in the
        reason, so an operator can look at it; terminate machinery deletes
        everything else the proxy owns, as it does on a terminate signal.
        """
        self._carried.disown(ref)
        self._deletions.pop(ref.provider_id, None)
        reason = (
            f"gave up deleting {ref.name} ({ref.provider_id}): the provider refused "
            f"for good: {refusal}"
        )
        self._delete_refused = self._delete_refused or reason
        self._note_error(reason)
        if self._terminate_reason is None:
            self._terminate_reason = reason
        self._publish()

    # ---- ending --------------------------------------------------------------------

    async def _cleanup(self) -> None:
        """Delete every instance this workflow still owns, including one mid-create."""
        self._carried.current = None  # ending, not replacing: nothing to count
        creating = self._creating
        if creating is not None:
            try:
                ref = await creating
                self._carried.own(ref)
            except (ActivityError, asyncio.CancelledError):
                pass  # nothing was made that we know of; orphan GC covers the rest
            self._creating = None
        for ref in list(self._carried.owned):
            self._retire(ref)
        await asyncio.gather(*self._deletions.values())

    async def _continue_as_new_if_suggested(self) -> None:
        """Between monitor cycles: hand over to a new run when the server suggests it
        or the run passed EVENT_BUDGET."""
        if not _history_long():
            return
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._terminate_reason is not None:
            return  # run() is about to clean up; a new run would lose the signal
        if self._deletions and not self._idle_deletions():
            # Their activities would report to a closed run (a warning in the
            # worker's log): continue after the next monitor cycle instead,
            # rather than leave the instance unmonitored while they finish.
            return
        await self._continue_as_new()

    def _may_hand_over(self) -> bool:
        """A Ready run's history is long, and neither a terminate nor a deletion holds
        its handover back (`_continue_as_new_if_suggested` would refuse it: a wake
        for it would come again at once, for ever)."""
        return (
            self._terminate_reason is None
            and _history_long()
            and (not self._deletions or self._idle_deletions())
        )

    def _idle_deletions(self) -> bool:
        """Whether every pending deletion is between calls: waiting out quota or an outage.

        Such a deletion starts again in the next run (`_restore`), so it no
        longer holds a run back that waits for days.
        """
        return self._in_flight == 0

    async def _hand_over_if_long(self) -> None:
        """In the middle of a long wait: continue as new once the history is long.

        A wait for quota or a provider costs about 11 events a call (every 3
        minutes for quota): without this, a month of it would pass Temporal's
        51,200-event limit. Called between two calls of the wait, with none
        in flight; the next run resumes the bring-up where this one was
        (`CarriedState.bringing_up`, `CarriedState.provider_wait`).
        """
        if not _history_long() or self._in_flight or self._terminate_reason is not None:
            return
        monitor = self._retired_monitor
        if monitor is not None and not monitor.done():
            return  # a rotation's old monitor ends within a heartbeat: at the next call
        watching, self._old_monitor = self._old_monitor, None
        if watching is not None:
            # A rotation's old monitor: the next run starts another.
            watching.cancel()
            with contextlib.suppress(ActivityError):
                await watching
        await self._settle_retired_monitor()
        await workflow.wait_condition(workflow.all_handlers_finished)
        await self._publisher.delivered()
        if self._terminate_reason is None:
            await self._continue_as_new()

    async def _hand_over_terminating_if_long(self) -> None:
        """Terminating, a delete waiting out quota or an outage: continue as new once long.

        As `_hand_over_if_long`, between two calls with none in flight; the
        next run restarts every deletion still owed (`_restore`) and goes
        straight back to Terminating with the same reason.
        """
        if not _history_long() or self._in_flight:
            return
        monitor = self._retired_monitor
        if monitor is not None and not monitor.done():
            return
        await workflow.wait_condition(workflow.all_handlers_finished)
        await self._publisher.delivered()
        if self._in_flight:
            return  # another deletion called its provider meanwhile: at its next wait
        self._carried.terminating = self._terminate_reason
        self._carried.delete_refused = self._delete_refused
        await self._continue_as_new()

    async def _continue_as_new(self) -> None:
        """Hand over to a new run, carrying the state as it is now."""
        assert self._input is not None
        self._publisher.upsert_owed()
        workflow.continue_as_new(
            args=[
                self._input.model_dump(mode="json", exclude_none=True),
                # A copy: unwinding this run's tasks must not change what is carried.
                copy.deepcopy(self._carried),
            ]
        )

    def _restore(self, carried: CarriedState) -> None:
        """Take over a previous run's state; delete what it was still deleting."""
        self._carried = carried
        for ref in carried.owned:
            if ref != carried.current and ref.generation != carried.bringing_up:
                self._retire(ref)

    def _result(self, state: ProxyState, reason: str) -> ProxyResult:
        return ProxyResult(state, reason, self._carried.generation, self._carried.replacements)

    # ---- visibility ----------------------------------------------------------------

    def _lifetime_left(self, inp: ProxyInput) -> timedelta | None:
        if inp.max_lifetime_seconds is None:
            return None
        return max(timedelta(0), timedelta(seconds=inp.max_lifetime_seconds) - self._ready_for())

    def _ready_for(self) -> timedelta:
        ready_since = self._carried.ready_since
        if ready_since is None:
            return timedelta(0)
        return workflow.now() - datetime.fromisoformat(ready_since)

    def _cancellation(self) -> ActivityCancellationType:
        """How a cancelled activity ends: waited for, so none outlives the workflow."""
        return ActivityCancellationType.WAIT_CANCELLATION_COMPLETED

    def _raise_if_stopping(self) -> None:
        """End the lifecycle's current step once terminate or cancel has arrived.

        A cancelled activity that is waited for may still complete normally
        (its instance was deleted under it); what follows must not act on it.
        """
        if self._terminate_reason is not None:
            raise asyncio.CancelledError(self._terminate_reason)

    @staticmethod
    def _cause(why: str) -> InstanceCause:
        """Why the next generation is made, decided now."""
        return instance_cause(why, workflow.now().isoformat(timespec="seconds"))

    def _note_error(self, message: str) -> None:
        self._carried.last_error = message
        self._carried.last_error_at = workflow.now().isoformat(timespec="seconds")

    def _begin_wait(self, key: str, waiting_for: str) -> None:
        self._waits.pop(key, None)  # re-inserted: the newest wait is the one shown
        self._waits[key] = waiting_for
        self._show_waits()

    def _show_calling_again(self, summary: str, wait: ProviderWait) -> None:
        """Keep the wait in status while the call is tried again, under the wait's own timer.

        Between the timer and the call's answer the proxy is still waiting:
        status says so instead of nothing. Not published here, which would
        move the commands that publishing issues in recorded histories: the
        timer's end publishes it, and `status` reads it anyway.
        """
        self._waits.pop(summary, None)
        self._waits[summary] = f"{wait.shown}, calling again"

    def _end_wait(self, key: str) -> None:
        # Also called from `finally` blocks, which run when the worker evicts
        # this run from its cache and closes its coroutines: outside the
        # workflow's event loop no workflow call may run, and none is needed.
        if self._waits.pop(key, None) is not None and workflow.in_workflow():
            self._show_waits()

    def _show_waits(self) -> None:
        self._publish()  # status.waiting_for is the newest of self._waits

    def _show_instance(self, ref: InstanceRef | None) -> None:
        """Have status show `ref` (None: no instance); its generation stays shown after."""
        if ref is not None:
            self._carried.generation = ref.generation
        self._carried.shown = ref
        self._publish()

    def _publish(self) -> None:
        """The one step that tells the world: search attributes, current details, the pool."""
        names = {ref.name for ref in self._carried.owned}
        if self._pending_name:
            names.add(self._pending_name)
        self._publisher.publish(self._status_now(), names)

    def _status_now(self) -> ProxyStatus:
        """What `status` answers: the carried state and what this run is doing."""
        return status_of(
            self._carried,
            waiting_for=next(reversed(self._waits.values()), None),
            terminate_reason=self._terminate_reason,
        )


def _history_long() -> bool:
    """Whether this run's history is long enough to hand over (server's word or EVENT_BUDGET)."""
    info = workflow.info()
    return info.is_continue_as_new_suggested() or info.get_current_history_length() >= EVENT_BUDGET
