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

The workflow id is the proxy's identity. Steady state costs a handful of
history events an hour: a single long-running `monitor` activity probes and
heartbeats, and returns only when health changes, the instance vanishes, or
an hour has passed. Every instance the workflow creates is remembered in
`owned` until it is confirmed gone, so terminate, cancel and failure all end
with nothing left running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, FailureError
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
        TargetCheck,
        ValidateTargetInput,
    )
    from activities.provider import ProviderActivities
    from contract import (
        ENDPOINT,
        INSTANCES,
        KEYWORDS,
        MEMBER_CHANGED_SIGNAL,
        PERMANENT_DELETE_RETRY_DELAY,
        PROVIDER,
        PROXY_LIFECYCLE,
        QUOTA_RETRY_DELAY,
        ROTATE_SIGNAL,
        STATE,
        TERMINATE_SIGNAL,
        ErrorType,
        ProxyState,
    )
    from providers.naming import instance_name
    from workflows import failures, policies
    from workflows.deletion import delete_until_gone
    from workflows.inputs import ProxyInput, continued_state, parse_input
    from workflows.lifecycle_states import check_transition
    from workflows.membership import MemberReport

A = TypeVar("A")
R = TypeVar("R")

# Crash-loop budget: this many instances in a row that fail before staying
# healthy for STABLE_AFTER end the workflow as Failed. Between them the
# workflow waits REPLACE_BACKOFF (10 s doubling to 5 minutes); the first
# replacement after a healthy spell starts at once.
CRASH_BUDGET = 5
STABLE_AFTER = timedelta(minutes=10)
REPLACE_BACKOFF = policies.Backoff(first=timedelta(seconds=10), cap=timedelta(minutes=5))
FIRST_PROBE_DEADLINE = timedelta(minutes=2)
# The longest `rotate` reason kept.
MAX_REASON = 500
# workflow.patched() id: a lifecycle started since learns its installation
# from validate_target and hashes it into its instance names.
INSTALLATION_IN_NAMES = "installation-in-instance-names"

# A failing first probe is reported to the workflow (and so to `status`)
# after this long, then every FIRST_PROBE_REPORT_EVERY until the deadline.
FIRST_PROBE_FIRST_REPORT = timedelta(seconds=10)
FIRST_PROBE_REPORT_EVERY = timedelta(seconds=20)
# A provider that keeps failing (5xx, 429, timeouts, refused connections) is
# waited out on a visible timer: PROVIDER_WAIT (5 s doubling to 10 minutes),
# or the provider's own Retry-After. Never given up on, however long.
PROVIDER_WAIT = policies.Backoff(first=timedelta(seconds=5), cap=timedelta(minutes=10))

# Histories recorded before this patch cancelled activities without waiting,
# cleaned up only after the lifecycle had unwound, retried Transient errors
# inside Temporal and slept through quota waits on terminate. Replaying them
# keeps doing so; new runs take the paths described in docs/architecture.md.
CLEAN_STOP_PATCH = "clean-stop-and-provider-waits"

# The summaries of the monitor's two timers; the one that fired says which.
LIFETIME_SUMMARY = "max lifetime reached"
STABLE_SUMMARY = "stable: crash budget restored"


@dataclass
class ProxyStatus:
    """What the `status` query returns."""

    state: ProxyState = ProxyState.PROVISIONING
    provider: str = ""
    endpoint: str = ""
    provider_id: str = ""
    instance: str = ""
    generation: int = 0
    ready_since: str | None = None
    last_probe: ProbeSummary | None = None
    replacements: int = 0
    failures_in_a_row: int = 0
    waiting_for: str | None = None
    last_error: str | None = None
    terminate_reason: str | None = None
    # When last_error happened: an error older than ready_since is history.
    last_error_at: str | None = None


@dataclass
class CarriedState:
    """Everything continue-as-new hands to the next run.

    Runs before this one also carried `terminate_reason` (always None: a run
    with a terminate pending never continues) and `waiting_for_quota` (read
    by none). Decoding ignores keys a dataclass does not have, so their
    payloads still decode (tests/workflows/test_lifecycle_carried.py).
    """

    status: ProxyStatus
    current: InstanceRef | None = None
    owned: list[InstanceRef] = field(default_factory=list)
    ready_at: str | None = None
    next_generation: int = 0
    # The installation instance names are hashed with; None for a lifecycle
    # started before that, which keeps the old names (providers/naming.py).
    installation: str | None = None
    # A `rotate` signal not yet carried out.
    rotate_reason: str | None = None


@dataclass(frozen=True)
class ProxyResult:
    """What a finished ProxyLifecycle returns."""

    state: ProxyState
    reason: str
    generation: int
    replacements: int


class _InstanceFailed(Exception):
    """An instance could not be brought to Ready; the workflow replaces it."""

    def __init__(self, reason: str, ref: InstanceRef | None = None) -> None:
        super().__init__(reason)
        self.ref = ref


@workflow.defn(name=PROXY_LIFECYCLE)
class ProxyLifecycle:
    def __init__(self) -> None:
        self._status = ProxyStatus()
        self._current: InstanceRef | None = None
        self._owned: dict[str, InstanceRef] = {}
        self._ready_at: str | None = None
        self._terminate_reason: str | None = None
        self._input: ProxyInput | None = None
        self._next_generation = 0
        self._creating: asyncio.Task[InstanceRef] | None = None
        self._deletions: dict[str, asyncio.Task[None]] = {}
        self._pending_name: str | None = None
        self._installation: str | None = None
        # Every wait in progress (provider, quota, backoff), by its timer's
        # summary: status.waiting_for shows the newest.
        self._waits: dict[str, str] = {}
        # The monitor of an instance that is being rotated out: cancelled,
        # then awaited once its instance is deleted, so its end is observed.
        self._retired_monitor: ActivityHandle[MonitorOutcome] | None = None
        self._published: tuple[dict[str, str], list[str]] = ({}, [])
        # Whether this run takes CLEAN_STOP_PATCH's paths: decided in run().
        self._new_paths = False
        self._rotate_reason: str | None = None
        # What the pool (if this is a pool member) was last told, and the
        # signals telling it that are still in flight.
        self._reported: tuple[str, str, int, str | None] | None = None
        self._reports: list[asyncio.Task[None]] = []
        self._report_seq = 0

    # ---- the contract: run, signal, query ------------------------------------------

    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> ProxyResult:
        # Untyped, so no argument can fail to decode outside our validation.
        state, problems = continued_state(CarriedState, carried, extra)
        if not problems:
            # Decided once, before the first command: a marker recorded later,
            # after the validation's local-activity marker, did not replay
            # ("patch marker encountered ... no corresponding change command").
            self._new_paths = workflow.patched(CLEAN_STOP_PATCH)
        if state is not None:
            self._restore(state)
        # A continued run was validated when it first started; checking the
        # worker's config again could fail it while it still owns instances.
        inp = await self._validated(raw, problems, against_worker=state is None)
        self._input = inp
        self._status.provider = inp.provider
        self._publish()

        lifecycle = asyncio.create_task(self._lifecycle(inp))
        try:
            await workflow.wait_condition(
                lambda: self._terminate_reason is not None or lifecycle.done()
            )
        except asyncio.CancelledError:
            # `temporal workflow cancel`: clean up, then end as cancelled.
            self._terminate_reason = self._terminate_reason or "workflow cancelled"
            await self._stop(lifecycle)
            raise
        if not lifecycle.done():
            await self._stop(lifecycle)
            return self._result(ProxyState.TERMINATED, self._terminate_reason or "terminated")
        try:
            lifecycle.result()
        except (ApplicationError, ActivityError) as err:
            reason = err.message if isinstance(err, ApplicationError) else failures.message(err)
            self._note_error(reason)
            await self._cleanup()
            self._show_instance(None)
            self._set_state(ProxyState.FAILED)
            await self._pool_told()
            raise ApplicationError(
                reason, type=failures.ending_type(err), non_retryable=True
            ) from err
        raise AssertionError("the lifecycle only ends by failure or continue-as-new")

    @workflow.signal(name=TERMINATE_SIGNAL)
    def terminate(self, request: Any = None, *_extra: Any) -> None:
        """Delete the instance, wait until it is gone, complete.

        Input optional: `{"reason": "..."}`, or just the reason as a string.
        Further arguments are ignored: a handler that cannot take them would
        fail the workflow task on every retry, and the proxy could no longer
        be terminated cleanly.
        """
        reason = request.get("reason") if isinstance(request, dict) else request
        self._terminate_reason = str(reason) if reason else "terminate signal"
        self._status.terminate_reason = self._terminate_reason

    @workflow.signal(name=ROTATE_SIGNAL)
    def rotate(self, request: Any = None, *_extra: Any) -> None:
        """Replace the instance make-before-break now, as max lifetime does.

        Input optional: `{"reason": "..."}`, or just the reason as a string.
        Rotates sent while a rotation is under way are absorbed by it.
        """
        reason = request.get("reason") if isinstance(request, dict) else request
        # Bounded: it is carried across continue-as-new.
        self._rotate_reason = str(reason)[:MAX_REASON] if reason else "rotate signal"

    @workflow.query(name="status")
    def status(self) -> ProxyStatus:
        return self._status

    # ---- validation -----------------------------------------------------------------

    async def _validated(
        self, raw: Any, argument_problems: list[str], *, against_worker: bool
    ) -> ProxyInput:
        inp, problems = parse_input(raw)
        problems = argument_problems + problems
        if (
            against_worker
            and not argument_problems
            and isinstance(raw, dict)
            and isinstance(raw.get("provider"), str)
        ):
            # Only the worker knows its providers and their allowed ports.
            placement = raw.get("placement")
            target = ValidateTargetInput(
                provider=raw["provider"],
                port=inp.port if inp else None,
                placement=(
                    {k: str(v) for k, v in placement.items() if v is not None}
                    if isinstance(placement, dict)
                    else {}
                ),
                health_target=inp.health.target if inp else "",
            )
            problems += await self._check_target(target)
        if problems or inp is None:
            message = "invalid input: " + "; ".join(problems)
            self._note_error(message)
            self._set_state(ProxyState.FAILED)
            raise invalid_input(message)
        return inp

    async def _check_target(self, target: ValidateTargetInput) -> list[str]:
        """The worker's verdict on the target; learns the installation on the way."""
        if not workflow.patched(INSTALLATION_IN_NAMES):
            # Recorded before validate_target returned the installation.
            problems: list[str] = await workflow.execute_local_activity(
                "validate_target",
                target,
                result_type=list[str],
                start_to_close_timeout=policies.VALIDATE.start_to_close,
                schedule_to_close_timeout=policies.VALIDATE.schedule_to_close,
                retry_policy=policies.TRANSIENT_RETRY,
            )
            return problems
        check: TargetCheck = await workflow.execute_local_activity_method(
            ProviderActivities.validate_target,
            target,
            start_to_close_timeout=policies.VALIDATE.start_to_close,
            schedule_to_close_timeout=policies.VALIDATE.schedule_to_close,
            retry_policy=policies.TRANSIENT_RETRY,
        )
        self._installation = check.installation
        return check.problems

    # ---- the lifecycle --------------------------------------------------------------

    async def _lifecycle(self, inp: ProxyInput) -> None:
        while True:
            if self._current is None:
                await self._provision(inp)
            outcome = await self._monitor(inp)
            if outcome is None:
                await self._rotate(inp)
            elif outcome.reason in (MonitorReason.UNHEALTHY, MonitorReason.GONE):
                self._forgive_if_stable()
                self._enter(ProxyState.UNHEALTHY)
                self._retire(self._current)
                await self._count_failure(f"{outcome.reason}: {outcome.detail}")
            else:
                self._forgive_if_stable()
            if workflow.info().is_continue_as_new_suggested():
                await self._continue_as_new()

    async def _provision(self, inp: ProxyInput) -> None:
        """Bring up a new generation, replacing failed ones within the crash budget."""
        while True:
            first = self._next_generation == 0
            self._enter(ProxyState.PROVISIONING if first else ProxyState.REPLACING)
            try:
                ref = await self._bring_up(inp)
            except _InstanceFailed as failed:
                self._retire(failed.ref)
                await self._count_failure(str(failed))
                continue
            self._current = ref
            self._ready_at = workflow.now().isoformat()
            self._status.ready_since = self._ready_at
            self._rotate_reason = None  # a new instance is what a rotate asks for
            self._enter(ProxyState.READY)
            return

    async def _bring_up(self, inp: ProxyInput) -> InstanceRef:
        """Create a new generation, wait until it runs and passes one probe.

        Raises _InstanceFailed (carrying the instance, if one was made) for
        anything a replacement could fix; a Permanent error fails the workflow.
        """
        generation = self._next_generation
        self._next_generation += 1
        # While rotating, status keeps showing the instance that still serves.
        visible = self._current is None
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
            self._owned[ref.provider_id] = ref
            if visible:
                self._show_instance(ref)
            probe = await self._first_probe(inp, ref)
        except ActivityError as err:
            if failures.cancelled(err) or failures.cause_type(err) == ErrorType.PERMANENT:
                raise
            raise _InstanceFailed(f"{ref.name}: {failures.message(err)}", ref) from err
        self._status.last_probe = probe
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
        # Histories from before CLEAN_STOP_PATCH waited in one call, to the deadline.
        reports = self._patched()
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
                        report_after_seconds=report_after.total_seconds() if reports else None,
                    ),
                    policies.WAIT_HEALTHY,
                    what,
                )
                if not reports:
                    return probe
                attempts += probe.attempts or 1
                probe = replace(probe, attempts=attempts)
                # The activity returns a failure early only while time is left.
                if probe.ok or left <= report_after:
                    return probe
                self._status.last_probe = probe
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
            workflow_id, generation, installation=self._installation, namespace=info.namespace
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
                    installation=self._installation or "",
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
            # Provider trouble is waited out in _provider_call; only histories
            # from before CLEAN_STOP_PATCH get here with a Transient error.
            raise _InstanceFailed(f"create failed: {failures.message(err)}") from err
        self._creating = None
        self._pending_name = None
        self._owned[ref.provider_id] = ref
        if generation > 0:
            self._status.replacements += 1
        self._publish()
        return ref

    async def _monitor(self, inp: ProxyInput) -> MonitorOutcome | None:
        """Run the monitor; None means rotate now: max lifetime reached, or a `rotate` signal."""
        await self._settle_retired_monitor()
        ref = self._current
        assert ref is not None
        handle = workflow.start_activity_method(
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
            heartbeat_timeout=policies.MONITOR.heartbeat,
            retry_policy=policies.TRANSIENT_RETRY,
            cancellation_type=self._cancellation(),
        )

        def wake() -> bool:
            return handle.done() or self._rotate_reason is not None

        while True:
            deadlines = [
                (left, summary)
                for left, summary in (
                    (self._lifetime_left(inp), LIFETIME_SUMMARY),
                    (self._stable_left(), STABLE_SUMMARY),
                )
                if left is not None
            ]
            if not deadlines:
                await self._wait_untimed(handle, wake)
            else:
                timeout, summary = min(deadlines, key=lambda deadline: deadline[0])
                try:
                    await workflow.wait_condition(wake, timeout=timeout, timeout_summary=summary)
                except asyncio.CancelledError:
                    # Terminate or cancel: this wait is cancelled, the monitor is
                    # not (it is a task of its own). Cancel it too, and have _stop
                    # await it, so the workflow never closes with the monitor pending.
                    if self._patched():
                        handle.cancel()
                        self._retired_monitor = handle
                    raise
                except TimeoutError:
                    if summary == STABLE_SUMMARY:
                        # Status says now that the crash budget is whole again.
                        self._forgive_if_stable()
                        self._publish()
                        continue
                    self._rotate_now(handle)
                    return None
            if handle.done():
                break
            self._rotate_now(handle)  # a rotate signal
            return None
        outcome: MonitorOutcome = await handle
        self._raise_if_stopping()
        self._status.last_probe = outcome.last_probe
        return outcome

    async def _rotate(self, inp: ProxyInput) -> None:
        """Make before break: the old instance serves until the new one is Ready."""
        old = self._current
        assert old is not None
        try:
            new = await self._bring_up(inp)
        except _InstanceFailed as failed:
            # Keep serving from the old instance; try again after a backoff.
            self._retire(failed.ref)
            await self._count_failure(f"rotation failed: {failed}")
            return
        self._current = new
        self._ready_at = workflow.now().isoformat()
        self._status.ready_since = self._ready_at
        self._rotate_reason = None
        self._enter(ProxyState.READY)
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

    async def _wait_untimed(self, handle: ActivityHandle[MonitorOutcome], wake: Any) -> None:
        """Wait for the monitor or a rotate signal, with no timer.

        Before `rotate`, this wait was on the monitor itself, so a terminate
        cancelled the monitor here; still done, so recorded histories replay.
        """
        try:
            await workflow.wait_condition(wake)
        except asyncio.CancelledError:
            handle.cancel()
            with contextlib.suppress(ActivityError, asyncio.CancelledError):
                await handle
            raise

    def _rotate_now(self, handle: ActivityHandle[MonitorOutcome]) -> None:
        """Make before break: the old monitor ends once its instance is deleted,
        and is awaited then (_settle_retired_monitor)."""
        handle.cancel()
        self._retired_monitor = handle

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

    def _retire(self, ref: InstanceRef | None) -> None:
        """Stop using an instance and delete it in the background."""
        if ref is None:
            return
        if ref == self._current:
            self._current = None
            self._show_instance(None)
        if ref.provider_id not in self._deletions:
            self._deletions[ref.provider_id] = asyncio.create_task(self._delete_and_wait(ref))

    def _stable_left(self) -> timedelta | None:
        """Time until the current instance has been Ready for STABLE_AFTER, if that matters."""
        if not self._patched() or self._status.failures_in_a_row == 0 or self._ready_at is None:
            return None
        return max(timedelta(0), STABLE_AFTER - self._ready_for())

    def _forgive_if_stable(self) -> None:
        """An instance that stayed healthy long enough resets the crash budget."""
        if self._ready_for() >= STABLE_AFTER:
            self._status.failures_in_a_row = 0

    async def _count_failure(self, reason: str) -> None:
        """Spend the crash budget; fail the workflow when it is gone, else back off.

        The first failure after a healthy spell is replaced at once; repeated
        ones wait longer each time.
        """
        self._raise_if_stopping()
        self._status.failures_in_a_row += 1
        self._note_error(reason)
        in_a_row = self._status.failures_in_a_row
        if in_a_row >= CRASH_BUDGET:
            raise ApplicationError(
                f"gave up after {in_a_row} failed instances in a row; last: {reason}",
                type=ErrorType.CRASH_LOOP,
                non_retryable=True,
            )
        if in_a_row == 1:
            return
        delay = REPLACE_BACKOFF.delay(in_a_row - 2)
        await self._wait(
            f"backing off after {in_a_row} failed instances in a row",
            delay,
            summary=f"back off {int(delay.total_seconds())}s",
            interruptible=False,  # the lifecycle is cancelled on terminate, and this timer with it
        )

    # ---- provider calls -------------------------------------------------------------

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
        patched = self._patched()
        provider_waits = 0
        while True:
            if interruptible:
                self._raise_if_stopping()
            try:
                return await policies.execute(
                    activity,
                    arg,
                    profile,
                    summary,
                    retry_policy=policies.PROVIDER_RETRY if patched else policies.TRANSIENT_RETRY,
                    cancellation_type=self._cancellation(),
                )
            except ActivityError as err:
                if interruptible and not failures.cancelled(err):
                    self._raise_if_stopping()
                if failures.cause_type(err) == ErrorType.QUOTA_EXCEEDED:
                    waiting_for = "quota"
                    delay = failures.next_retry_delay(err) or QUOTA_RETRY_DELAY
                elif patched and failures.provider_trouble(err):
                    waiting_for = "provider"
                    delay = failures.next_retry_delay(err) or PROVIDER_WAIT.delay(provider_waits)
                    provider_waits += 1
                else:
                    raise
                self._note_error(failures.message(err))
                await self._wait(
                    f"waiting for {waiting_for}: {failures.message(err)}",
                    delay,
                    summary=f"waiting for {waiting_for} ({summary})",
                    interruptible=interruptible,
                )

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
            if interruptible and self._patched():
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
        """Delete and wait until gone; never gives up, whatever the error."""
        while True:
            try:
                await delete_until_gone(ref, self._cleanup_call, policies.DELETION, ref.name)
            except ActivityError as err:
                if failures.cancelled(err):
                    raise  # the caller was cancelled; cleanup deletes what is still owned
                self._note_error(f"deleting {ref.name}: {failures.message(err)}")
                await workflow.sleep(
                    PERMANENT_DELETE_RETRY_DELAY, summary=f"retry deleting {ref.name}"
                )
                continue
            self._owned.pop(ref.provider_id, None)
            self._deletions.pop(ref.provider_id, None)
            self._publish()
            return

    # ---- ending ---------------------------------------------------------------------

    async def _stop(self, lifecycle: asyncio.Task[None]) -> None:
        """Terminate or cancel: stop the lifecycle, delete everything, record why."""
        self._set_state(ProxyState.TERMINATING)
        lifecycle.cancel()
        if self._patched():
            # Deleting the instances at once is what ends the activities still
            # running on them (a monitor's or first probe's next probe finds
            # its instance gone), so the workflow closes with none pending.
            deleting = asyncio.create_task(self._cleanup())
            with contextlib.suppress(asyncio.CancelledError, ApplicationError, ActivityError):
                await lifecycle
            await deleting
        else:
            with contextlib.suppress(asyncio.CancelledError, ApplicationError, ActivityError):
                await lifecycle
        # Again: the lifecycle may have made or retired an instance while it unwound.
        await self._cleanup()
        await self._settle_retired_monitor()
        self._current = None
        self._show_instance(None)
        self._set_state(ProxyState.TERMINATED)
        await self._pool_told()

    async def _cleanup(self) -> None:
        """Delete every instance this workflow still owns, including one mid-create."""
        self._current = None  # ending, not replacing: nothing to count
        creating = self._creating
        if creating is not None:
            try:
                ref = await creating
                self._owned[ref.provider_id] = ref
            except (ActivityError, asyncio.CancelledError):
                pass  # nothing was made that we know of; orphan GC covers the rest
            self._creating = None
        for ref in list(self._owned.values()):
            self._retire(ref)
        await asyncio.gather(*self._deletions.values())

    async def _continue_as_new(self) -> None:
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._terminate_reason is not None:
            return  # run() is about to clean up; a new run would lose the signal
        if self._patched() and self._deletions:
            # Their activities would report to a closed run (a warning in the
            # worker's log): continue after the next monitor cycle instead,
            # rather than leave the instance unmonitored while they finish.
            return
        carried = CarriedState(
            status=self._status,
            current=self._current,
            owned=list(self._owned.values()),
            ready_at=self._ready_at,
            next_generation=self._next_generation,
            installation=self._installation,
            rotate_reason=self._rotate_reason,
        )
        assert self._input is not None
        workflow.continue_as_new(
            args=[self._input.model_dump(mode="json", exclude_none=True), carried]
        )

    def _restore(self, carried: CarriedState) -> None:
        self._status = carried.status
        # Waits belong to the run that waited; this one has none yet.
        self._status.waiting_for = None
        self._current = carried.current
        self._owned = {ref.provider_id: ref for ref in carried.owned}
        self._ready_at = carried.ready_at
        self._next_generation = carried.next_generation
        self._installation = carried.installation
        self._rotate_reason = carried.rotate_reason
        for ref in carried.owned:
            if ref != carried.current:
                self._retire(ref)

    def _result(self, state: ProxyState, reason: str) -> ProxyResult:
        return ProxyResult(state, reason, self._status.generation, self._status.replacements)

    # ---- visibility -----------------------------------------------------------------

    def _lifetime_left(self, inp: ProxyInput) -> timedelta | None:
        if inp.max_lifetime_seconds is None:
            return None
        return max(timedelta(0), timedelta(seconds=inp.max_lifetime_seconds) - self._ready_for())

    def _ready_for(self) -> timedelta:
        if self._ready_at is None:
            return timedelta(0)
        return workflow.now() - datetime.fromisoformat(self._ready_at)

    def _patched(self) -> bool:
        """Whether this run takes the paths of CLEAN_STOP_PATCH (every run started since)."""
        return self._new_paths

    def _cancellation(self) -> ActivityCancellationType:
        """How a cancelled activity ends: waited for, so none outlives the workflow."""
        if self._patched():
            return ActivityCancellationType.WAIT_CANCELLATION_COMPLETED
        return ActivityCancellationType.TRY_CANCEL

    def _raise_if_stopping(self) -> None:
        """End the lifecycle's current step once terminate or cancel has arrived.

        A cancelled activity that is waited for may still complete normally
        (its instance was deleted under it); what follows must not act on it.
        """
        if self._terminate_reason is not None and self._patched():
            raise asyncio.CancelledError(self._terminate_reason)

    def _note_error(self, message: str) -> None:
        self._status.last_error = message
        self._status.last_error_at = workflow.now().isoformat(timespec="seconds")

    def _begin_wait(self, key: str, waiting_for: str) -> None:
        self._waits.pop(key, None)  # re-inserted: the newest wait is the one shown
        self._waits[key] = waiting_for
        self._show_waits()

    def _end_wait(self, key: str) -> None:
        # Also called from `finally` blocks, which run when the worker evicts
        # this run from its cache and closes its coroutines: outside the
        # workflow's event loop no workflow call may run, and none is needed.
        if self._waits.pop(key, None) is not None and workflow.in_workflow():
            self._show_waits()

    def _show_waits(self) -> None:
        self._status.waiting_for = next(reversed(self._waits.values()), None)
        self._publish()

    def _show_instance(self, ref: InstanceRef | None) -> None:
        if ref is not None:
            self._status.generation = ref.generation
        self._status.provider_id = ref.provider_id if ref else ""
        self._status.instance = ref.name if ref else ""
        self._status.endpoint = ref.endpoint if ref else ""
        self._publish()

    def _enter(self, state: ProxyState) -> None:
        """Move the lifecycle (not run()'s ending) to `state`.

        A lifecycle being stopped may still learn something late: a first
        probe that passed as terminate cancelled it. Terminating leads only
        to Terminated, so that news ends the lifecycle instead.
        """
        if self._status.state == ProxyState.TERMINATING:
            raise asyncio.CancelledError(f"terminating, not entering {state}")
        self._set_state(state)

    def _set_state(self, state: ProxyState) -> None:
        """Change state as the transition table allows; publish it."""
        check_transition(self._status.state, state)
        self._status.state = state
        if state == ProxyState.READY and self._current is not None:
            self._show_instance(self._current)
        self._publish()

    def _publish(self) -> None:
        """Keep search attributes and the Web UI's current details in step with status."""
        status = self._status
        keywords = {
            STATE.name: status.state,
            PROVIDER.name: status.provider,
            ENDPOINT.name: status.endpoint if status.state == ProxyState.READY else "",
        }
        names = {ref.name for ref in self._owned.values()}
        if self._pending_name:
            names.add(self._pending_name)
        wanted = (keywords, sorted(names))
        if wanted != self._published:
            updates: list[SearchAttributeUpdate[Any]] = [
                key.value_set(keywords[key.name]) if keywords[key.name] else key.value_unset()
                for key in KEYWORDS
            ]
            updates.append(INSTANCES.value_set(wanted[1]) if wanted[1] else INSTANCES.value_unset())
            workflow.upsert_search_attributes(updates)
            self._published = wanted
        lines = [f"**{status.state}** on `{status.provider or '?'}`"]
        if status.endpoint:
            lines.append(
                f"endpoint `{status.endpoint}` ({status.instance}, generation {status.generation})"
            )
        if status.waiting_for:
            lines.append(status.waiting_for)
        if status.last_error:
            lines.append(f"last error ({status.last_error_at or '?'}): {status.last_error}")
        workflow.set_current_details("\n\n".join(lines))
        self._tell_pool()

    # ---- the pool, when this proxy is a pool member ---------------------------------

    def _tell_pool(self) -> None:
        """Signal the parent pool when state, endpoint or generation changed.

        Only a child workflow has a parent; a standalone proxy issues no command
        here. The signal goes by workflow id alone, so it reaches the pool's
        current run after the pool continued as new.
        """
        parent = workflow.info().parent
        status = self._status
        now = (status.state, status.endpoint, status.generation, status.ready_since)
        if parent is None or now == self._reported:
            return
        self._reported = now
        report = MemberReport(
            member=workflow.info().workflow_id,
            state=status.state,
            endpoint=status.endpoint if status.state == ProxyState.READY else "",
            provider=status.provider,
            generation=status.generation,
            ready_since=status.ready_since,
            at=workflow.now().isoformat(),
            seq=self._report_seq,
            last_error=status.last_error,
        )
        self._report_seq += 1
        pool = workflow.get_external_workflow_handle(parent.workflow_id)
        self._reports = [task for task in self._reports if not task.done()]
        self._reports.append(asyncio.create_task(self._send_report(pool, report)))

    @staticmethod
    async def _send_report(
        pool: workflow.ExternalWorkflowHandle[Any], report: MemberReport
    ) -> None:
        # A pool that is gone (hard-terminated) cannot be told; OrphanGC ends its members.
        with contextlib.suppress(FailureError):
            await pool.signal(MEMBER_CHANGED_SIGNAL, report)

    async def _pool_told(self) -> None:
        """Before the workflow closes: a closed workflow's pending signals are never sent."""
        await asyncio.gather(*self._reports)
