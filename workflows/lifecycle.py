"""ProxyLifecycle: one durable workflow per proxy, from create to gone.

    Provisioning -> Ready -> (Replacing -> Ready)* -> Terminating -> Terminated
                                                  \\-> Failed

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
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

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
    from workflows.inputs import ProxyInput, parse_input
    from workflows.membership import MemberReport

A = TypeVar("A")
R = TypeVar("R")

# Crash-loop budget: this many instances in a row that fail before staying
# healthy for STABLE_AFTER end the workflow as Failed. Between them the
# workflow waits, doubling from REPLACE_BACKOFF up to MAX_REPLACE_BACKOFF;
# the first replacement after a healthy spell starts at once.
CRASH_BUDGET = 5
STABLE_AFTER = timedelta(minutes=10)
REPLACE_BACKOFF = timedelta(seconds=10)
MAX_REPLACE_BACKOFF = timedelta(minutes=5)
FIRST_PROBE_DEADLINE = timedelta(minutes=2)


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


@dataclass
class CarriedState:
    """Everything continue-as-new hands to the next run."""

    status: ProxyStatus
    current: InstanceRef | None = None
    owned: list[InstanceRef] = field(default_factory=list)
    ready_at: str | None = None
    next_generation: int = 0
    terminate_reason: str | None = None
    # Whether status.waiting_for is a quota wait, which the next successful
    # provider call ends.
    waiting_for_quota: bool = False
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
        self._waiting_for_quota = False
        self._published: tuple[dict[str, str], list[str]] = ({}, [])
        self._rotate_reason: str | None = None
        # What the pool (if this is a pool member) was last told, and the
        # signals telling it that are still in flight.
        self._reported: tuple[str, str, int, str | None] | None = None
        self._reports: list[asyncio.Task[None]] = []
        self._report_seq = 0

    # ---- the contract: run, signal, query ------------------------------------------

    @workflow.run
    async def run(self, raw: Any = None, carried: CarriedState | None = None) -> ProxyResult:
        if carried is not None:
            self._restore(carried)
        # A continued run was validated when it first started; checking the
        # worker's config again could fail it while it still owns instances.
        inp = await self._validated(raw, against_worker=carried is None)
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
            self._status.last_error = reason
            await self._cleanup()
            self._show_instance(None)
            self._set_state(ProxyState.FAILED)
            await self._pool_told()
            raise ApplicationError(
                reason, type=failures.ending_type(err), non_retryable=True
            ) from err
        raise AssertionError("the lifecycle only ends by failure or continue-as-new")

    @workflow.signal(name=TERMINATE_SIGNAL)
    def terminate(self, request: Any = None) -> None:
        """Delete the instance, wait until it is gone, complete.

        Input optional: `{"reason": "..."}`, or just the reason as a string.
        """
        reason = request.get("reason") if isinstance(request, dict) else request
        self._terminate_reason = str(reason) if reason else "terminate signal"
        self._status.terminate_reason = self._terminate_reason

    @workflow.signal(name=ROTATE_SIGNAL)
    def rotate(self, request: Any = None) -> None:
        """Replace the instance make-before-break now, as max lifetime does.

        Input optional: `{"reason": "..."}`, or just the reason as a string.
        Rotates sent while a rotation is under way are absorbed by it.
        """
        reason = request.get("reason") if isinstance(request, dict) else request
        self._rotate_reason = str(reason) if reason else "rotate signal"

    @workflow.query(name="status")
    def status(self) -> ProxyStatus:
        return self._status

    # ---- validation -----------------------------------------------------------------

    async def _validated(self, raw: Any, *, against_worker: bool) -> ProxyInput:
        inp, problems = parse_input(raw)
        if against_worker and isinstance(raw, dict) and isinstance(raw.get("provider"), str):
            # Only the worker knows its providers and their allowed ports.
            placement = raw.get("placement")
            problems += await workflow.execute_local_activity_method(
                ProviderActivities.validate_target,
                ValidateTargetInput(
                    provider=raw["provider"],
                    port=inp.port if inp else None,
                    placement=(
                        {k: str(v) for k, v in placement.items() if v is not None}
                        if isinstance(placement, dict)
                        else {}
                    ),
                    health_target=inp.health.target if inp else "",
                ),
                start_to_close_timeout=policies.VALIDATE.start_to_close,
                schedule_to_close_timeout=policies.VALIDATE.schedule_to_close,
                retry_policy=policies.TRANSIENT_RETRY,
            )
        if problems or inp is None:
            message = "invalid input: " + "; ".join(problems)
            self._status.last_error = message
            self._set_state(ProxyState.FAILED)
            raise invalid_input(message)
        return inp

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
                self._set_state(ProxyState.UNHEALTHY)
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
            self._set_state(ProxyState.PROVISIONING if first else ProxyState.REPLACING)
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
            self._set_state(ProxyState.READY)
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
            probe = await self._provider_call(
                ProviderActivities.wait_healthy,
                ProbeInput(
                    ref,
                    inp.health.target,
                    timeout_seconds=inp.health.timeout_seconds,
                    deadline_seconds=FIRST_PROBE_DEADLINE.total_seconds(),
                ),
                policies.WAIT_HEALTHY,
                f"first probe of {ref.endpoint} via {inp.health.target}",
            )
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

    async def _create(self, inp: ProxyInput, generation: int) -> InstanceRef:
        """Create the instance; shielded so terminate never orphans a half-made one.

        If terminate arrives mid-create, cleanup awaits this same task and
        deletes what it made.
        """
        workflow_id = workflow.info().workflow_id
        # Published before the create starts, so orphan GC never mistakes an
        # instance for an orphan in the moment between create and record.
        self._pending_name = instance_name(workflow_id, generation)
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
            raise _InstanceFailed(f"create failed: {failures.message(err)}") from err
        self._creating = None
        self._pending_name = None
        self._owned[ref.provider_id] = ref
        self._publish()
        return ref

    async def _monitor(self, inp: ProxyInput) -> MonitorOutcome | None:
        """Run the monitor; None means rotate now: max lifetime reached, or a `rotate` signal."""
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
        )
        lifetime_left = self._lifetime_left(inp)
        try:
            # Without a lifetime this sets no timer, as before rotate existed.
            await workflow.wait_condition(
                lambda: handle.done() or self._rotate_reason is not None,
                timeout=lifetime_left,
                timeout_summary="max lifetime reached",
            )
        except TimeoutError:
            handle.cancel()
            return None
        except asyncio.CancelledError:
            # Terminate or cancel. Without a lifetime the monitor used to be
            # awaited directly, which cancelled it here: kept, for replay.
            if lifetime_left is None:
                handle.cancel()
            raise
        if not handle.done():  # a rotate signal
            handle.cancel()
            return None
        outcome: MonitorOutcome = await handle
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
        self._status.replacements += 1
        self._rotate_reason = None
        self._set_state(ProxyState.READY)
        await self._delete_and_wait(old)

    def _retire(self, ref: InstanceRef | None) -> None:
        """Stop using an instance and delete it in the background."""
        if ref is None:
            return
        if ref == self._current:
            self._current = None
            self._status.replacements += 1
            self._show_instance(None)
        if ref.provider_id not in self._deletions:
            self._deletions[ref.provider_id] = asyncio.create_task(self._delete_and_wait(ref))

    def _forgive_if_stable(self) -> None:
        """An instance that stayed healthy long enough resets the crash budget."""
        if self._ready_for() >= STABLE_AFTER:
            self._status.failures_in_a_row = 0

    async def _count_failure(self, reason: str) -> None:
        """Spend the crash budget; fail the workflow when it is gone, else back off.

        The first failure after a healthy spell is replaced at once; repeated
        ones wait longer each time.
        """
        self._status.failures_in_a_row += 1
        self._status.last_error = reason
        in_a_row = self._status.failures_in_a_row
        if in_a_row >= CRASH_BUDGET:
            raise ApplicationError(
                f"gave up after {in_a_row} failed instances in a row; last: {reason}",
                type=ErrorType.CRASH_LOOP,
                non_retryable=True,
            )
        if in_a_row == 1:
            return
        delay = min(REPLACE_BACKOFF * 2 ** (in_a_row - 2), MAX_REPLACE_BACKOFF)
        self._waiting_for_quota = False
        self._status.waiting_for = f"backing off after {in_a_row} failed instances in a row"
        self._publish()
        await workflow.sleep(delay, summary=f"back off {int(delay.total_seconds())}s")
        self._status.waiting_for = None

    # ---- provider calls -------------------------------------------------------------

    async def _provider_call(
        self,
        activity: Callable[[ProviderActivities, A], Awaitable[R]],
        arg: A,
        profile: policies.ActivityProfile,
        summary: str,
    ) -> R:
        """Execute one provider activity, waiting out quota errors on a visible timer."""
        while True:
            try:
                result = await policies.execute(activity, arg, profile, summary)
            except ActivityError as err:
                if failures.cause_type(err) != ErrorType.QUOTA_EXCEEDED:
                    raise
                delay = failures.next_retry_delay(err) or QUOTA_RETRY_DELAY
                self._waiting_for_quota = True
                self._status.waiting_for = f"waiting for quota: {failures.message(err)}"
                self._status.last_error = failures.message(err)
                self._publish()
                await workflow.sleep(delay, summary=f"waiting for quota ({summary})")
                continue
            if self._waiting_for_quota:
                self._waiting_for_quota = False
                self._status.waiting_for = None
                self._publish()
            return result

    async def _delete_and_wait(self, ref: InstanceRef) -> None:
        """Delete and wait until gone; never gives up, whatever the error."""
        while True:
            try:
                await delete_until_gone(ref, self._provider_call, policies.DELETION, ref.name)
            except ActivityError as err:
                if failures.cancelled(err):
                    raise  # the caller was cancelled; cleanup deletes what is still owned
                self._status.last_error = f"deleting {ref.name}: {failures.message(err)}"
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
        with contextlib.suppress(asyncio.CancelledError, ApplicationError, ActivityError):
            await lifecycle
        await self._cleanup()
        self._current = None
        self._show_instance(None)
        self._set_state(ProxyState.TERMINATED)
        await self._pool_told()

    async def _cleanup(self) -> None:
        """Delete every instance this workflow still owns, including one mid-create."""
        self._current = None  # ending, not replacing: nothing to count
        if self._creating is not None:
            try:
                ref = await self._creating
                self._owned[ref.provider_id] = ref
            except ActivityError:
                pass  # nothing was made that we know of; orphan GC covers the rest
            self._creating = None
        for ref in list(self._owned.values()):
            self._retire(ref)
        await asyncio.gather(*self._deletions.values())

    async def _continue_as_new(self) -> None:
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._terminate_reason is not None:
            return  # run() is about to clean up; a new run would lose the signal
        # Background deletions are remembered in `owned` and finished by the next run.
        carried = CarriedState(
            status=self._status,
            current=self._current,
            owned=list(self._owned.values()),
            ready_at=self._ready_at,
            next_generation=self._next_generation,
            terminate_reason=self._terminate_reason,
            waiting_for_quota=self._waiting_for_quota,
            rotate_reason=self._rotate_reason,
        )
        assert self._input is not None
        workflow.continue_as_new(
            args=[self._input.model_dump(mode="json", exclude_none=True), carried]
        )

    def _restore(self, carried: CarriedState) -> None:
        self._status = carried.status
        self._current = carried.current
        self._owned = {ref.provider_id: ref for ref in carried.owned}
        self._ready_at = carried.ready_at
        self._next_generation = carried.next_generation
        self._terminate_reason = carried.terminate_reason
        self._waiting_for_quota = carried.waiting_for_quota
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

    def _show_instance(self, ref: InstanceRef | None) -> None:
        if ref is not None:
            self._status.generation = ref.generation
        self._status.provider_id = ref.provider_id if ref else ""
        self._status.instance = ref.name if ref else ""
        self._status.endpoint = ref.endpoint if ref else ""
        self._publish()

    def _set_state(self, state: ProxyState) -> None:
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
            lines.append(f"last error: {status.last_error}")
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
