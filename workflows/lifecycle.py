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

What the states use is one object each, beside this file, so the states
read as the lifecycle they are: ProviderCalls (provider calls that wait out
quota and outages on visible timers), Deletions (until gone, or refused for
good), CrashBudget, Monitors (Ready's watch, and the monitors on their way
out), Rotation (make before break) and HandOver (continue-as-new).

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.errors import invalid_input
    from activities.models import (
        CreateInstanceInput,
        InstanceInput,
        InstanceRef,
        MonitorOutcome,
        MonitorReason,
        ProbeInput,
        ProbeSummary,
    )
    from activities.provider import ProviderActivities
    from contract import (
        INSTANCE_FAILING_SIGNAL,
        PROXY_LIFECYCLE,
        ROTATE_SIGNAL,
        TERMINATE_SIGNAL,
        ErrorType,
        ProxyState,
    )
    from providers.naming import instance_name
    from workflows import failures, lifecycle_view, policies
    from workflows.early_signals import EarlySignals
    from workflows.failures import InstanceFailed
    from workflows.inputs import ProxyInput, continued_state, signal_reason
    from workflows.lifecycle_calls import ProviderCalls, Waits
    from workflows.lifecycle_carried import (
        CarriedState,
        InstanceCause,
        ProxyStatus,
        instance_cause,
        status_of,
    )
    from workflows.lifecycle_crash_budget import CrashBudget
    from workflows.lifecycle_deletions import Deletions
    from workflows.lifecycle_handover import HandOver
    from workflows.lifecycle_input import checked_input
    from workflows.lifecycle_monitors import Monitors
    from workflows.lifecycle_publish import StatusPublisher
    from workflows.lifecycle_rotation import Rotation
    from workflows.lifecycle_states import check_transition
    from workflows.patches import LIFECYCLE_FLOOR, keep_floor

FIRST_PROBE_DEADLINE = timedelta(minutes=2)
# A failing first probe is reported to the workflow (and so to `status`)
# after this long, then every FIRST_PROBE_REPORT_EVERY until the deadline.
FIRST_PROBE_FIRST_REPORT = timedelta(seconds=10)
FIRST_PROBE_REPORT_EVERY = timedelta(seconds=20)


@dataclass(frozen=True)
class ProxyResult:
    """What a finished ProxyLifecycle returns."""

    state: ProxyState
    reason: str
    generation: int
    replacements: int


# Outside the SDK's workflow sandbox, as ProxyPool is (workflows/pool.py): in
# it, each task paid for the sandbox's module proxies and each new instance
# (every run, every replay after a restart or an eviction) imported the
# lifecycle's modules again; replaying the recorded lifecycles took 2.3 times
# the CPU inside it (docs/benchmarks.md). The sandbox still checks this code:
# tests/workflows/test_replay.py replays every recording inside it too, where
# a clock, I/O or randomness outside the workflow API fails.
SANDBOXED = False


@workflow.defn(name=PROXY_LIFECYCLE, sandboxed=SANDBOXED)
class ProxyLifecycle:
    def __init__(self) -> None:
        # What outlives this run; `status` is computed from it. The rest is this run's.
        self._carried = CarriedState()
        self._terminate_reason: str | None = None
        self._input: ProxyInput | None = None
        self._creating: asyncio.Task[InstanceRef] | None = None
        self._pending_name: str | None = None
        # Why Ready's monitor found the instance failing, for Unhealthy to record,
        # and whether its platform took it away.
        self._unhealthy_cause = ""
        self._unhealthy_disrupted = False
        self._publisher = StatusPublisher()
        self._early = EarlySignals()
        # A pool member's first run, whose start its pool knows.
        self._quiet_start = False
        # What `status.waiting_for` is read from, which a query may ask at any time.
        self._waits = Waits(self._publish)

    def _assemble(self) -> None:
        """The parts that work on the carried state, once this run has it (`run`).

        A continued run's state replaces the one `__init__` made; nothing but
        a signal handler, whose effect the takeover replays, touches that one.
        """
        carried = self._carried
        self._calls = ProviderCalls(
            self._waits,
            carried,
            terminate_reason=lambda: self._terminate_reason,
            note_error=self._note_error,
            between_calls=lambda own: self._hand_over.between_calls(own),
        )
        self._deletions = Deletions(
            self._calls,
            carried,
            note_error=self._note_error,
            publish=self._publish,
            terminate=self._terminate_for,
        )
        self._budget = CrashBudget(
            self._calls,
            carried,
            raise_if_stopping=self._raise_if_stopping,
            note_error=self._note_error,
        )
        self._monitors = Monitors(
            self._waits,
            carried,
            self._budget,
            publish=self._publish,
            raise_if_stopping=self._raise_if_stopping,
            hand_over_due=lambda: self._hand_over.due(),
        )
        self._hand_over = HandOver(
            carried,
            self._calls,
            self._deletions,
            self._monitors,
            self._publisher,
            proxy_input=lambda: self._input,
            terminate_reason=lambda: self._terminate_reason,
        )
        self._rotation = Rotation(
            carried,
            self._calls,
            self._deletions,
            self._monitors,
            self._budget,
            bring_up=self._bring_up,
            become_ready=self._become_ready,
            retire=self._retire,
            withdraw=self._withdraw,
            cause=self._cause,
        )

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
            self._carried = state
        self._assemble()
        if state is not None:
            self._restore()
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
        self._monitors.failing = signal_reason(request, "the pool's monitor")

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
            outcome = await self._monitors.watched_by_pool(inp)
        else:
            outcome = await self._monitors.watch(inp)
        if outcome is None:
            if await self._rotation.rotate(inp) == ProxyState.REPLACING:
                return ProxyState.REPLACING  # the old instance failed during the rotation
        elif outcome.reason in (MonitorReason.UNHEALTHY, MonitorReason.GONE):
            self._budget.forgive_if_stable()
            self._unhealthy_cause = f"{outcome.reason}: {outcome.detail}"
            said = self._monitors.pool_said if inp.monitor == "pool" else None
            self._carried.next_cause = self._cause(
                lifecycle_view.failed_probes(self._unhealthy_cause, said)
            )
            self._unhealthy_disrupted = outcome.disruption is not None
            return ProxyState.UNHEALTHY
        else:
            self._budget.forgive_if_stable()  # a monitor period passed with nothing to report
        await self._hand_over.if_suggested()
        return ProxyState.READY

    async def _unhealthy(self, inp: ProxyInput) -> ProxyState:
        """Unhealthy: retire the failed instance and spend the crash budget on it
        (not on one its platform took away)."""
        self._enter(ProxyState.UNHEALTHY)
        self._retire(self._carried.current)
        await self._budget.count_failure(self._unhealthy_cause, disrupted=self._unhealthy_disrupted)
        await self._hand_over.if_suggested()
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
        self._monitors.decide_let_go()
        await deleting
        # Again: the lifecycle may have made or retired an instance while it unwound.
        await self._cleanup()
        assert self._input is not None
        await self._monitors.let_go_of_lost(
            self._input.health, delete_refused=self._deletions.refused is not None
        )
        await self._monitors.settle_retired()
        self._carried.current = None
        self._show_instance(None)
        if self._deletions.refused is not None:
            self._note_error(self._deletions.refused)
            self._set_state(ProxyState.FAILED)
        else:
            self._set_state(ProxyState.TERMINATED)
        await self._publisher.delivered()

    def _raise_if_delete_refused(self) -> None:
        """After Terminating: a delete refused for good ends the proxy as Failed, saying why."""
        if self._deletions.refused is not None:
            raise ApplicationError(
                self._deletions.refused, type=ErrorType.PERMANENT, non_retryable=True
            )

    async def _failed(self, err: ApplicationError | ActivityError) -> ApplicationError:
        """Failed: delete everything; the error run() ends the workflow with."""
        reason = err.message if isinstance(err, ApplicationError) else failures.message(err)
        self._note_error(reason)
        await self._cleanup()
        if self._deletions.refused is not None:
            reason = f"{reason}; {self._deletions.refused}"
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
        except InstanceFailed as failed:
            self._carried.next_cause = self._cause(lifecycle_view.failed_to_come_up(str(failed)))
            self._retire(failed.ref)
            await self._budget.count_failure(str(failed), disrupted=failed.disrupted)
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

        Raises InstanceFailed (carrying the instance, if one was made) for
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
            ref = await self._calls.call(
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
            raise InstanceFailed(
                f"{ref.name}: {failures.message(err)}",
                ref,
                disrupted=failures.cause_type(err) == ErrorType.INSTANCE_DISRUPTED,
            ) from err
        self._carried.last_probe = probe
        self._carried.bringing_up = None
        if not probe.ok:
            raise InstanceFailed(
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
                probe = await self._calls.call(
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
                self._waits.begin(
                    what,
                    f"waiting for the {what}: {attempts} attempts failed, last "
                    f"{probe.failure}: {probe.error}; written off in {max(0, written_off):.0f}s "
                    f"(at {deadline.isoformat(timespec='seconds')})",
                )
                report_after = FIRST_PROBE_REPORT_EVERY
        finally:
            self._waits.end(what)

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
            self._calls.call(
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
            # Quota and provider trouble are waited out in its provider call: any
            # other failure writes this generation off.
            self._carried.bringing_up = None
            raise InstanceFailed(f"create failed: {failures.message(err)}") from err
        self._creating = None
        self._pending_name = None
        # A bring-up resumed after continue-as-new adopts what it made before.
        made_before = any(known.provider_id == ref.provider_id for known in self._carried.owned)
        self._carried.own(ref)
        if generation > 0 and not made_before:
            self._carried.replacements += 1
        self._publish()
        return ref

    # ---- retiring instances --------------------------------------------------------

    def _retire(self, ref: InstanceRef | None) -> None:
        """Stop using an instance and delete it in the background."""
        if ref is None:
            return
        if ref == self._carried.current:
            self._carried.current = None
            self._show_instance(None)
        self._deletions.start(ref)

    def _withdraw(self, old: InstanceRef, outcome: MonitorOutcome) -> None:
        """The instance being rotated out failed first: withdraw it; the rotation replaces it.

        Unhealthy, then Replacing, in one step: the rotation's bring-up goes
        on as the failed instance's replacement.
        """
        self._budget.forgive_if_stable()
        self._note_error(
            f"{old.name} failed while being rotated out: {outcome.reason}: {outcome.detail}"
        )
        self._enter(ProxyState.UNHEALTHY)
        self._retire(old)  # no longer shown nor advertised
        self._enter(ProxyState.REPLACING)

    def _terminate_for(self, reason: str) -> None:
        """End the proxy as a terminate signal would, unless a terminate came first."""
        if self._terminate_reason is None:
            self._terminate_reason = reason

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
        await self._deletions.finished()

    def _restore(self) -> None:
        """Go on with a previous run's state; delete what it was still deleting."""
        carried = self._carried
        for ref in carried.owned:
            if ref != carried.current and ref.generation != carried.bringing_up:
                self._retire(ref)
        # Handed over while Terminating: terminate again, deleting what is still owned.
        self._terminate_reason = carried.terminating
        self._deletions.refused = carried.delete_refused

    def _result(self, state: ProxyState, reason: str) -> ProxyResult:
        return ProxyResult(state, reason, self._carried.generation, self._carried.replacements)

    # ---- visibility ----------------------------------------------------------------

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
            waiting_for=self._waits.newest,
            terminate_reason=self._terminate_reason,
        )
