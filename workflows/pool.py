"""ProxyPool: N ProxyLifecycle members kept Ready as one durable workflow.

Each member is a child workflow `<pool id>/<n>` with the search attribute
`ProxyPool=<pool id>`, started with parent-close policy ABANDON so it lives
on across the pool's continue-as-new (and, after a hard terminate of the
pool, until OrphanGC ends it). Members keep their own histories; the pool
keeps a summary of each, fed by the `member_changed` signal every member
sends its pool on a change (workflows/membership.py), plus a reconcile
against visibility now and then as a safety net (activities/pool.py).

`run` is a loop of three parts. Plan: each time the pool wakes (a report, an
update, its alarm) it hands `pool_plan.plan` a `Situation` (its members, size
and backoff, from its record) and gets a `Step` back. Act: it turns the step into commands, in the
order given (terminate signals after a drain, child starts, rotate signals,
the reconcile), each in a task of its own (workflows/pool_commands.py), and
checks the endpoints members report (workflows/pool_verify.py). Wait: it
sets its alarm for the earliest thing it must do on its own
(workflows/pool_alarm.py) and waits for that or a change. Each member's
place in the pool is a `MemberPhase` (active, queued, rotating, removing);
reports, updates and the plan move it from one to the next. What a person
reads of it in the Web UI is written by workflows/pool_view.py.

A run continues as new past its event budget (workflows/pool_budget.py),
handing its record (workflows/pool_record.py) to the next; a pool told to
terminate ends its members first (workflows/pool_ending.py), across runs if
need be.

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
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import attrgetter
from typing import Any, NoReturn

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    # The modules whose types the pool's activities return, in the sandbox's
    # modules too (`SANDBOXED`, as the replay test runs it): the SDK resolves
    # a result's annotations there, and the pool's own modules, passed
    # through, leave none of their imports in it.
    import activities.pool  # noqa: F401
    from activities.errors import invalid_input
    from activities.models import FailingMember
    from contract import (
        INSTANCE_FAILING_SIGNAL,
        MEMBER_CHANGED_SIGNAL,
        POOL,
        PROXY_POOL,
        ROTATE_SIGNAL,
        STATE,
        TERMINATE_SIGNAL,
        PoolState,
        ProxyState,
        members_task_queue,
    )
    from workflows import (
        pool_autoscale,
        pool_carried,
        pool_feed,
        pool_plan,
        pool_requests,
        pool_status,
        pool_view,
    )
    from workflows.early_signals import EarlySignals
    from workflows.inputs import continued_state, signal_reason
    from workflows.membership import MAX_ERROR_LENGTH, parse_report
    from workflows.patches import POOL_FLOOR, PUBLISH_ENDPOINTS_DIGEST, keep_floor, taken
    from workflows.pool_alarm import Alarm
    from workflows.pool_budget import EventBudget, Reading
    from workflows.pool_carried import Lifetimes, PoolCarried
    from workflows.pool_commands import Commands
    from workflows.pool_ending import Ending
    from workflows.pool_input import BanRequest, PoolInput, RotateRequest, ScaleRequest
    from workflows.pool_monitor import PoolMonitor
    from workflows.pool_plan import (
        ENDED,
        Member,
        MemberPhase,
        Situation,
        Step,
        Wake,
    )
    from workflows.pool_record import PoolRecord
    from workflows.pool_requests import status_request
    from workflows.pool_scaling import Scaling
    from workflows.pool_status import PoolStatus
    from workflows.pool_verify import EndpointChecks

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
    what `AppliedUpdates.remember` kept; only a new update reaches `handler`.
    The same steps in the same order for `scale`, `rotate` and `report_ban`,
    so one place.
    """

    @functools.wraps(handler)
    async def once(pool: ProxyPool, request: Any = None, *extra: Any) -> dict[str, Any]:
        await pool._taken_over()
        applied = pool._record.applied_updates.result()
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
        # What a run hands to the next (pool_record.py); the rest is the run's own.
        self._record = PoolRecord()
        self._published: tuple[str, str] | None = None
        self._early = EarlySignals()
        # The members' monitor, from the run's start until the pool ends.
        self._monitor: PoolMonitor | None = None
        # The digest of `endpoints` in the memo, for gateways (workflows/pool_feed.py).
        self._feed = pool_feed.EndpointsFeed()
        self._alarm = Alarm()
        self._budget = EventBudget()
        self._commands = Commands(
            record=lambda: self._record,
            ended=self._alarm.note_change,
            monitored=lambda: self._monitor is not None,
            member_closed=self._ended,
        )
        self._checks = EndpointChecks(
            members=lambda: self._record.members,
            commands=self._commands,
            failed=self._failed,
            refuse=self._reject,
        )
        self._scaling = Scaling(record=lambda: self._record, commands=self._commands)
        self._ending = Ending(
            members=lambda: self._record.members,
            commands=self._commands,
            alarm=self._alarm,
            budget=self._budget,
            publish=self._publish,
            tell_to_end=self._tell_to_end,
        )

    # ---- the run: plan, act, wait ---------------------------------------------------

    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> PoolResult:
        inp = await self._take_over(raw, carried, extra)
        try:
            while self._record.terminate_reason is None:
                self._alarm.changed = False
                budget = self._budget.read(workflow.now())
                # Plan and act: nothing new while holding to continue as new.
                step = self._plan_and_act(inp, budget)
                refresh_at = self._refresh_monitor()
                self._record.usage.members = len(self._record.members)
                counted = None if step is None else step.census
                self._publish(counted=counted)
                # Continue as new, past the budget and once quiet.
                if budget.spent and await self._continue_as_new_when_quiet(raw, budget):
                    counted = None  # reports may have come in the wait
                # Wait for a change, or the alarm.
                self._alarm.set(self._next_wake(budget, step, counted, refresh_at))
                await workflow.wait_condition(
                    functools.partial(self._step_due, watch_budget=not budget.spent)
                )
        except asyncio.CancelledError:
            self._record.terminate_reason = self._record.terminate_reason or "pool cancelled"
            await self._end_members()
            raise
        await self._end_members(continue_as_new=lambda: self._continue_as_new(raw))
        return PoolResult(
            PoolState.TERMINATED, self._record.terminate_reason, self._record.next_index
        )

    # ---- the loop's parts: take over, plan and act, continue as new, wait -----------

    async def _take_over(self, raw: Any, carried: Any, extra: tuple[Any, ...]) -> PoolInput:
        """The run's input, checked, and the state its previous run carried, taken over."""
        # Where 0.3.10's runs recorded their release marker: before the first
        # await, as the input check's local activity resolves in another
        # activation on replay than when first run.
        keep_floor(POOL_FLOOR)
        members_queue = _members_queue()
        self._monitor = PoolMonitor(self._tell_failing, self._alarm.note_change, members_queue)
        feed = taken(PUBLISH_ENDPOINTS_DIGEST)
        # Untyped, so no argument can fail to decode outside our validation.
        pool_id = workflow.info().workflow_id
        state, argument_problems = continued_state(
            PoolCarried, carried, extra, lambda raw: pool_carried.decode(raw, pool_id)
        )
        self._early.decide(continued=state is not None)
        inp = await self._validated(raw, argument_problems, continued=state is not None)
        self._inp = inp
        self._commands.task_queue = self._checks.task_queue = members_queue
        self._checks.echo_url = inp.exit_echo_url or ""
        self._scaling.bounds, self._scaling.drain = inp.autoscale, pool_plan.drain_seconds(inp)
        if state is not None:
            self._record = PoolRecord.taken_over(state)
            # Carried unconfirmed, or a check cut short by continue-as-new: asked again.
            self._checks.ask_again(state.members)
        else:
            self._record.replicas = inp.replicas
            self._record.last_reconcile = workflow.now()
        self._early.took_over()
        self._feed.start(feed, self.endpoints)
        if inp.autoscale is not None and self._record.autoscale is None:
            self._record.autoscale = pool_autoscale.new_books(inp.autoscale)
        workflow.upsert_search_attributes([POOL.value_set(pool_id)])
        return inp

    def _plan_and_act(self, inp: PoolInput, budget: Reading) -> Step | None:
        """Plan over the members, apply the plan, and check the endpoints newly reported;
        none while the run holds new commands back (the usage is counted all the same)."""
        self._record.usage = pool_autoscale.counted(
            self._record.usage, len(self._record.members), workflow.now()
        )
        if budget.holding:
            return None
        self._scaling.step(workflow.now())
        situation = self._situation(headroom=self._budget.headroom())
        step = pool_plan.plan(situation, inp, workflow.info().workflow_id, workflow.now())
        self._apply(step)
        self._checks.start()
        return step

    async def _continue_as_new_when_quiet(self, raw: Any, budget: Reading) -> bool:
        """Continue as new, the budget spent, once no command is in flight and (holding)
        no member is on its way to a report; whether the pool waited for its handlers.

        Members just started or rotating report within seconds: a continue-as-new
        they cross would be refused (UnhandledCommand).
        """
        reports_due = budget.holding and not pool_plan.settled(self._situation())
        if not self._commands.idle or reports_due:
            return False
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._record.terminate_reason is None and self._commands.idle:
            if self._monitor is not None:
                # The next run starts its own; these end quietly within a
                # round or two, when they ask whether this run is still open
                # (activities/provider.py).
                self._monitor.cancel()
            self._continue_as_new(raw)
        return True

    def _continue_as_new(self, raw: Any) -> NoReturn:
        assert self._inp is not None
        workflow.continue_as_new(
            args=[raw, self._compact_carry(self._inp)], memo=self._feed.carried()
        )

    def _next_wake(
        self,
        budget: Reading,
        step: Step | None,
        counted: pool_plan.Census | None,
        refresh_at: datetime | None,
    ) -> Wake | None:
        """The earliest thing the pool must do on its own: the hold's end, the next batch,
        or the first of the plan's wake, an autoscale decision, an endpoint check after a
        quota and a refresh of the monitor (the earlier listed on a tie)."""
        if budget.holding:
            hold_ends = self._budget.hold_ends()
            assert hold_ends is not None
            return Wake(hold_ends, "stop waiting to continue as new")
        if step is not None and step.more:
            return Wake(workflow.now(), "start the next batch of removals and rotations")
        wakes = [
            pool_plan.next_wake(self._situation(), self._inp, counted),
            self._scaling.next_wake(),
            self._checks.next_wake(),
            None if refresh_at is None else Wake(refresh_at, "refresh the members' monitor"),
        ]
        return min((w for w in wakes if w is not None), key=attrgetter("at"), default=None)

    def _step_due(self, *, watch_budget: bool) -> bool:
        """Whether to step again: something changed, the pool is ending, or (watching
        the budget, until it is passed) its run has just grown past it: events it
        ignores (reports of members it does not have, which anyone may send) grow it too."""
        return (
            self._alarm.changed
            or self._record.terminate_reason is not None
            or (watch_budget and self._budget.spent())
        )

    # ---- signals, queries, updates --------------------------------------------------

    @workflow.signal(name=TERMINATE_SIGNAL)
    def terminate(self, request: Any = None, *_extra: Any) -> None:
        """Terminate every member (each deletes its instance), then complete.

        Input optional: `{"reason": "..."}`, or just the reason as a string.
        """
        self._record.terminate_reason = signal_reason(request, "terminate signal")
        self._early.hold(lambda: self.terminate(request))

    @workflow.signal(name=MEMBER_CHANGED_SIGNAL)
    def member_changed(self, raw: Any = None, *_extra: Any) -> None:
        """A member's report of its new state (sent by ProxyLifecycle, never by hand).

        Anyone who may signal in the namespace can send one, so it is checked
        and capped (workflows/membership.py), never raises, and its endpoint
        is used only once the member's provider confirms it
        (workflows/pool_verify.py). Refused reports are counted in `status`.
        """
        self._early.hold(lambda: self.member_changed(raw))
        report, problem = parse_report(raw)
        if report is None:
            self._reject(f"malformed report: {problem}")
            return
        if datetime.fromisoformat(report.at) > workflow.now() + MAX_REPORT_SKEW:
            self._reject(f"report for {report.member[:100]!r} stamped in the future ({report.at})")
            return
        member = self._record.members.get(report.member)
        if member is None or not report.newer_than(member.report_at, member.report_seq):
            return  # a member already forgotten, or a report overtaken by a later one
        if member.take(report):
            self._record.failures_in_a_row = 0  # a new member works: the budget is whole again
        if report.state in ENDED:
            self._ended(member, report.state, report.last_error)
        elif report.state == ProxyState.READY and report.endpoint != member.verified:
            self._checks.reported(member.member)
        self._alarm.note_change()

    @workflow.query(name="status")
    def status(self, request: Any = None, *extra: Any) -> PoolStatus:
        """The pool, and a page of its members (workflows/pool_status.py).

        Argument optional: `{"after": <member index>, "limit": <n>}`; the
        answer's `next_page` is the argument for the next page.
        """
        return pool_status.answer(
            self._record,
            self._situation(),
            self._inp,
            status_request(request, extra),
            scaling_why=self._scaling.why,
            last_exit_problem=self._checks.last_exit_problem,
            monitored=0 if self._monitor is None else self._monitor.watched,
            now=workflow.now(),
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
        self._record.stopped = None
        self._record.failures_in_a_row = 0
        self._record.start_after = None
        self._alarm.note_change()
        if self._record.autoscale is not None:
            before = self._record.autoscale
            self._record.autoscale, _ = pool_autoscale.rebound(
                before, req.min_replicas, req.max_replicas
            )
            return self._record.applied_updates.remember(
                {
                    "min_replicas": self._record.autoscale.min_replicas,
                    "max_replicas": self._record.autoscale.max_replicas,
                    "previous": [before.min_replicas, before.max_replicas],
                }
            )
        assert req.replicas is not None  # _scale_request refuses a fixed pool's bounds
        previous, self._record.replicas = self._record.replicas, req.replicas
        return self._record.applied_updates.remember(
            {"replicas": req.replicas, "previous": previous}
        )

    @scale.validator
    def _validate_scale(self, request: Any = None, *extra: Any) -> None:
        if self._checkable(ScaleRequest, request, "scale", extra):
            self._scale_request(request, extra)

    def _scale_request(self, request: Any, extra: tuple[Any, ...]) -> ScaleRequest:
        """A `scale` request that fits the pool's mode, or a rejection naming the field."""
        req: ScaleRequest = self._request(ScaleRequest, request, "scale", extra)
        pool_requests.check_scale(req, self._record.autoscale)
        return req

    @workflow.update(name="report_demand")
    async def report_demand(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """A gateway's demand (workflows/pool_autoscale.py): untrusted, rate-limited, bounded."""
        await self._taken_over()
        report = self._demand_report(request, extra)
        assert self._record.autoscale is not None  # _demand_report refuses a fixed pool
        self._record.autoscale = pool_autoscale.take(self._record.autoscale, report, workflow.now())
        self._alarm.note_change()
        return self._scaling.answer(workflow.now())

    @report_demand.validator
    def _validate_report_demand(self, request: Any = None, *extra: Any) -> None:
        if self._checkable(pool_autoscale.Report, request, "report_demand", extra):
            self._demand_report(request, extra)

    def _demand_report(self, request: Any, extra: tuple[Any, ...]) -> pool_autoscale.Report:
        report: pool_autoscale.Report = self._request(
            pool_autoscale.Report, request, "report_demand", extra
        )
        autoscale = pool_requests.autoscaled(self._record.autoscale, "report_demand")
        refusal = pool_autoscale.report_refusal(autoscale, report, workflow.now())
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
        autoscale = pool_requests.autoscaled(self._record.autoscale, "wake")
        decision = pool_autoscale.wake(
            autoscale, self._record.replicas, req.gateway, workflow.now()
        )
        if decision.changed:
            self._scaling.take(decision)
            self._alarm.note_change()
        return {**self._scaling.answer(workflow.now()), "woken": decision.changed}

    @wake.validator
    def _validate_wake(self, request: Any = None, *extra: Any) -> None:
        if self._checkable(pool_autoscale.WakeRequest, request, "wake", extra):
            self._request(pool_autoscale.WakeRequest, request, "wake", extra)
            pool_requests.autoscaled(self._record.autoscale, "wake")

    @workflow.update(name="rotate")
    @_applied_once
    def rotate(self, request: Any = None, *extra: Any) -> dict[str, Any]:
        """Queue members for a rolling, make-before-break rotation; returns the queued."""
        req = self._request(RotateRequest, request, "rotate", extra)
        # All: every member that has served; one still starting is new already.
        targets = (
            [m for m in self._live() if m.served]
            if req.all
            else [self._record.members[str(req.member)]]
        )
        reason = "rotate all" if req.all else "rotate update"
        queued = [member.member for member in targets if member.queue(reason)]
        self._alarm.note_change()
        return self._record.applied_updates.remember({"queued": queued})

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
        self._record.bans = [
            *pool_plan.recent_bans(self._record.bans, self._inp.bans, now),
            now.isoformat(),
        ]
        member.ban(req.reason or "reported banned")
        self._alarm.note_change()
        return self._record.applied_updates.remember(
            {"member": member.member, "banned": True, "already": False}
        )

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
        refusal = pool_plan.ban_refusal(
            self._record.bans, self._inp.bans, self._record.replicas, workflow.now()
        )
        if refusal is not None:
            raise invalid_input(refusal)

    def _ban_request(self, request: Any, extra: tuple[Any, ...]) -> tuple[BanRequest, Member]:
        """A `report_ban` request and the live member it names, or a rejection naming the field."""
        req: BanRequest = self._request(BanRequest, request, "report_ban", extra)
        return req, self._live_member(req.member)

    # ---- requests -------------------------------------------------------------------

    async def _validated(
        self, raw: Any, argument_problems: list[str], *, continued: bool
    ) -> PoolInput:
        checked = await pool_requests.checked_input(raw, argument_problems, continued=continued)
        if isinstance(checked, str):
            self._record.last_error = checked
            raise invalid_input(checked)
        return checked

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
        return self._record.applied_updates.result() is None

    def _request(self, model: Any, raw: Any, what: str, extra: tuple[Any, ...]) -> Any:
        """An update's request, or a rejection naming every bad field (pool_requests.py);
        none once the pool is ending."""
        if self._record.terminate_reason is not None:
            raise invalid_input(
                f"{what}: the pool is {pool_plan.pool_state(self._situation())}, not taking updates"
            )
        return pool_requests.parsed(model, raw, what, extra)

    def _live_member(self, member_id: str) -> Member:
        member = self._record.members.get(member_id)
        if member is None or member.phase is MemberPhase.REMOVING:
            known = ", ".join(m.member for m in self._live()) or "none"
            raise invalid_input(f"member: no member {member_id!r} in this pool (members: {known})")
        return member

    # ---- one step: the plan applied -------------------------------------------------

    def _situation(self, headroom: int | None = None) -> Situation:
        return self._record.situation(reconciling=self._commands.reconciling, headroom=headroom)

    def _apply(self, step: Step) -> None:
        """The plan's members and record, then its commands, each in a task of its own, in order."""
        self._record.take(step)
        for removal in step.removals:
            self._commands.drain_then_terminate(removal.member, removal.reason, removal.drain)
        for start in step.starts:
            self._commands.start(start)
        for rotation in step.rotations:
            reason = {"reason": f"pool: {rotation.reason}"}
            self._commands.signal(rotation.member, ROTATE_SIGNAL, reason)
        if step.reconcile:
            self._commands.reconcile(workflow.now())

    def _refresh_monitor(self) -> datetime | None:
        """Have the pool's monitor watch every member at its confirmed endpoint."""
        if self._monitor is None or self._inp is None:
            return None
        watched = [
            (m.member, m.provider, m.verified) for m in self._record.members.values() if m.verified
        ]
        return self._monitor.refresh(watched, self._inp.template.health, workflow.now())

    def _tell_failing(self, failing: FailingMember) -> None:
        """The monitor found a member's endpoint failing: the member checks it, and acts."""
        member = self._record.members.get(failing.member)
        if member is None or member.verified != failing.endpoint:
            return  # moved on since the monitor started
        reason = {"endpoint": failing.endpoint, "reason": f"pool monitor: {failing.detail}"}
        self._commands.signal(failing.member, INSTANCE_FAILING_SIGNAL, reason)

    def _failed(self, error: str) -> None:
        """What went wrong last, for `status` and the Web UI."""
        self._record.last_error = error

    def _reject(self, problem: str) -> None:
        """Count a refused member report (in `status` and the worker's metrics), keep the
        latest reason, and log it."""
        self._record.rejected_reports += 1
        self._record.last_rejected = problem[:MAX_ERROR_LENGTH]
        workflow.logger.warning("member report refused: %s", self._record.last_rejected)
        # The SDK counts nothing while a task replays: each refusal once.
        workflow.metric_meter().create_counter(REPORTS_REFUSED_METRIC, REPORTS_REFUSED_HELP).add(1)

    def _ended(self, member: Member, state: str, error: str | None) -> None:
        """A member closed: forget it; replace it unless the pool asked for its end."""
        assert self._inp is not None
        self._record.ended(member, state, error, self._inp.failure_budget, workflow.now())

    # ---- ending (pool_ending.py) ----------------------------------------------------

    async def _end_members(self, continue_as_new: Callable[[], NoReturn] | None = None) -> None:
        """Terminate every member and wait until each has ended; `continue_as_new` once
        the run is past its budget (a cancelled pool has none)."""
        monitor, self._monitor = self._monitor, None
        await self._ending.end(
            lambda: self._record.terminate_reason or "pool ending", monitor, continue_as_new
        )

    def _tell_to_end(self, member: Member, reason: str) -> None:
        """Tell a member to terminate, out of `endpoints` now, not at the last batch."""
        member.remove(reason)
        self._feed.touch()
        self._commands.drain_then_terminate(member.member, reason, 0)

    # ---- continue-as-new ------------------------------------------------------------

    def _compact_carry(self, inp: PoolInput) -> pool_carried.CompactCarried:
        lifetime = inp.template.max_lifetime_seconds
        lifetimes = None if lifetime is None else Lifetimes(lifetime, inp.lifetime_jitter)
        carried = self._record.carried(inp.bans, workflow.now())
        return pool_carried.encode(carried, workflow.info().workflow_id, lifetimes)

    # ---- views ----------------------------------------------------------------------

    def _live(self) -> list[Member]:
        """Members the pool keeps: not told to terminate."""
        return pool_plan.live(self._situation())

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
            self._record.replicas,
            counted.serving,
            situation.members,
            pool_plan.waiting_for(situation, counted),
            self._record.last_error,
        )
        if self._published is None or state != self._published[0]:
            workflow.upsert_search_attributes([STATE.value_set(state)])
        if self._published is None or details != self._published[1]:
            workflow.set_current_details(details)
        self._published = (state, details)


def _members_queue() -> str | None:
    """The task queue for this run's members and activities; None for its own.

    A pool on "<queue>-pools" runs them on "<queue>" (contract.members_task_queue).
    """
    own = workflow.info().task_queue
    members = members_task_queue(own)
    return None if members == own else members
