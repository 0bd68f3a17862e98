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

A pool started on "<queue>-pools" (contract.POOL_QUEUE_SUFFIX) runs in a
worker of its own and starts its members, and runs every activity it asks
for, on "<queue>"; on any other queue it keeps all on its own.

Rotation is the pool's: member lifetimes are `template.max_lifetime_seconds`
spread by `lifetime_jitter`, and the pool rotates a member whose lifetime is
up through the member's `rotate` signal (make before break), at most
`max_surge` at a time, so members never rotate together. Bans and `rotate`
updates go through the same queue, bans first.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import attrgetter
from typing import Any, NoReturn

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ApplicationError, FailureError, WorkflowAlreadyStartedError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.errors import invalid_input
    from activities.models import (
        EndpointCheck,
        FailingMember,
        VerifyEndpointInput,
    )
    from activities.pool import MembersInput, MembersOutput, PoolActivities
    from activities.provider import ProviderActivities
    from contract import (
        INSTANCE_FAILING_SIGNAL,
        MEMBER_CHANGED_SIGNAL,
        POOL,
        PROXY_LIFECYCLE,
        PROXY_POOL,
        QUOTA_RETRY_DELAY,
        ROTATE_SIGNAL,
        STATE,
        TERMINATE_SIGNAL,
        ErrorType,
        PoolState,
        ProxyState,
        members_task_queue,
    )
    from workflows import (
        policies,
        pool_autoscale,
        pool_carried,
        pool_feed,
        pool_plan,
        pool_status,
        pool_view,
    )
    from workflows.early_signals import EarlySignals
    from workflows.inputs import (
        DEFAULT_HEALTH_TARGET,
        continued_state,
        parse_model,
        signal_reason,
    )
    from workflows.membership import MAX_ERROR_LENGTH, parse_report
    from workflows.patches import (
        POOL_FLOOR,
        PUBLISH_ENDPOINTS_DIGEST,
        VERIFY_WAITS_OUT_QUOTA,
        keep_floor,
        taken,
    )
    from workflows.pool_carried import AppliedUpdate, Lifetimes, PoolCarried
    from workflows.pool_input import (
        BanRequest,
        PoolInput,
        RotateRequest,
        ScaleRequest,
        StatusRequest,
        pool_id_problems,
    )
    from workflows.pool_monitor import PoolMonitor
    from workflows.pool_plan import (
        ENDED,
        RECONCILE_BUSY,
        SCALED_DOWN,
        Member,
        MemberPhase,
        Situation,
        Step,
        Wake,
    )
    from workflows.pool_status import PoolStatus
    from workflows.target_check import check_target, target_input

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
# Refused `member_changed` reports, as the worker's /metrics serves them (with
# `_total`, by namespace, task_queue and workflow_type).
REPORTS_REFUSED_METRIC = "proxy_operator_pool_reports_refused"
REPORTS_REFUSED_HELP = (
    "member_changed reports a pool refused: malformed, stamped in the future, "
    "or naming an endpoint the member's provider does not confirm"
)
# A member id missing from visibility this soon after its start is not
# suspect: visibility lags.
SETTLE = timedelta(seconds=30)
MIN_ALARM = timedelta(seconds=1)
MAX_HOLD = timedelta(seconds=60)
# A pool continues as new past either (`_time_to_continue`).
POOL_EVENT_BUDGET = 500
# About what one removal or rotation writes into the pool's history: a
# rotation is the `rotate` signal out (2 events), the member's Ready report
# (1) and the check of its new endpoint (3), the workflow tasks around them
# shared with others; a surge of 100 took a run from just under 500 events
# to about 1,030 (5.3 each).
EVENTS_PER_COMMAND = 6
POOL_HISTORY_BUDGET = 1024 * 1024
RECONCILE = policies.ActivityProfile(
    start_to_close=timedelta(seconds=30), schedule_to_close=timedelta(minutes=2)
)


@dataclass(frozen=True)
class PoolEndpoint:
    """One entry of the `endpoints` query: a Ready member a client may use now."""

    member: str
    endpoint: str
    provider: str
    placement: dict[str, str]
    # Where its traffic leaves from (None: unknown); gateways route by `endpoint` only.
    exit_address: str | None = None


@dataclass(frozen=True)
class PoolResult:
    """What a finished ProxyPool returns."""

    state: PoolState
    reason: str
    members_started: int


def _applied_once(
    handler: Callable[..., dict[str, Any]],
) -> Callable[..., Coroutine[Any, Any, dict[str, Any]]]:
    """An update handler whose retry, by update id, gets its first result again.

    The wrapper waits for the pool's state (`ProxyPool._taken_over`), then
    answers an update applied already, in this run or an earlier one, with
    what `_remember` kept; only a new update reaches `handler`. The same steps
    in the same order for `scale`, `rotate` and `report_ban`, so one place.
    """

    @functools.wraps(handler)
    async def once(pool: ProxyPool, request: Any = None, *extra: Any) -> dict[str, Any]:
        await pool._taken_over()
        applied = pool._applied()
        if applied is not None:
            return applied
        return handler(pool, request, *extra)

    return once


# Outside the SDK's workflow sandbox. A pool plans over all its members at
# every workflow task, and in the sandbox each task also paid for its module
# proxies (a census of 1,000 members took three times as long), for every
# payload of every command a snippet compiled anew to ask for a serialization
# context, and for each new instance (every replay after a restart) a fresh
# import of the workflow modules: docs/benchmarks.md has the figures. What the
# sandbox enforces still holds, and is still checked: the pool's decisions
# are pure functions (pool_plan, pool_autoscale, pool_status) and
# tests/workflows/test_replay.py replays every pool recording inside the
# sandbox too, where a clock, I/O or randomness outside the workflow API fails.
SANDBOXED = False


@workflow.defn(name=PROXY_POOL, sandboxed=SANDBOXED)
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
        # Members this run started: their closing is an event of this run.
        self._children: dict[str, workflow.ChildWorkflowHandle[Any, Any]] = {}
        # Members whose reported endpoint awaits its provider's word, and
        # those whose check is under way.
        self._unverified: set[str] = set()
        self._verifying: set[str] = set()
        # Members whose check met a quota or rate limit: asked again from then.
        self._verify_after: dict[str, datetime] = {}
        self._rejected_reports = 0
        self._last_rejected: str | None = None
        # Not carried: the next run's checks say it again if it still holds.
        self._last_exit_problem: str | None = None
        self._applied_updates: dict[str, dict[str, Any]] = {}
        self._published: tuple[str, str] | None = None
        # An autoscaled pool's books, and why it has its size now.
        self._autoscale: pool_autoscale.Books | None = None
        self._scaling_why: str | None = None
        self._usage = pool_autoscale.Usage()
        # When the pool began holding new commands back to continue as new.
        self._hold_since: datetime | None = None
        self._rotations_abandoned = 0
        self._early = EarlySignals()
        # The members' monitor, from the run's start until the pool ends.
        self._monitor: PoolMonitor | None = None
        # Where members and activities run when not on the pool's own queue.
        self._members_queue: str | None = None
        # The digest of `endpoints` in the memo, for gateways (workflows/pool_feed.py).
        self._feed = pool_feed.EndpointsFeed()

    def _time_to_continue(self) -> bool:
        """Continue as new when the server suggests it or past the pool's own budget.

        A pool of 1,000 members plans over all of them at each workflow task,
        so a worker that must replay its history (after a restart, an
        eviction or a timed-out task) pays that for every task in it: the
        budget keeps that replay to about 0.3 to 0.6 s in process at 1,000
        members, a run holding for a surge of rotations the longest
        (docs/benchmarks.md).
        """
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= POOL_EVENT_BUDGET
            or info.get_current_history_size() >= POOL_HISTORY_BUDGET
        )

    def _step_due(self, *, watch_budget: bool) -> bool:
        """Whether to step again: something changed, the pool is ending, or (watching
        the budget, until it is passed) its run has just grown past it: events it
        ignores (reports of members it does not have, which anyone may send) grow it too."""
        return (
            self._dirty
            or self._terminate_reason is not None
            or (watch_budget and self._time_to_continue())
        )

    # ---- the contract: run, signals, queries, updates -------------------------------

    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> PoolResult:
        # Where 0.3.10's runs recorded their release marker: before the first
        # await, as the input check's local activity resolves in another
        # activation on replay than when first run.
        keep_floor(POOL_FLOOR)
        self._members_queue = _members_queue()
        self._monitor = PoolMonitor(self._tell_failing, self._wake_up, self._members_queue)
        feed = taken(PUBLISH_ENDPOINTS_DIGEST)
        # Untyped, so no argument can fail to decode outside our validation.
        pool_id = workflow.info().workflow_id
        state, argument_problems = continued_state(
            PoolCarried, carried, extra, lambda raw: pool_carried.decode(raw, pool_id)
        )
        self._early.decide(continued=state is not None)
        inp = await self._validated(raw, argument_problems, continued=state is not None)
        self._inp = inp
        if state is not None:
            self._restore(state)
        else:
            self._replicas = inp.replicas
            self._last_reconcile = workflow.now()
        self._early.took_over()
        self._feed.start(feed, self.endpoints)
        if inp.autoscale is not None and self._autoscale is None:
            self._autoscale = pool_autoscale.new_books(inp.autoscale)
        workflow.upsert_search_attributes([POOL.value_set(workflow.info().workflow_id)])
        try:
            while self._terminate_reason is None:
                self._dirty = False
                suggested = self._time_to_continue()
                if suggested and self._hold_since is None:
                    self._hold_since = workflow.now()
                holding = self._hold_since is not None and (
                    workflow.now() - self._hold_since < MAX_HOLD
                )
                more = False
                # The members' census, when this step's plan took it (nothing
                # changes the members from the plan to the wait below).
                counted: pool_plan.Census | None = None
                self._usage = pool_autoscale.counted(
                    self._usage, len(self._members), workflow.now()
                )
                if not holding:
                    self._autoscale_step()
                    step = pool_plan.plan(
                        self._situation(room=self._room()), inp, pool_id, workflow.now()
                    )
                    self._apply(step)
                    self._verify_endpoints()
                    more, counted = step.more, step.census
                refresh_at = self._refresh_monitor()
                # else: the pool issues nothing new once continue-as-new is
                # suggested, so the commands in flight end and it can hand over
                # (a pool bringing up 1,000 members always has some in flight);
                # for MAX_HOLD at most, as a long drain may be among them.
                self._usage.members = len(self._members)
                self._publish(counted=counted)
                # Members just started or rotating report within seconds: a
                # handover they cross would be refused (UnhandledCommand).
                unsettled = holding and not pool_plan.settled(self._situation())
                if suggested and not self._tasks and not unsettled:
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    if self._terminate_reason is None and not self._tasks:
                        if self._monitor is not None:
                            # The next run starts its own; these end quietly
                            # within a round or two, when they ask whether this
                            # run is still open (activities/provider.py).
                            self._monitor.cancel()
                        workflow.continue_as_new(
                            args=[raw, self._compact_carry(inp)], memo=self._feed.carried()
                        )
                    counted = None  # reports may have come in the wait
                wake = self._next_wake(counted)
                verify_wake = self._verify_wake()
                if verify_wake is not None and (wake is None or verify_wake.at < wake.at):
                    wake = verify_wake
                if refresh_at is not None and (wake is None or refresh_at < wake.at):
                    wake = Wake(refresh_at, "refresh the members' monitor")
                if more:
                    wake = Wake(workflow.now(), "start the next batch of removals and rotations")
                if holding and self._hold_since is not None:
                    wake = Wake(self._hold_since + MAX_HOLD, "stop waiting to continue as new")
                self._arm(wake)
                await workflow.wait_condition(
                    functools.partial(self._step_due, watch_budget=not suggested)
                )
        except asyncio.CancelledError:
            self._terminate_reason = self._terminate_reason or "pool cancelled"
            await self._end_members()
            raise
        await self._end_members(
            hand_over=lambda: workflow.continue_as_new(
                args=[raw, self._compact_carry(inp)], memo=self._feed.carried()
            )
        )
        return PoolResult(PoolState.TERMINATED, self._terminate_reason, self._next_index)

    @workflow.signal(name=TERMINATE_SIGNAL)
    def terminate(self, request: Any = None, *_extra: Any) -> None:
        """Terminate every member (each deletes its instance), then complete.

        Input optional: `{"reason": "..."}`, or just the reason as a string.
        """
        self._terminate_reason = signal_reason(request, "terminate signal")
        self._early.hold(lambda: self.terminate(request))

    @workflow.signal(name=MEMBER_CHANGED_SIGNAL)
    def member_changed(self, raw: Any = None, *_extra: Any) -> None:
        """A member's report of its new state (sent by ProxyLifecycle, never by hand).

        Anyone who may signal in the namespace can send one, so it is checked
        and capped (workflows/membership.py), never raises, and its endpoint
        is used only once the member's provider confirms it
        (`_verify_endpoints`). Refused reports are counted in `status`.
        """
        self._early.hold(lambda: self.member_changed(raw))
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
            self._unverified.add(member.member)
        self._dirty = True

    @workflow.query(name="status")
    def status(self, request: Any = None, *extra: Any) -> PoolStatus:
        """The pool, and a page of its members (workflows/pool_status.py).

        Argument optional: `{"after": <member index>, "limit": <n>}`; the
        answer's `next_page` is the argument for the next page.
        """
        page = _status_request(request, extra)
        situation = self._situation()
        counted = pool_plan.census(situation.members)
        members, next_page = pool_status.member_page(situation.members, page)
        return PoolStatus(
            state=pool_plan.pool_state(situation, counted),
            as_of=workflow.now().isoformat(timespec="seconds"),
            replicas=self._replicas,
            ready=counted.serving,
            members=members,
            waiting_for=pool_plan.waiting_for(situation, counted),
            failures_in_a_row=self._failures_in_a_row,
            last_error=self._last_error,
            stopped_replacing=self._stopped,
            terminate_reason=self._terminate_reason,
            rejected_reports=self._rejected_reports,
            last_rejected=self._last_rejected,
            scaling=pool_autoscale.scaling_status(
                self._autoscale,
                self._inp.autoscale if self._inp else None,
                self._replicas,
                self._scaling_why,
                self._usage,
                workflow.now(),
            ),
            distinct_exits=pool_plan.distinct_exits(situation.members),
            last_exit_problem=self._last_exit_problem,
            rotations_abandoned=self._rotations_abandoned,
            monitored=0 if self._monitor is None else self._monitor.watched,
            members_total=len(situation.members),
            next_page=next_page,
            bans=pool_plan.ban_standing(self._bans, self._inp.bans, self._replicas, workflow.now())
            if self._inp
            else None,
        )

    @workflow.query(name="endpoints")
    def endpoints(self) -> list[PoolEndpoint]:
        """Ready members a client may use now: not banned, not being removed."""
        return [
            PoolEndpoint(m.member, m.verified, m.provider, m.placement, m.exit_address or None)
            for m in self._serving()
        ]

    @workflow.update(name="scale")
    @_applied_once
    def scale(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """Keep `replicas` members, or (autoscaled) new bounds; also resumes replacing
        after the failure budget ran out."""
        req = self._scale_request(request, extra)
        self._stopped = None
        self._failures_in_a_row = 0
        self._start_after = None
        self._dirty = True
        if self._autoscale is not None:
            before = self._autoscale
            self._autoscale, _ = pool_autoscale.rebound(before, req.min_replicas, req.max_replicas)
            return self._remember(
                {
                    "min_replicas": self._autoscale.min_replicas,
                    "max_replicas": self._autoscale.max_replicas,
                    "previous": [before.min_replicas, before.max_replicas],
                }
            )
        assert req.replicas is not None  # _scale_request refuses a fixed pool's bounds
        previous, self._replicas = self._replicas, req.replicas
        return self._remember({"replicas": req.replicas, "previous": previous})

    @scale.validator
    def _validate_scale(self, request: Any = None, *extra: Any) -> None:
        if self._checkable(ScaleRequest, request, "scale", extra):
            self._scale_request(request, extra)

    def _scale_request(self, request: Any, extra: tuple[Any, ...]) -> ScaleRequest:
        """A `scale` request that fits the pool's mode, or a rejection naming the field."""
        req: ScaleRequest = self._request(ScaleRequest, request, "scale", extra)
        if self._autoscale is None:
            if req.replicas is None:
                raise invalid_input(
                    "invalid scale request: replicas: field required (this pool is not "
                    "autoscaled: min_replicas/max_replicas are for autoscaled pools)"
                )
            return req
        if req.replicas is not None or req.min_replicas is req.max_replicas is None:
            raise invalid_input(
                "invalid scale request: this pool is autoscaled: give min_replicas "
                "and/or max_replicas (its bounds), not replicas"
            )
        _, problem = pool_autoscale.rebound(self._autoscale, req.min_replicas, req.max_replicas)
        if problem is not None:
            raise invalid_input(f"invalid scale request: {problem}")
        return req

    @workflow.update(name="report_demand")
    async def report_demand(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """A gateway's demand (workflows/pool_autoscale.py): untrusted, rate-limited, bounded."""
        await self._taken_over()
        report = self._demand_report(request, extra)
        assert self._autoscale is not None  # _demand_report refuses a fixed pool
        self._autoscale = pool_autoscale.take(self._autoscale, report, workflow.now())
        self._dirty = True
        return self._scaling_answer()

    @report_demand.validator
    def _validate_report_demand(self, request: Any = None, *extra: Any) -> None:
        if self._checkable(pool_autoscale.Report, request, "report_demand", extra):
            self._demand_report(request, extra)

    def _demand_report(self, request: Any, extra: tuple[Any, ...]) -> pool_autoscale.Report:
        report: pool_autoscale.Report = self._request(
            pool_autoscale.Report, request, "report_demand", extra
        )
        books = self._autoscaled_books("report_demand")
        refusal = pool_autoscale.report_refusal(books, report, workflow.now())
        if refusal is not None:
            raise invalid_input(refusal)
        return report

    @workflow.update(name="wake")
    async def wake(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """A gateway holds a client and sees no member: start one, unless the pool has some."""
        await self._taken_over()
        req: pool_autoscale.WakeRequest = self._request(
            pool_autoscale.WakeRequest, request, "wake", extra
        )
        books = self._autoscaled_books("wake")
        decision = pool_autoscale.wake(books, self._replicas, req.gateway, workflow.now())
        if decision.changed:
            self._take_decision(decision)
            self._dirty = True
        return {**self._scaling_answer(), "woken": decision.changed}

    @wake.validator
    def _validate_wake(self, request: Any = None, *extra: Any) -> None:
        if self._checkable(pool_autoscale.WakeRequest, request, "wake", extra):
            self._request(pool_autoscale.WakeRequest, request, "wake", extra)
            self._autoscaled_books("wake")

    def _autoscaled_books(self, what: str) -> pool_autoscale.Books:
        if self._autoscale is None:
            raise ApplicationError(
                f"{what}: this pool is not autoscaled (no `autoscale` in its input)",
                type=pool_autoscale.NOT_AUTOSCALED,
                non_retryable=True,
            )
        return self._autoscale

    def _scaling_answer(self) -> dict[str, Any]:
        """What a gateway learns from a report or a wake: the pool's size and cost."""
        return {
            "replicas": self._replicas,
            "member_seconds": pool_autoscale.counted(
                self._usage, self._usage.members, workflow.now()
            ).member_seconds,
        }

    @workflow.update(name="rotate")
    @_applied_once
    def rotate(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """Queue members for a rolling, make-before-break rotation; returns the queued."""
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
        if not self._checkable(RotateRequest, request, "rotate", extra):
            return
        req = self._request(RotateRequest, request, "rotate", extra)
        if req.member is not None:
            self._live_member(req.member)

    @workflow.update(name="report_ban")
    @_applied_once
    def report_ban(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """Take a member out of `endpoints` now and rotate it; rate-limited per pool."""
        req, member = self._ban_request(request, extra)
        if member.ban_changes_nothing(req.endpoint):
            return {"member": member.member, "banned": False, "already": True}
        assert self._inp is not None  # set before the takeover this handler waited for
        now = workflow.now()
        self._bans = [*pool_plan.recent_bans(self._bans, self._inp.bans, now), now.isoformat()]
        member.ban(req.reason or "reported banned")
        self._dirty = True
        return self._remember({"member": member.member, "banned": True, "already": False})

    @report_ban.validator
    def _validate_report_ban(self, request: Any = None, *extra: Any) -> None:
        if not self._checkable(BanRequest, request, "report_ban", extra):
            return
        req, member = self._ban_request(request, extra)
        if member.ban_changes_nothing(req.endpoint):
            return  # idempotent: accepted, changes nothing
        if not pool_plan.is_serving(member):
            raise invalid_input(f"member: {req.member} is not serving (state {member.state})")
        assert self._inp is not None
        refusal = pool_plan.ban_refusal(self._bans, self._inp.bans, self._replicas, workflow.now())
        if refusal is not None:
            raise invalid_input(refusal)

    def _ban_request(self, request: Any, extra: tuple[Any, ...]) -> tuple[BanRequest, Member]:
        """A `report_ban` request and the live member it names, or a rejection naming the field."""
        req: BanRequest = self._request(BanRequest, request, "report_ban", extra)
        return req, self._live_member(req.member)

    # ---- validation -----------------------------------------------------------------

    async def _validated(
        self, raw: Any, argument_problems: list[str], *, continued: bool
    ) -> PoolInput:
        inp, problems = parse_model(
            PoolInput, raw, "with at least 'template' and 'replicas' (or 'autoscale')"
        )
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

    async def _taken_over(self) -> None:
        """An update waits until the run has its state, to be checked and applied against it.

        The SDK runs a workflow task's updates before it starts the run
        method, so an update sent as the pool continues as new reaches the
        new run before it has taken over its members, its size and the ids
        of the updates it applied (workflows/early_signals.py). A run that
        has its state does not wait, so the handler completes in the
        workflow task that delivered it, as before.
        """
        if not self._early.taken_over:
            await workflow.wait_condition(lambda: self._early.taken_over)

    def _checkable(self, model: Any, raw: Any, what: str, extra: tuple[Any, ...]) -> bool:
        """Whether a validator can check an update against the pool's state now.

        Not before the run has its state: only the request's shape is
        checked then, and the handler checks the rest once it has waited
        for the takeover (`_taken_over`). Not for a retry of an update
        applied in an earlier run either: that gets its first result again.
        """
        if not self._early.taken_over:
            self._request(model, raw, what, extra)
            return False
        return self._applied() is None

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
        if self._terminate_reason is not None:
            raise invalid_input(
                f"{what}: the pool is {pool_plan.pool_state(self._situation())}, not taking updates"
            )
        return _parsed(model, raw, what, extra)

    def _live_member(self, member_id: str) -> Member:
        member = self._members.get(member_id)
        if member is None or member.phase is MemberPhase.REMOVING:
            known = ", ".join(m.member for m in self._live()) or "none"
            raise invalid_input(f"member: no member {member_id!r} in this pool (members: {known})")
        return member

    # ---- one step: the plan applied ----------------------------------------------

    def _room(self) -> int:
        """The removals and rotations this run's events left hold (`pool_plan.command_batch`)."""
        left = POOL_EVENT_BUDGET - workflow.info().get_current_history_length()
        return max(0, left // EVENTS_PER_COMMAND)

    def _situation(self, room: int | None = None) -> Situation:
        return Situation(
            replicas=self._replicas,
            members=tuple(self._ordered()),
            next_index=self._next_index,
            failures_in_a_row=self._failures_in_a_row,
            stopped=self._stopped,
            start_after=self._start_after,
            last_reconcile=self._last_reconcile,
            reconciling=self._reconciling,
            ending=self._terminate_reason is not None,
            vacancies=tuple(self._vacancies),
            room=room,
        )

    def _autoscale_step(self) -> None:
        """An autoscaled pool's size for this step; a scale-down picks its members itself."""
        assert self._inp is not None
        bounds = self._inp.autoscale
        if bounds is None or self._autoscale is None or self._terminate_reason is not None:
            return
        self._take_decision(
            pool_autoscale.decide(self._autoscale, bounds, self._replicas, workflow.now())
        )

    def _take_decision(self, decision: pool_autoscale.Decision) -> None:
        assert self._inp is not None
        self._autoscale, self._scaling_why = decision.books, decision.reason
        self._replicas = decision.replicas
        if decision.changed:
            workflow.logger.info("autoscale: %s", decision.reason)
        # Banned, not serving, then the youngest go first (pool_plan would
        # remove the oldest): the plan then finds the pool at size.
        excess = len(self._live()) - self._replicas
        drain = pool_plan.drain_seconds(self._inp)
        for victim in pool_autoscale.victims(self._live(), excess):
            victim.remove(SCALED_DOWN, drain)
            self._spawn(self._drain_then_terminate(victim.member, SCALED_DOWN, drain))

    def _next_wake(self, counted: pool_plan.Census | None = None) -> Wake | None:
        """The plan's next wake, or an autoscale decision falling due, whichever is first."""
        wake = pool_plan.next_wake(self._situation(), self._inp, counted)
        bounds = self._inp.autoscale if self._inp is not None else None
        if bounds is None or self._autoscale is None:
            return wake
        due = pool_autoscale.next_wake(self._autoscale, bounds)
        if due is not None and (wake is None or due < wake.at):
            return Wake(due, "autoscale: a decision falls due")
        return wake

    def _apply(self, step: Step) -> None:
        """The plan's members and books, then its commands, each in a task of its own, in order."""
        self._keep(step.members)
        self._next_index = step.next_index
        self._start_after = step.start_after
        self._vacancies = list(step.vacancies)
        if step.abandoned:
            self._rotations_abandoned += len(step.abandoned)
            self._last_error = (
                f"rotation abandoned, not Ready within the deadline: {', '.join(step.abandoned)}"
            )[:MAX_ERROR_LENGTH]
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

    def _refresh_monitor(self) -> datetime | None:
        """Have the pool's monitor watch every member at its confirmed endpoint."""
        if self._monitor is None or self._inp is None:
            return None
        watched = [(m.member, m.provider, m.verified) for m in self._members.values() if m.verified]
        return self._monitor.refresh(watched, self._inp.template.health, workflow.now())

    def _tell_failing(self, failing: FailingMember) -> None:
        """The monitor found a member's endpoint failing: the member checks it, and acts."""
        member = self._members.get(failing.member)
        if member is None or member.verified != failing.endpoint:
            return  # moved on since the monitor started
        reason = {"endpoint": failing.endpoint, "reason": f"pool monitor: {failing.detail}"}
        self._spawn(self._signal(failing.member, INSTANCE_FAILING_SIGNAL, reason))

    def _wake_up(self) -> None:
        self._dirty = True

    def _verify_endpoints(self) -> None:
        """Ask the provider about every reported endpoint not yet confirmed, once at a time."""
        now = workflow.now()
        for member_id in sorted(self._unverified - self._verifying):
            if len(self._verifying) >= pool_plan.COMMAND_BATCH:
                break  # the rest when these answer
            member = self._members.get(member_id)
            if member is None or member.state != ProxyState.READY or not member.endpoint:
                self._unverified.discard(member_id)
                self._verify_after.pop(member_id, None)
                continue
            if self._verify_after.get(member_id, now) > now:
                continue  # waiting out a quota: `_verify_wake` steps then
            self._verify_after.pop(member_id, None)
            self._verifying.add(member_id)
            self._spawn(self._verify(member, member.endpoint))

    def _verify_wake(self) -> Wake | None:
        """When the first check waiting out a quota is due again, if any is."""
        due = [at for member, at in self._verify_after.items() if member in self._unverified]
        return Wake(min(due), "check an endpoint again after a quota") if due else None

    async def _verify(self, member: Member, claimed: str) -> None:
        try:
            check: EndpointCheck = await workflow.execute_activity_method(
                ProviderActivities.verify_endpoint,
                VerifyEndpointInput(
                    member.provider,
                    member.member,
                    claimed,
                    self._echo_url(),
                    generation=member.generation,
                    placement=dict(member.placement),
                ),
                summary=f"verify {member.member} at {claimed}",
                task_queue=self._members_queue,
                start_to_close_timeout=policies.VERIFY.start_to_close,
                schedule_to_close_timeout=policies.VERIFY.schedule_to_close,
                retry_policy=policies.TRANSIENT_RETRY,
            )
        except FailureError as err:
            self._last_error = f"could not verify {member.member}'s endpoint: {err}"
            cause = err.cause
            if (
                isinstance(cause, ApplicationError)
                and cause.type == ErrorType.QUOTA_EXCEEDED
                and taken(VERIFY_WAITS_OUT_QUOTA)
            ):
                # A quota or rate limit passes: still unverified, asked again
                # once its delay is over (the provider's hint, else minutes).
                delay = cause.next_retry_delay or QUOTA_RETRY_DELAY
                self._verify_after[member.member] = workflow.now() + delay
            elif isinstance(cause, ApplicationError) and (
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
            current.verified, current.exit_address = claimed, check.exit_address
            if check.exit_problem:
                self._last_exit_problem = f"{member.member}: {check.exit_problem}"
        else:
            self._reject(check.problem)

    def _echo_url(self) -> str:
        """Where the exit check asks, "" for none (activities/exit_echo.py)."""
        return (self._inp.exit_echo_url if self._inp is not None else None) or ""

    def _reject(self, problem: str) -> None:
        """Count a refused member report (in `status` and the worker's metrics), keep the
        latest reason, and log it."""
        self._rejected_reports += 1
        self._last_rejected = problem[:MAX_ERROR_LENGTH]
        workflow.logger.warning("member report refused: %s", self._last_rejected)
        # The SDK counts nothing while a task replays: each refusal once.
        workflow.metric_meter().create_counter(REPORTS_REFUSED_METRIC, REPORTS_REFUSED_HELP).add(1)

    async def _drain_then_terminate(self, member: str, reason: str, drain: int) -> None:
        if drain:
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
        # A member the pool monitors runs no monitor of its own.
        body = start.body if self._monitor is None else {**start.body, "monitor": "pool"}
        try:
            self._children[member] = await workflow.start_child_workflow(
                PROXY_LIFECYCLE,
                body,
                id=member,
                task_queue=self._members_queue or workflow.info().task_queue,
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
        label = pool_view.signal_label(name, member, payload.get("reason", ""))
        try:
            # The label names the member and the cause in the pool's history.
            await handle.signal(
                name, payload, event_groups=[workflow.create_event_group(member, label=label)]
            )
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
                task_queue=self._members_queue,
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

    async def _end_members(self, hand_over: Callable[[], NoReturn] | None = None) -> None:
        """Terminate every member and wait until each has ended (its instance deleted).

        `hand_over` continues as new: a run past its budget stops telling
        members, waits until those told have ended, so no report of theirs
        can cross the handover (the server would refuse it and the worker
        replay the run), and hands the rest to the next run. A cancelled
        pool has none, and ends in its run.
        """
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.cancel()  # waited for below, while the members end
        self._publish()
        await workflow.wait_condition(lambda: not self._starting)
        reason = self._terminate_reason or "pool ending"
        members = list(self._members.values())
        if hand_over is not None:
            # Those still on their way to a report (starting, rotating) are
            # told first, so a handover waits for them as for the others told.
            members.sort(key=lambda m: m.served and m.phase is not MemberPhase.ROTATING)
        told = 0
        for member in members:
            # Not before a first batch: a pool told to end on a long run
            # starts ending at once, and the monitor's shards end meanwhile.
            if hand_over is not None and told and self._time_to_continue():
                await self._until_ended(lambda: any(map(_is_removing, self._members.values())))
                # A member this run started closes as an event of it too,
                # after its last report.
                await workflow.wait_condition(self._children_closed)
                await workflow.wait_condition(lambda: not self._tasks)
                if monitor is not None:
                    # A shard's cancellation landing would cross it too.
                    await monitor.stop()
                await workflow.wait_condition(workflow.all_handlers_finished)
                hand_over()
            # A batch of signals per workflow task, not a thousand at once.
            await workflow.wait_condition(lambda: len(self._tasks) < pool_plan.COMMAND_BATCH)
            if member.phase is not MemberPhase.REMOVING and member.member in self._members:
                member.remove(reason)
                self._feed.touch()  # out of `endpoints` now, not at the last batch
                self._spawn(self._drain_then_terminate(member.member, reason, 0))
                told += 1
        self._publish()
        await self._until_ended(lambda: bool(self._members))
        if self._alarm is not None:
            self._alarm.cancel()
        await workflow.wait_condition(lambda: not self._tasks)
        if monitor is not None:
            await monitor.stop()  # its shards end within a heartbeat, mostly long before
        self._publish(PoolState.TERMINATED)

    def _children_closed(self) -> bool:
        """Every member this run started and no longer has has closed."""
        return all(h.done() for m, h in self._children.items() if m not in self._members)

    async def _until_ended(self, ending: Callable[[], bool]) -> None:
        """Wait while `ending` (members told to end still there), reconciling now and then
        in case one closed without a report."""
        while ending():
            self._arm(Wake(workflow.now() + RECONCILE_BUSY, "check on the members still ending"))
            self._dirty = False
            await workflow.wait_condition(lambda: self._dirty or not ending())
            if ending() and (
                self._last_reconcile is None
                or workflow.now() - self._last_reconcile >= RECONCILE_BUSY
            ):
                self._last_reconcile = workflow.now()
                await self._reconcile()
            self._publish()

    def _compact_carry(self, inp: PoolInput) -> pool_carried.CompactCarried:
        lifetime = inp.template.max_lifetime_seconds
        lifetimes = None if lifetime is None else Lifetimes(lifetime, inp.lifetime_jitter)
        return pool_carried.encode(self._carry(), workflow.info().workflow_id, lifetimes)

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
            autoscale=self._autoscale,
            usage=self._usage,
            rotations_abandoned=self._rotations_abandoned,
        )

    def _restore(self, carried: PoolCarried) -> None:
        self._replicas = carried.replicas
        self._keep(carried.members)
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
        self._autoscale = carried.autoscale
        self._usage = carried.usage
        self._rotations_abandoned = carried.rotations_abandoned

    # ---- views ----------------------------------------------------------------------

    def _ordered(self) -> list[Member]:
        # `_members` is kept in index order (`_keep`): read after every step, not sorted.
        return list(self._members.values())

    def _live(self) -> list[Member]:
        """Members the pool keeps: not told to terminate."""
        return pool_plan.live(self._situation())

    def _keep(self, members: Iterable[Member]) -> None:
        """The members from now on, in index order (the order every view and plan reads)."""
        self._members = {m.member: m for m in sorted(members, key=attrgetter("index"))}

    def _serving(self) -> list[Member]:
        return [m for m in self._live() if pool_plan.is_serving(m)]

    def _publish(
        self, state: PoolState | None = None, counted: pool_plan.Census | None = None
    ) -> None:
        """ProxyState on the pool, the member table in the Web UI's current details and
        (as the task waits) the digest of `endpoints` in the memo; `counted`: the
        members' census, if taken already."""
        self._feed.touch()
        situation = self._situation()
        counted = counted or pool_plan.census(situation.members)
        state = state or pool_plan.pool_state(situation, counted)
        details = pool_view.current_details(
            state,
            self._replicas,
            counted.serving,
            situation.members,
            pool_plan.waiting_for(situation, counted),
            self._last_error,
        )
        if self._published is None or state != self._published[0]:
            workflow.upsert_search_attributes([STATE.value_set(state)])
        if self._published is None or details != self._published[1]:
            workflow.set_current_details(details)
        self._published = (state, details)


def _is_removing(member: Member) -> bool:
    return member.phase is MemberPhase.REMOVING


def _status_request(request: Any, extra: tuple[Any, ...]) -> StatusRequest:
    """The page `status` is asked for (none: the first), or a refusal naming every bad field.

    A query that raises fails that query alone, never the pool.
    """
    if request is None and not extra:
        return StatusRequest()
    page: StatusRequest = _parsed(StatusRequest, request, "status", extra)
    return page


def _parsed(model: Any, raw: Any, what: str, extra: tuple[Any, ...]) -> Any:
    """`raw` as `model`, or InvalidInput naming every bad field and extra argument."""
    req, problems = parse_model(model, raw, f"(the {what} request)")
    problems += [f"argument {i}: unexpected extra argument" for i, _ in enumerate(extra, 2)]
    if problems or req is None:
        raise invalid_input(f"invalid {what} request: " + "; ".join(problems))
    return req


def _update_key() -> str:
    """A fixed-size key for the current update's id (a client's string, of any length)."""
    info = workflow.current_update_info()
    assert info is not None, "called from an update's handler or validator only"
    return hashlib.sha256(info.id.encode()).hexdigest()[:32]


def _members_queue() -> str | None:
    """The task queue for this run's members and activities; None for its own.

    A pool on "<queue>-pools" runs them on "<queue>" (contract.members_task_queue).
    """
    own = workflow.info().task_queue
    members = members_task_queue(own)
    return None if members == own else members
