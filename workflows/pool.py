"""ProxyPool: N ProxyLifecycle members kept Ready as one durable workflow.

Each member is a child workflow `<pool id>/<n>` with the search attribute
`ProxyPool=<pool id>`, started with parent-close policy ABANDON so it lives
on across the pool's continue-as-new (and, after a hard terminate of the
pool, until OrphanGC ends it). Members keep their own histories; the pool
keeps a summary of each, fed by the `member_changed` signal every member
sends its pool on a change (workflows/membership.py), plus a reconcile
against visibility now and then as a safety net (activities/pool.py).

What to do is decided in workflows/pool_plan.py, pure functions this
workflow only applies: each time it wakes (a report, an update, its timer)
it hands `pool_plan.plan` a `Situation` (its members and books) and turns
the `Step` it gets back into commands, in the order given: terminate
signals after a drain, child starts, rotate signals, the reconcile. Each
member's place in the pool is a `MemberPhase` (active, queued, rotating,
removing); reports, updates and the plan move it from one to the next.
What a person reads of it in the Web UI (each member start's summary and
details, the timer's summary, the member table in the current details) is
written by workflows/pool_view.py.

The pool never polls a member and sets one timer at a time, for the earliest
thing it must do on its own (`pool_plan.next_wake`): a member's rotation
falling due, the end of a replacement backoff, or the next reconcile; the
timer's summary says which. So a pool in steady state writes history only
when a member's lifetime ends.

Rotation is the pool's: member lifetimes are `template.max_lifetime_seconds`
spread by `lifetime_jitter`, and the pool rotates a member whose lifetime is
up through the member's `rotate` signal (make before break), at most
`max_surge` at a time, so members never rotate together. Bans and `rotate`
updates go through the same queue, bans first.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ApplicationError, FailureError, WorkflowAlreadyStartedError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.errors import invalid_input
    from activities.models import (
        EndpointCheck,
        VerifyEndpointInput,
    )
    from activities.pool import MembersInput, MembersOutput, PoolActivities
    from activities.provider import ProviderActivities
    from contract import (
        MEMBER_CHANGED_SIGNAL,
        POOL,
        PROXY_LIFECYCLE,
        PROXY_POOL,
        ROTATE_SIGNAL,
        STATE,
        TERMINATE_SIGNAL,
        PoolState,
        ProxyState,
    )
    from workflows import policies, pool_plan, pool_view
    from workflows.inputs import (
        DEFAULT_HEALTH_TARGET,
        continued_state,
        parse_model,
        signal_reason,
    )
    from workflows.membership import MAX_ERROR_LENGTH, parse_report
    from workflows.pool_input import (
        BanRequest,
        PoolInput,
        RotateRequest,
        ScaleRequest,
        pool_id_problems,
    )
    from workflows.pool_plan import (
        ENDED,
        RECONCILE_BUSY,
        Member,
        MemberPhase,
        Situation,
        Step,
        Wake,
    )
    from workflows.target_check import check_target, target_input

MEMBER_DRAIN_PATCH = "member-drain"
# Pools recorded before endpoints were verified took a report's endpoint as it came.
VERIFIED_ENDPOINTS_PATCH = "verified-endpoints"
# Updates applied lately, by id, with their results: Temporal refuses a
# repeated update id within a run, not across continue-as-new, so a client
# retrying one after it would apply it twice (a second full `rotate`).
REMEMBERED_UPDATES = 64
# A remembered result keeps this many entries of a list (`rotate`'s queued).
REMEMBERED_LIST = 50
# A report stamped further ahead of the pool's clock than this is forged (a
# member stamps its reports with its own workflow time): taken, it would
# shadow the member's real reports until then.
MAX_REPORT_SKEW = timedelta(minutes=5)
# A member id missing from visibility this soon after its start is not
# suspect: visibility lags.
SETTLE = timedelta(seconds=30)
MIN_ALARM = timedelta(seconds=1)
RECONCILE = policies.ActivityProfile(
    start_to_close=timedelta(seconds=30), schedule_to_close=timedelta(minutes=2)
)


@dataclass
class MemberStatus:
    """One member in the `status` query."""

    member: str
    state: str
    # The endpoint its provider confirmed ("" until then): what clients get.
    endpoint: str
    provider: str
    placement: dict[str, str]
    generation: int
    started_at: str
    ready_since: str | None
    rotate_at: str | None
    rotating: bool
    banned: str | None
    removing: str | None
    last_rotation: str | None
    last_error: str | None
    # A reported endpoint its provider has not confirmed (yet): checking, or refused.
    unconfirmed_endpoint: str | None = None


@dataclass
class PoolStatus:
    """What the `status` query returns, as of the pool's last workflow task (`as_of`).

    A query cannot read the time it is asked at: `workflow.now()` in a query
    handler is the time of the last workflow task, which in a calm pool is
    up to an hour old. So `status` gives timestamps (`ready_since`), and the
    reader computes ages from its own clock (docs/operations.md).
    """

    state: PoolState
    as_of: str
    replicas: int
    ready: int
    members: list[MemberStatus]
    waiting_for: str | None
    failures_in_a_row: int
    last_error: str | None
    stopped_replacing: str | None
    terminate_reason: str | None
    # `member_changed` reports refused: malformed, stamped in the future, or
    # naming an endpoint the member's provider does not confirm.
    rejected_reports: int = 0
    last_rejected: str | None = None


@dataclass(frozen=True)
class PoolEndpoint:
    """One entry of the `endpoints` query: a Ready member a client may use now."""

    member: str
    endpoint: str
    provider: str
    placement: dict[str, str]


@dataclass(frozen=True)
class AppliedUpdate:
    """An update a run applied: a digest of its id, and the result it returned."""

    key: str
    result: dict[str, Any]


@dataclass
class PoolCarried:
    """Everything continue-as-new hands to the next run."""

    replicas: int
    # Runs from before MemberPhase carried another shape (pool_plan.legacy_carried).
    members: list[Member]
    next_index: int
    failures_in_a_row: int = 0
    last_error: str | None = None
    stopped_replacing: str | None = None
    start_after: str | None = None
    bans: list[str] = field(default_factory=list)
    last_reconcile: str | None = None
    terminate_reason: str | None = None
    rejected_reports: int = 0
    last_rejected: str | None = None
    vacancies: list[str] = field(default_factory=list)
    # Oldest first, REMEMBERED_UPDATES at most (a list: JSON objects' keys
    # come back sorted, not in the order they were added).
    applied_updates: list[AppliedUpdate] = field(default_factory=list)


@dataclass(frozen=True)
class PoolResult:
    """What a finished ProxyPool returns."""

    state: PoolState
    reason: str
    members_started: int


@workflow.defn(name=PROXY_POOL)
class ProxyPool:
    def __init__(self) -> None:
        self._inp: PoolInput | None = None
        self._replicas = 0
        self._members: dict[str, Member] = {}
        self._next_index = 0
        self._failures_in_a_row = 0
        self._last_error: str | None = None
        self._stopped: str | None = None
        self._start_after: datetime | None = None
        self._bans: list[str] = []
        self._last_reconcile: datetime | None = None
        self._terminate_reason: str | None = None
        # Why members the pool did not remove are gone: the causes of their replacements.
        self._vacancies: list[str] = []
        self._dirty = True
        self._tasks: set[asyncio.Task[None]] = set()
        self._alarm: asyncio.Task[None] | None = None
        self._alarm_at: datetime | None = None
        self._reconciling = False
        # Members whose start command has not been answered yet.
        self._starting: set[str] = set()
        # Members whose reported endpoint awaits its provider's word, and
        # those whose check is under way.
        self._unverified: set[str] = set()
        self._verifying: set[str] = set()
        self._rejected_reports = 0
        self._last_rejected: str | None = None
        self._applied_updates: dict[str, dict[str, Any]] = {}
        self._published: tuple[str, str] | None = None

    # ---- the contract: run, signals, queries, updates -------------------------------

    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> PoolResult:
        # Untyped, so no argument can fail to decode outside our validation.
        state, argument_problems = continued_state(
            PoolCarried, pool_plan.legacy_carried(carried), extra
        )
        inp = await self._validated(raw, argument_problems, continued=state is not None)
        self._inp = inp
        if state is not None:
            self._restore(state)
        else:
            self._replicas = inp.replicas
            self._last_reconcile = workflow.now()
        workflow.upsert_search_attributes([POOL.value_set(workflow.info().workflow_id)])
        try:
            while self._terminate_reason is None:
                self._dirty = False
                self._apply(
                    pool_plan.plan(
                        self._situation(), inp, workflow.info().workflow_id, workflow.now()
                    )
                )
                self._verify_endpoints()
                self._publish()
                if workflow.info().is_continue_as_new_suggested() and not self._tasks:
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    if self._terminate_reason is None and not self._tasks:
                        workflow.continue_as_new(args=[raw, self._carry()])
                self._arm(pool_plan.next_wake(self._situation()))
                await workflow.wait_condition(
                    lambda: self._dirty or self._terminate_reason is not None
                )
        except asyncio.CancelledError:
            self._terminate_reason = self._terminate_reason or "pool cancelled"
            await self._end_members()
            raise
        await self._end_members()
        return PoolResult(PoolState.TERMINATED, self._terminate_reason, self._next_index)

    @workflow.signal(name=TERMINATE_SIGNAL)
    def terminate(self, request: Any = None, *_extra: Any) -> None:
        """Terminate every member (each deletes its instance), then complete.

        Input optional: `{"reason": "..."}`, or just the reason as a string.
        """
        self._terminate_reason = signal_reason(request, "terminate signal")

    @workflow.signal(name=MEMBER_CHANGED_SIGNAL)
    def member_changed(self, raw: Any = None, *_extra: Any) -> None:
        """A member's report of its new state (sent by ProxyLifecycle, never by hand).

        Anyone who may signal in the namespace can send one, so it is checked
        and capped (workflows/membership.py), never raises, and its endpoint
        is used only once the member's provider confirms it
        (`_verify_endpoints`). Refused reports are counted in `status`.
        """
        report, problem = parse_report(raw)
        if report is None:
            self._reject(f"malformed report: {problem}")
            return
        if datetime.fromisoformat(report.at) > workflow.now() + MAX_REPORT_SKEW:
            self._reject(f"report for {report.member[:100]!r} stamped in the future ({report.at})")
            return
        member = self._members.get(report.member)
        if member is None or not report.newer_than(member.report_at, member.report_seq):
            return  # a member already forgotten, or a report overtaken by a later one
        if member.take(report):
            self._failures_in_a_row = 0  # a new member works: the budget is whole again
        if report.state in ENDED:
            self._ended(member, report.state, report.last_error)
        elif report.state == ProxyState.READY and report.endpoint != member.verified:
            if workflow.patched(VERIFIED_ENDPOINTS_PATCH):
                self._unverified.add(member.member)
            else:
                member.verified = report.endpoint
        self._dirty = True

    @workflow.query(name="status")
    def status(self) -> PoolStatus:
        situation = self._situation()
        return PoolStatus(
            state=pool_plan.pool_state(situation),
            as_of=workflow.now().isoformat(timespec="seconds"),
            replicas=self._replicas,
            ready=len(self._serving()),
            members=[self._member_status(m) for m in situation.members],
            waiting_for=pool_plan.waiting_for(situation),
            failures_in_a_row=self._failures_in_a_row,
            last_error=self._last_error,
            stopped_replacing=self._stopped,
            terminate_reason=self._terminate_reason,
            rejected_reports=self._rejected_reports,
            last_rejected=self._last_rejected,
        )

    @workflow.query(name="endpoints")
    def endpoints(self) -> list[PoolEndpoint]:
        """Ready members a client may use now: not banned, not being removed."""
        return [
            PoolEndpoint(m.member, m.verified, m.provider, m.placement) for m in self._serving()
        ]

    @workflow.update(name="scale")
    def scale(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """Keep `replicas` members; also resumes replacing after the failure budget ran out."""
        applied = self._applied()
        if applied is not None:
            return applied
        req = self._request(ScaleRequest, request, "scale", extra)
        previous, self._replicas = self._replicas, req.replicas
        self._stopped = None
        self._failures_in_a_row = 0
        self._start_after = None
        self._dirty = True
        return self._remember({"replicas": req.replicas, "previous": previous})

    @scale.validator
    def _validate_scale(self, request: Any = None, *extra: Any) -> None:
        if self._applied() is None:
            self._request(ScaleRequest, request, "scale", extra)

    @workflow.update(name="rotate")
    def rotate(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """Queue members for a rolling, make-before-break rotation; returns the queued."""
        applied = self._applied()
        if applied is not None:
            return applied
        req = self._request(RotateRequest, request, "rotate", extra)
        # All: every member that has served; one still starting is new already.
        targets = (
            [m for m in self._live() if m.served] if req.all else [self._members[str(req.member)]]
        )
        reason = "rotate all" if req.all else "rotate update"
        queued = [member.member for member in targets if member.queue(reason)]
        self._dirty = True
        return self._remember({"queued": queued})

    @rotate.validator
    def _validate_rotate(self, request: Any = None, *extra: Any) -> None:
        if self._applied() is not None:
            return
        req = self._request(RotateRequest, request, "rotate", extra)
        if req.member is not None:
            self._live_member(req.member)

    @workflow.update(name="report_ban")
    def report_ban(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """Take a member out of `endpoints` now and rotate it; rate-limited per pool."""
        applied = self._applied()
        if applied is not None:
            return applied
        req = self._request(BanRequest, request, "report_ban", extra)
        member = self._live_member(req.member)
        if member.ban_changes_nothing(req.endpoint):
            return {"member": member.member, "banned": False, "already": True}
        assert self._inp is not None  # _request refuses updates before the input is known
        now = workflow.now()
        self._bans = [*pool_plan.recent_bans(self._bans, self._inp.bans, now), now.isoformat()]
        member.ban(req.reason or "reported banned")
        self._dirty = True
        return self._remember({"member": member.member, "banned": True, "already": False})

    @report_ban.validator
    def _validate_report_ban(self, request: Any = None, *extra: Any) -> None:
        if self._applied() is not None:
            return  # a retry of one applied before a continue-as-new: its result again
        req = self._request(BanRequest, request, "report_ban", extra)
        member = self._live_member(req.member)
        if member.ban_changes_nothing(req.endpoint):
            return  # idempotent: accepted, changes nothing
        if not pool_plan.is_serving(member):
            raise invalid_input(f"member: {req.member} is not serving (state {member.state})")
        assert self._inp is not None
        refusal = pool_plan.ban_refusal(self._bans, self._inp.bans, self._replicas, workflow.now())
        if refusal is not None:
            raise invalid_input(refusal)

    # ---- validation -----------------------------------------------------------------

    async def _validated(
        self, raw: Any, argument_problems: list[str], *, continued: bool
    ) -> PoolInput:
        inp, problems = parse_model(PoolInput, raw, "with at least 'replicas' and 'template'")
        if continued and inp is not None and not argument_problems:
            return inp  # validated when the pool first started
        problems = argument_problems + problems + pool_id_problems(workflow.info().workflow_id)
        if not argument_problems and isinstance(raw, dict):
            problems += await self._worker_problems(raw)
        if problems or inp is None:
            message = "invalid input: " + "; ".join(problems)
            self._last_error = message
            raise invalid_input(message)
        return inp

    async def _worker_problems(self, raw: dict[str, Any]) -> list[str]:
        """What only the worker can check, for the template and every spread entry.

        Read from the raw input, so these are named even when other fields
        are wrong too.
        """
        template = raw.get("template")
        template = template if isinstance(template, dict) else {}
        spread = raw.get("spread")
        targets = [("template.", template)] + [
            (f"spread.{i}.", entry)
            for i, entry in enumerate(spread if isinstance(spread, list) else [])
            if isinstance(entry, dict)
        ]
        port = template.get("port")
        health = template.get("health")
        target = health.get("target") if isinstance(health, dict) else None
        problems: list[str] = []
        for prefix, entry in targets:
            provider, placement = entry.get("provider"), entry.get("placement")
            if not isinstance(provider, str):
                continue
            found = await check_target(
                target_input(
                    provider,
                    port if isinstance(port, int) and 0 < port < 65536 else None,
                    placement,
                    target if isinstance(target, str) else DEFAULT_HEALTH_TARGET,
                )
            )
            problems += [
                prefix + problem for problem in found.problems if prefix + problem not in problems
            ]
        return problems

    def _applied(self) -> dict[str, Any] | None:
        """The result of the current update if its id was applied already (in an earlier run)."""
        return self._applied_updates.get(_update_key())

    def _remember(self, result: dict[str, Any]) -> dict[str, Any]:
        """Keep the current update's result under its id, the oldest going past the bound."""
        kept = {k: v[:REMEMBERED_LIST] if isinstance(v, list) else v for k, v in result.items()}
        self._applied_updates[_update_key()] = kept
        while len(self._applied_updates) > REMEMBERED_UPDATES:
            del self._applied_updates[next(iter(self._applied_updates))]
        return result

    def _request(self, model: Any, raw: Any, what: str, extra: tuple[Any, ...]) -> Any:
        """An update's request, or a rejection naming every bad field.

        Handlers take any arguments, untyped, so that none fails in the SDK
        before this: no argument, extra ones and undecodable JSON are refused
        here (or by workflows/payloads.py) as InvalidInput, naming the argument.
        """
        if self._inp is None or self._terminate_reason is not None:
            raise invalid_input(
                f"{what}: the pool is {pool_plan.pool_state(self._situation())}, not taking updates"
            )
        req, problems = parse_model(model, raw, f"(the {what} request)")
        problems += [f"argument {i}: unexpected extra argument" for i, _ in enumerate(extra, 2)]
        if problems or req is None:
            raise invalid_input(f"invalid {what} request: " + "; ".join(problems))
        return req

    def _live_member(self, member_id: str) -> Member:
        member = self._members.get(member_id)
        if member is None or member.phase is MemberPhase.REMOVING:
            known = ", ".join(m.member for m in self._live()) or "none"
            raise invalid_input(f"member: no member {member_id!r} in this pool (members: {known})")
        return member

    # ---- one step: the plan applied ----------------------------------------------

    def _situation(self) -> Situation:
        return Situation(
            replicas=self._replicas,
            members=tuple(self._ordered()),
            next_index=self._next_index,
            failures_in_a_row=self._failures_in_a_row,
            stopped=self._stopped,
            start_after=self._start_after,
            last_reconcile=self._last_reconcile,
            reconciling=self._reconciling,
            starting=len(self._starting),
            ending=self._terminate_reason is not None,
            vacancies=tuple(self._vacancies),
        )

    def _apply(self, step: Step) -> None:
        """The plan's members and books, then its commands, each in a task of its own, in order."""
        self._members = {m.member: m for m in step.members}
        self._next_index = step.next_index
        self._start_after = step.start_after
        self._vacancies = list(step.vacancies)
        for removal in step.removals:
            self._spawn(self._drain_then_terminate(removal.member, removal.reason, removal.drain))
        for start in step.starts:
            self._starting.add(start.member.member)
            self._spawn(self._start_child(start))
        for rotation in step.rotations:
            reason = {"reason": f"pool: {rotation.reason}"}
            self._spawn(self._signal(rotation.member, ROTATE_SIGNAL, reason))
        if step.reconcile:
            self._reconciling = True
            self._last_reconcile = workflow.now()
            self._spawn(self._reconcile())

    def _verify_endpoints(self) -> None:
        """Ask the provider about every reported endpoint not yet confirmed, once at a time."""
        for member_id in sorted(self._unverified - self._verifying):
            member = self._members.get(member_id)
            if member is None or member.state != ProxyState.READY or not member.endpoint:
                self._unverified.discard(member_id)
                continue
            self._verifying.add(member_id)
            self._spawn(self._verify(member, member.endpoint))

    async def _verify(self, member: Member, claimed: str) -> None:
        try:
            check: EndpointCheck = await workflow.execute_activity_method(
                ProviderActivities.verify_endpoint,
                VerifyEndpointInput(member.provider, member.member, claimed),
                summary=f"verify {member.member} at {claimed}",
                start_to_close_timeout=policies.VERIFY.start_to_close,
                schedule_to_close_timeout=policies.VERIFY.schedule_to_close,
                retry_policy=policies.TRANSIENT_RETRY,
            )
        except FailureError as err:
            self._last_error = f"could not verify {member.member}'s endpoint: {err}"
            cause = err.cause
            if isinstance(cause, ApplicationError) and (
                cause.non_retryable or cause.type in policies.NON_RETRYABLE
            ):
                # Asking again cannot help (a provider this worker does not
                # have): refused, or the next step would ask at once, forever.
                self._unverified.discard(member.member)
                self._reject(f"{member.member}: {cause.message}")
            # Otherwise still unverified (the provider's outage outlasted the
            # retries): asked again on the next step.
            return
        finally:
            self._verifying.discard(member.member)
        current = self._members.get(member.member)
        if current is None or current.state != ProxyState.READY or current.endpoint != claimed:
            return  # overtaken by a later report, which has a check of its own
        self._unverified.discard(member.member)
        if check.verified:
            current.verified = claimed
        else:
            self._reject(check.problem)

    def _reject(self, problem: str) -> None:
        """Count a refused member report, keep the latest reason, and log it."""
        self._rejected_reports += 1
        self._last_rejected = problem[:MAX_ERROR_LENGTH]
        workflow.logger.warning("member report refused: %s", self._last_rejected)

    async def _drain_then_terminate(self, member: str, reason: str, drain: int) -> None:
        # Pools recorded before drains existed signal at once.
        if drain and workflow.patched(MEMBER_DRAIN_PATCH):
            await workflow.sleep(drain, summary=pool_view.drain_summary(member, drain, reason))
        await self._signal(member, TERMINATE_SIGNAL, {"reason": f"pool: {reason}"})

    def _ended(self, member: Member, state: str, error: str | None) -> None:
        """A member closed: forget it; replace it unless the pool asked for its end."""
        self._members.pop(member.member, None)
        if member.phase is MemberPhase.REMOVING or self._terminate_reason is not None:
            return
        if state != ProxyState.FAILED:
            # Ended from outside the pool (a user's terminate): replaced at once.
            self._vacancies.append(f"replaces {member.member}, {state} from outside the pool")
            return
        self._vacancies.append(f"replaces {member.member}, ended Failed: {error or 'no reason'}")
        assert self._inp is not None
        failure = pool_plan.after_failure(
            self._failures_in_a_row, self._inp.failure_budget, member.member, error, workflow.now()
        )
        self._failures_in_a_row, self._last_error = failure.failures_in_a_row, failure.last_error
        if failure.stopped is not None:
            self._stopped = failure.stopped
        else:
            self._start_after = failure.start_after

    # ---- commands, each in a task of its own ----------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.create_task(work)
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self._dirty = True

        task.add_done_callback(done)

    async def _start_child(self, start: pool_plan.Start) -> None:
        member = start.member.member
        try:
            await workflow.start_child_workflow(
                PROXY_LIFECYCLE,
                start.body,
                id=member,
                task_queue=workflow.info().task_queue,
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
            self._members.pop(member, None)
            self._last_error = f"could not start {member}: {err}"
            self._vacancies.append(f"{start.cause}; retried after {member} could not start")
            self._start_after = workflow.now() + policies.REPLACE_BACKOFF.first
        finally:
            self._starting.discard(member)

    async def _signal(self, member: str, name: str, payload: dict[str, str]) -> None:
        handle = workflow.get_external_workflow_handle(member)
        try:
            await handle.signal(name, payload)
        except FailureError:
            # Already closed: the reconcile finds out how, and soon.
            self._last_reconcile = None

    async def _reconcile(self) -> None:
        """Catch members that closed without a report, and strays nobody started."""
        now = workflow.now()
        settled = [
            m.member
            for m in self._members.values()
            if now - datetime.fromisoformat(m.started_at) >= SETTLE
        ]
        try:
            found: MembersOutput = await workflow.execute_activity_method(
                PoolActivities.closed_members,
                MembersInput(workflow.info().workflow_id, settled),
                summary="reconcile members",
                start_to_close_timeout=RECONCILE.start_to_close,
                schedule_to_close_timeout=RECONCILE.schedule_to_close,
                retry_policy=policies.TRANSIENT_RETRY,
            )
        except FailureError as err:
            self._last_error = f"reconcile failed: {err}"
            return
        finally:
            self._reconciling = False
        for closed in found.closed:
            member = self._members.get(closed.member)
            if member is not None:
                failed = closed.status == "FAILED" or closed.state == ProxyState.FAILED
                state = ProxyState.FAILED if failed else ProxyState.TERMINATED
                self._ended(member, state, f"closed {closed.status.lower()} without a report")
        for stray in found.strays:
            if stray not in self._members and stray not in self._starting:
                handle = workflow.get_external_workflow_handle(stray)
                with contextlib.suppress(FailureError):
                    await handle.signal(TERMINATE_SIGNAL, {"reason": "pool: not a member"})

    # ---- timers ---------------------------------------------------------------------

    def _arm(self, wake: Wake | None) -> None:
        """One timer for the earliest wake; kept when still early enough."""
        if wake is None:
            return
        if self._alarm is not None and not self._alarm.done():
            assert self._alarm_at is not None
            if self._alarm_at <= wake.at:
                return
            self._alarm.cancel()
        # Past deadlines are acted on in the step that computed them; one
        # still past is retried in a second, never in a busy loop.
        delay = max(wake.at - workflow.now(), MIN_ALARM)
        self._alarm_at = wake.at
        summary = pool_view.alarm_summary(workflow.now() + delay, wake.action)
        self._alarm = asyncio.create_task(self._ring(delay, summary))

    async def _ring(self, delay: timedelta, summary: str) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await workflow.sleep(delay, summary=summary)
            self._dirty = True

    # ---- ending ---------------------------------------------------------------------

    async def _end_members(self) -> None:
        """Terminate every member and wait until each has ended (its instance deleted)."""
        self._publish()
        await workflow.wait_condition(lambda: not self._starting)
        reason = self._terminate_reason or "pool ending"
        for member in list(self._members.values()):
            if member.phase is not MemberPhase.REMOVING:
                member.remove(reason)
                self._spawn(self._drain_then_terminate(member.member, reason, 0))
        self._publish()
        while self._members:
            self._arm(Wake(workflow.now() + RECONCILE_BUSY, "check on the members still ending"))
            self._dirty = False
            await workflow.wait_condition(lambda: self._dirty or not self._members)
            if self._members and (
                self._last_reconcile is None
                or workflow.now() - self._last_reconcile >= RECONCILE_BUSY
            ):
                self._last_reconcile = workflow.now()
                await self._reconcile()
            self._publish()
        if self._alarm is not None:
            self._alarm.cancel()
        await workflow.wait_condition(lambda: not self._tasks)
        self._publish(PoolState.TERMINATED)

    def _carry(self) -> PoolCarried:
        return PoolCarried(
            replicas=self._replicas,
            members=list(self._members.values()),
            next_index=self._next_index,
            failures_in_a_row=self._failures_in_a_row,
            last_error=self._last_error,
            stopped_replacing=self._stopped,
            start_after=self._start_after.isoformat() if self._start_after else None,
            bans=pool_plan.recent_bans(self._bans, self._inp.bans, workflow.now())
            if self._inp is not None
            else self._bans,
            last_reconcile=self._last_reconcile.isoformat() if self._last_reconcile else None,
            terminate_reason=self._terminate_reason,
            rejected_reports=self._rejected_reports,
            last_rejected=self._last_rejected,
            vacancies=self._vacancies,
            applied_updates=[AppliedUpdate(k, r) for k, r in self._applied_updates.items()],
        )

    def _restore(self, carried: PoolCarried) -> None:
        self._replicas = carried.replicas
        self._members = {m.member: m for m in carried.members}
        self._next_index = carried.next_index
        self._failures_in_a_row = carried.failures_in_a_row
        self._last_error = carried.last_error
        self._stopped = carried.stopped_replacing
        self._start_after = (
            datetime.fromisoformat(carried.start_after) if carried.start_after else None
        )
        self._bans = carried.bans
        self._last_reconcile = (
            datetime.fromisoformat(carried.last_reconcile) if carried.last_reconcile else None
        )
        self._terminate_reason = carried.terminate_reason
        self._rejected_reports = carried.rejected_reports
        self._last_rejected = carried.last_rejected
        self._applied_updates = {
            a.key: a.result for a in carried.applied_updates[-REMEMBERED_UPDATES:]
        }
        # Carried from a run before endpoints were verified, or a check cut
        # short by continue-as-new: asked again.
        self._unverified = {
            m.member
            for m in carried.members
            if m.state == ProxyState.READY and m.endpoint and m.endpoint != m.verified
        }
        self._vacancies = carried.vacancies

    # ---- views ----------------------------------------------------------------------

    def _ordered(self) -> list[Member]:
        return sorted(self._members.values(), key=lambda m: m.index)

    def _live(self) -> list[Member]:
        """Members the pool keeps: not told to terminate."""
        return pool_plan.live(self._situation())

    def _serving(self) -> list[Member]:
        return [m for m in self._live() if pool_plan.is_serving(m)]

    def _member_status(self, m: Member) -> MemberStatus:
        rotate_at = pool_plan.rotate_at(m)
        return MemberStatus(
            member=m.member,
            state=m.state,
            endpoint=m.verified,
            provider=m.provider,
            placement=m.placement,
            generation=m.generation,
            started_at=m.started_at,
            ready_since=m.ready_since,
            rotate_at=rotate_at.isoformat(timespec="seconds") if rotate_at else None,
            rotating=m.phase is MemberPhase.ROTATING,
            banned=m.banned,
            removing=m.reason if m.phase is MemberPhase.REMOVING else None,
            last_rotation=m.last_rotation,
            last_error=m.last_error,
            unconfirmed_endpoint=m.endpoint if m.endpoint != m.verified else None,
        )

    def _publish(self, state: PoolState | None = None) -> None:
        """ProxyState on the pool, and the member table in the Web UI's current details."""
        situation = self._situation()
        state = state or pool_plan.pool_state(situation)
        details = pool_view.current_details(
            state,
            self._replicas,
            len(self._serving()),
            situation.members,
            pool_plan.waiting_for(situation),
            self._last_error,
        )
        if self._published is None or state != self._published[0]:
            workflow.upsert_search_attributes([STATE.value_set(state)])
        if self._published is None or details != self._published[1]:
            workflow.set_current_details(details)
        self._published = (state, details)


def _update_key() -> str:
    """A fixed-size key for the current update's id (a client's string, of any length)."""
    info = workflow.current_update_info()
    assert info is not None, "called from an update's handler or validator only"
    return hashlib.sha256(info.id.encode()).hexdigest()[:32]
