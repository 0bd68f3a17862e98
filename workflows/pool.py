"""ProxyPool: N ProxyLifecycle members kept Ready as one durable workflow.

Each member is a child workflow `<pool id>/<n>` with the search attribute
`ProxyPool=<pool id>`, started with parent-close policy ABANDON so it lives
on across the pool's continue-as-new (and, after a hard terminate of the
pool, until OrphanGC ends it). Members keep their own histories; the pool
keeps a summary of each, fed by the `member_changed` signal every member
sends its pool on a change (workflows/membership.py), plus a reconcile
against visibility now and then as a safety net (activities/pool.py).

The pool never polls a member and sets one timer at a time, for the earliest
thing it must do on its own: a member's rotation falling due, the end of a
replacement backoff, or the next reconcile. So a pool in steady state writes
history only when a member's lifetime ends.

Rotation is the pool's: member lifetimes are `template.max_lifetime_seconds`
spread by `lifetime_jitter`, and the pool rotates a member whose lifetime is
up through the member's `rotate` signal (make before break), at most
`max_surge` at a time, so members never rotate together. Bans and `rotate`
updates go through the same queue, bans first.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import FailureError, WorkflowAlreadyStartedError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.errors import invalid_input
    from activities.models import TargetCheck, ValidateTargetInput
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
    from workflows import policies
    from workflows.inputs import DEFAULT_HEALTH_TARGET, continued_state, parse_model
    from workflows.membership import MemberReport
    from workflows.policies import REPLACE_BACKOFF
    from workflows.pool_input import (
        BanRequest,
        PoolInput,
        RotateRequest,
        ScaleRequest,
        pool_id_problems,
    )

# How long a member leaving the pool (scaled down, or the old instance of a
# rotation) keeps serving after it left `endpoints`, unless the template sets
# `drain_seconds`: longer than a gateway takes to poll, debounce and reload
# (docs/architecture.md, "The gateway").
DEFAULT_MEMBER_DRAIN_SECONDS = 15
MEMBER_DRAIN_PATCH = "member-drain"
# The reconcile runs when the pool is awake anyway and this long has passed,
RECONCILE_EVERY = timedelta(minutes=10)
# and on a timer of its own after this long idle, or sooner while the pool
# waits on its members (starting, rotating, ending).
RECONCILE_IDLE = timedelta(hours=1)
RECONCILE_BUSY = timedelta(seconds=30)
# A member id missing from visibility this soon after its start is not
# suspect: visibility lags.
SETTLE = timedelta(seconds=30)
MIN_ALARM = timedelta(seconds=1)
# Member starts in flight at once: a pool of hundreds starts in batches, so
# no one workflow task carries hundreds of commands.
START_BATCH = 50
RECONCILE = policies.ActivityProfile(
    start_to_close=timedelta(seconds=30), schedule_to_close=timedelta(minutes=2)
)
ENDED = (ProxyState.TERMINATED, ProxyState.FAILED)


def jittered_lifetime(max_lifetime: float, jitter: float, index: int) -> float:
    """Member `index`'s lifetime: `max_lifetime * (1 - jitter * u)`, u spread evenly.

    u is the base-2 van der Corput sequence (0, 1/2, 1/4, 3/4, 1/8, ...): any
    run of consecutive members is spread evenly over the jitter window, and
    a member's lifetime never exceeds the template's.
    """
    u, denominator, n = 0.0, 1.0, index
    while n:
        denominator *= 2
        n, bit = divmod(n, 2)
        u += bit / denominator
    return max_lifetime * (1 - jitter * u)


@dataclass
class Member:
    """What the pool knows about one member."""

    member: str
    index: int
    provider: str
    placement: dict[str, str]
    started_at: str
    # Index into `spread`, None without one.
    spread: int | None = None
    lifetime_seconds: float | None = None
    state: str = ProxyState.PROVISIONING
    endpoint: str = ""
    generation: int = 0
    ready_since: str | None = None
    last_error: str | None = None
    report: MemberReport | None = None
    # Became Ready at least once.
    served: bool = False
    # Queued for rotation, and why.
    rotate_reason: str | None = None
    # The generation a rotation under way replaces.
    rotating_from: int | None = None
    rotating_since: str | None = None
    # Out of `endpoints` until its next generation is Ready.
    banned: str | None = None
    # Told to terminate (scale down, pool ending), and why.
    removing: str | None = None


@dataclass
class MemberStatus:
    """One member in the `status` query."""

    member: str
    state: str
    endpoint: str
    provider: str
    placement: dict[str, str]
    generation: int
    started_at: str
    ready_since: str | None
    age_seconds: float | None
    rotate_at: str | None
    rotating: bool
    banned: str | None
    removing: str | None
    last_error: str | None


@dataclass
class PoolStatus:
    """What the `status` query returns."""

    state: PoolState
    replicas: int
    ready: int
    members: list[MemberStatus]
    waiting_for: str | None
    failures_in_a_row: int
    last_error: str | None
    stopped_replacing: str | None
    terminate_reason: str | None


@dataclass(frozen=True)
class PoolEndpoint:
    """One entry of the `endpoints` query: a Ready member a client may use now."""

    member: str
    endpoint: str
    provider: str
    placement: dict[str, str]


@dataclass
class PoolCarried:
    """Everything continue-as-new hands to the next run."""

    replicas: int
    members: list[Member]
    next_index: int
    failures_in_a_row: int = 0
    last_error: str | None = None
    stopped_replacing: str | None = None
    start_after: str | None = None
    bans: list[str] = field(default_factory=list)
    last_reconcile: str | None = None
    terminate_reason: str | None = None


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
        self._dirty = True
        self._tasks: set[asyncio.Task[None]] = set()
        self._alarm: asyncio.Task[None] | None = None
        self._alarm_at: datetime | None = None
        self._reconciling = False
        # Members whose start command has not been answered yet.
        self._starting: set[str] = set()
        self._published: tuple[str, ...] = ()

    # ---- the contract: run, signals, queries, updates -------------------------------

    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> PoolResult:
        # Untyped, so no argument can fail to decode outside our validation.
        state, argument_problems = continued_state(PoolCarried, carried, extra)
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
                self._step(inp)
                self._publish()
                if workflow.info().is_continue_as_new_suggested() and not self._tasks:
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    if self._terminate_reason is None and not self._tasks:
                        workflow.continue_as_new(args=[raw, self._carry()])
                self._arm(self._next_deadline(inp))
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
        reason = request.get("reason") if isinstance(request, dict) else request
        self._terminate_reason = str(reason)[:500] if reason else "terminate signal"

    @workflow.signal(name=MEMBER_CHANGED_SIGNAL)
    def member_changed(self, report: MemberReport) -> None:
        """A member's report of its new state (sent by ProxyLifecycle, never by hand)."""
        member = self._members.get(report.member)
        if member is None or not report.newer_than(member.report):
            return
        member.report = report
        member.state = report.state
        member.endpoint = report.endpoint
        member.generation = report.generation
        member.ready_since = report.ready_since
        member.last_error = report.last_error
        if report.state == ProxyState.READY:
            if not member.served:
                member.served = True
                self._failures_in_a_row = 0  # a new member works: the budget is whole again
            if member.rotating_from is not None and report.generation > member.rotating_from:
                member.rotating_from = member.rotating_since = None
                member.banned = None
        if report.state in ENDED:
            self._ended(member, report.state, report.last_error)
        self._dirty = True

    @workflow.query(name="status")
    def status(self) -> PoolStatus:
        now = workflow.now()
        members = [self._member_status(m, now) for m in self._ordered()]
        return PoolStatus(
            state=self._state(),
            replicas=self._replicas,
            ready=len(self._serving()),
            members=members,
            waiting_for=self._waiting_for(),
            failures_in_a_row=self._failures_in_a_row,
            last_error=self._last_error,
            stopped_replacing=self._stopped,
            terminate_reason=self._terminate_reason,
        )

    @workflow.query(name="endpoints")
    def endpoints(self) -> list[PoolEndpoint]:
        """Ready members a client may use now: not banned, not being removed."""
        return [
            PoolEndpoint(m.member, m.endpoint, m.provider, m.placement) for m in self._serving()
        ]

    @workflow.update(name="scale")
    def scale(self, request: Any) -> dict[str, int]:
        """Keep `replicas` members; also resumes replacing after the failure budget ran out."""
        req = self._request(ScaleRequest, request, "scale")
        previous, self._replicas = self._replicas, req.replicas
        self._stopped = None
        self._failures_in_a_row = 0
        self._start_after = None
        self._dirty = True
        return {"replicas": req.replicas, "previous": previous}

    @scale.validator
    def _validate_scale(self, request: Any) -> None:
        self._request(ScaleRequest, request, "scale")

    @workflow.update(name="rotate")
    def rotate(self, request: Any) -> dict[str, list[str]]:
        """Queue members for a rolling, make-before-break rotation; returns the queued."""
        req = self._request(RotateRequest, request, "rotate")
        # All: every member that has served; one still starting is new already.
        targets = (
            [m for m in self._live() if m.served] if req.all else [self._members[str(req.member)]]
        )
        queued = []
        for member in targets:
            if member.rotate_reason is None and member.rotating_from is None:
                member.rotate_reason = "rotate all" if req.all else "rotate update"
                queued.append(member.member)
        self._dirty = True
        return {"queued": queued}

    @rotate.validator
    def _validate_rotate(self, request: Any) -> None:
        req = self._request(RotateRequest, request, "rotate")
        if req.member is not None:
            self._live_member(req.member)

    @workflow.update(name="report_ban")
    def report_ban(self, request: Any) -> dict[str, Any]:
        """Take a member out of `endpoints` now and rotate it; rate-limited per pool."""
        req = self._request(BanRequest, request, "report_ban")
        member = self._live_member(req.member)
        if member.banned is not None or (req.endpoint and req.endpoint != member.endpoint):
            return {"member": member.member, "banned": False, "already": True}
        self._bans.append(workflow.now().isoformat())
        member.banned = req.reason or "reported banned"
        if member.rotating_from is None:
            member.rotate_reason = f"ban: {member.banned}"
        self._dirty = True
        return {"member": member.member, "banned": True, "already": False}

    @report_ban.validator
    def _validate_report_ban(self, request: Any) -> None:
        req = self._request(BanRequest, request, "report_ban")
        member = self._live_member(req.member)
        if member.banned is not None or (req.endpoint and req.endpoint != member.endpoint):
            return  # idempotent: accepted, changes nothing
        if not self._is_serving(member):
            raise invalid_input(f"member: {req.member} is not serving (state {member.state})")
        assert self._inp is not None
        limit = self._inp.bans.limit(self._replicas)
        window = timedelta(seconds=self._inp.bans.window_seconds)
        recent = self._recent_bans(window)
        if len(recent) >= limit:
            free_at = datetime.fromisoformat(recent[0]) + window
            raise invalid_input(
                f"ban rate limit: {len(recent)} bans accepted in the last "
                f"{self._inp.bans.window_seconds}s (limit {limit}); the next is accepted "
                f"from {free_at.isoformat(timespec='seconds')}"
            )

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
            found: TargetCheck = await workflow.execute_local_activity_method(
                ProviderActivities.validate_target,
                ValidateTargetInput(
                    provider=provider,
                    port=port if isinstance(port, int) and 0 < port < 65536 else None,
                    placement=(
                        {k: str(v) for k, v in placement.items() if v is not None}
                        if isinstance(placement, dict)
                        else {}
                    ),
                    health_target=target if isinstance(target, str) else DEFAULT_HEALTH_TARGET,
                ),
                start_to_close_timeout=policies.VALIDATE.start_to_close,
                schedule_to_close_timeout=policies.VALIDATE.schedule_to_close,
                retry_policy=policies.TRANSIENT_RETRY,
            )
            problems += [
                prefix + problem for problem in found.problems if prefix + problem not in problems
            ]
        return problems

    def _request(self, model: Any, raw: Any, what: str) -> Any:
        """An update's request, or a rejection naming every bad field."""
        if self._inp is None or self._terminate_reason is not None:
            raise invalid_input(f"{what}: the pool is {self._state()}, not taking updates")
        req, problems = parse_model(model, raw, f"(the {what} request)")
        if problems or req is None:
            raise invalid_input(f"invalid {what} request: " + "; ".join(problems))
        return req

    def _live_member(self, member_id: str) -> Member:
        member = self._members.get(member_id)
        if member is None or member.removing is not None:
            known = ", ".join(m.member for m in self._live()) or "none"
            raise invalid_input(f"member: no member {member_id!r} in this pool (members: {known})")
        return member

    # ---- one step: what to do now ---------------------------------------------------

    def _step(self, inp: PoolInput) -> None:
        now = workflow.now()
        self._queue_due_rotations(now)
        self._scale(inp, now)
        self._start_rotations(inp, now)
        every = RECONCILE_EVERY if self._calm() else RECONCILE_BUSY
        if not self._reconciling and (
            self._last_reconcile is None or now - self._last_reconcile >= every
        ):
            self._reconciling = True
            self._last_reconcile = now
            self._spawn(self._reconcile())

    def _queue_due_rotations(self, now: datetime) -> None:
        for member in self._live():
            due = self._rotate_at(member)  # None while it rotates
            if due is not None and due <= now and member.rotate_reason is None:
                member.rotate_reason = "max lifetime"

    def _scale(self, inp: PoolInput, now: datetime) -> None:
        live = self._live()
        excess = len(live) - self._replicas
        if excess > 0:
            # Members not serving go first, then the oldest instances.
            victims = sorted(
                live, key=lambda m: (self._is_serving(m), m.ready_since or "", m.index)
            )
            for member in victims[:excess]:
                self._remove(member, "scaled down", drain=self._drain_seconds(inp))
            return
        if excess == 0 or self._stopped is not None:
            return
        if self._start_after is not None and now < self._start_after:
            return
        self._start_after = None
        # A bounded batch per workflow task: the next starts when these answer.
        for _ in range(min(-excess, max(0, START_BATCH - len(self._starting)))):
            self._start_member(inp, now)

    def _start_rotations(self, inp: PoolInput, now: datetime) -> None:
        rotating = [m for m in self._live() if m.rotating_from is not None]
        queued = [
            m for m in self._live() if m.rotate_reason is not None and m.rotating_from is None
        ]
        # Bans first; other rotations only while the pool is at size, so a
        # rolling rotation never eats into the members a scale-up is waiting for.
        queued.sort(key=lambda m: (m.banned is None, m.index))
        at_size = len(self._serving()) >= self._replicas
        for member in queued[: max(0, inp.max_surge - len(rotating))]:
            if member.banned is None and not at_size:
                break
            if member.state != ProxyState.READY:
                continue  # it is getting a new instance anyway
            reason = member.rotate_reason or "rotate"
            member.rotate_reason = None
            member.rotating_from = member.generation
            member.rotating_since = now.isoformat()
            self._spawn(self._signal(member, ROTATE_SIGNAL, {"reason": f"pool: {reason}"}))

    def _start_member(self, inp: PoolInput, now: datetime) -> None:
        pool_id = workflow.info().workflow_id
        index = self._next_index
        self._next_index += 1
        spread, provider, placement = self._placement(inp)
        lifetime = None
        if inp.template.max_lifetime_seconds is not None:
            lifetime = jittered_lifetime(
                inp.template.max_lifetime_seconds, inp.lifetime_jitter, index
            )
        member = Member(
            member=f"{pool_id}/{index}",
            index=index,
            provider=provider,
            placement=placement,
            started_at=now.isoformat(),
            spread=spread,
            lifetime_seconds=lifetime,
        )
        self._members[member.member] = member
        body = inp.template.model_dump(mode="json", exclude_none=True)
        body["provider"] = provider
        body["placement"] = placement
        # The pool rotates its members itself (`rotate` signal), one surge at a time.
        body.pop("max_lifetime_seconds", None)
        body["drain_seconds"] = self._drain_seconds(inp)
        self._starting.add(member.member)
        self._spawn(self._start_child(member, body))

    def _placement(self, inp: PoolInput) -> tuple[int | None, str, dict[str, str]]:
        """The spread entry furthest below its share of the live members."""
        spread = inp.spread
        if not spread:
            return None, inp.template.provider, inp.template.placement.as_dict()
        counts = [0] * len(spread)
        for member in self._live():
            if member.spread is not None and member.spread < len(counts):
                counts[member.spread] += 1
        total = sum(e.weight for e in spread)
        after = sum(counts) + 1
        best = max(
            range(len(spread)), key=lambda i: (spread[i].weight * after / total - counts[i], -i)
        )
        entry = spread[best]
        return best, entry.provider, entry.placement.as_dict()

    def _remove(self, member: Member, reason: str, *, drain: int = 0) -> None:
        """Out of `endpoints` now; terminated once gateways have had `drain` seconds to drop it."""
        member.removing = f"{reason}, draining {drain}s" if drain else reason
        member.rotate_reason = None
        member.rotating_from = member.rotating_since = None
        self._spawn(self._drain_then_terminate(member, reason, drain))

    async def _drain_then_terminate(self, member: Member, reason: str, drain: int) -> None:
        # Pools recorded before drains existed signal at once.
        if drain and workflow.patched(MEMBER_DRAIN_PATCH):
            await workflow.sleep(drain, summary=f"drain {member.member} {drain}s")
        await self._signal(member, TERMINATE_SIGNAL, {"reason": f"pool: {reason}"})

    @staticmethod
    def _drain_seconds(inp: PoolInput) -> int:
        drain = inp.template.drain_seconds
        return DEFAULT_MEMBER_DRAIN_SECONDS if drain is None else drain

    def _ended(self, member: Member, state: str, error: str | None) -> None:
        """A member closed: forget it; replace it unless the pool asked for its end."""
        self._members.pop(member.member, None)
        if member.removing is not None or self._terminate_reason is not None:
            return
        if state != ProxyState.FAILED:
            return  # ended from outside the pool (a user's terminate): replaced at once
        self._failures_in_a_row += 1
        self._last_error = f"{member.member} ended Failed: {error or 'no reason given'}"
        assert self._inp is not None
        if self._failures_in_a_row >= self._inp.failure_budget:
            self._stopped = (
                f"stopped replacing after {self._failures_in_a_row} members in a row ended "
                f"Failed (failure_budget {self._inp.failure_budget}); last: {self._last_error}. "
                "A `scale` update resumes."
            )
            return
        delay = REPLACE_BACKOFF.delay(self._failures_in_a_row - 1)
        self._start_after = workflow.now() + delay

    # ---- commands, each in a task of its own ----------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.create_task(work)
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self._dirty = True

        task.add_done_callback(done)

    async def _start_child(self, member: Member, body: dict[str, Any]) -> None:
        try:
            await workflow.start_child_workflow(
                PROXY_LIFECYCLE,
                body,
                id=member.member,
                task_queue=workflow.info().task_queue,
                # Members outlive the pool's run: continue-as-new must not end them.
                parent_close_policy=ParentClosePolicy.ABANDON,
                search_attributes=TypedSearchAttributes(
                    [SearchAttributePair(POOL, workflow.info().workflow_id)]
                ),
                static_summary=f"member of pool {workflow.info().workflow_id}",
            )
        except (WorkflowAlreadyStartedError, FailureError) as err:
            # Say, an id still used by an earlier pool of this name (the
            # reconcile ends such strays): the next member gets the next id.
            self._members.pop(member.member, None)
            self._last_error = f"could not start {member.member}: {err}"
            self._start_after = workflow.now() + REPLACE_BACKOFF.first
        finally:
            self._starting.discard(member.member)

    async def _signal(self, member: Member, name: str, payload: dict[str, str]) -> None:
        handle = workflow.get_external_workflow_handle(member.member)
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

    def _next_deadline(self, inp: PoolInput) -> datetime | None:
        deadlines = [self._rotate_at(m) for m in self._live() if m.rotate_reason is None]
        if self._start_after is not None and self._stopped is None:
            deadlines.append(self._start_after)
        if self._last_reconcile is not None and not self._reconciling:
            # (A reconcile under way wakes the pool when it ends.)
            every = RECONCILE_IDLE if self._calm() else RECONCILE_BUSY
            deadlines.append(self._last_reconcile + every)
        due = [d for d in deadlines if d is not None]
        return min(due) if due else None

    def _arm(self, deadline: datetime | None) -> None:
        """One timer for the earliest deadline; kept when still early enough."""
        if deadline is None:
            return
        if self._alarm is not None and not self._alarm.done():
            assert self._alarm_at is not None
            if self._alarm_at <= deadline:
                return
            self._alarm.cancel()
        # Past deadlines are acted on in the step that computed them; one
        # still past is retried in a second, never in a busy loop.
        delay = max(deadline - workflow.now(), MIN_ALARM)
        self._alarm_at = deadline
        self._alarm = asyncio.create_task(self._ring(delay))

    async def _ring(self, delay: timedelta) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await workflow.sleep(delay, summary="next pool action")
            self._dirty = True

    # ---- ending ---------------------------------------------------------------------

    async def _end_members(self) -> None:
        """Terminate every member and wait until each has ended (its instance deleted)."""
        self._publish()
        await workflow.wait_condition(lambda: not self._starting)
        for member in list(self._members.values()):
            if member.removing is None:
                self._remove(member, self._terminate_reason or "pool ending")
        self._publish()
        while self._members:
            self._arm(workflow.now() + RECONCILE_BUSY)
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
            bans=self._bans,
            last_reconcile=self._last_reconcile.isoformat() if self._last_reconcile else None,
            terminate_reason=self._terminate_reason,
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

    # ---- views ----------------------------------------------------------------------

    def _ordered(self) -> list[Member]:
        return sorted(self._members.values(), key=lambda m: m.index)

    def _live(self) -> list[Member]:
        """Members the pool keeps: not told to terminate."""
        return [m for m in self._ordered() if m.removing is None]

    def _serving(self) -> list[Member]:
        return [m for m in self._live() if self._is_serving(m)]

    @staticmethod
    def _is_serving(m: Member) -> bool:
        return (
            m.removing is None and m.state == ProxyState.READY and bool(m.endpoint) and not m.banned
        )

    def _calm(self) -> bool:
        """Nothing the pool waits on from its members but their lifetimes."""
        return self._terminate_reason is None and all(
            m.removing is None and m.state == ProxyState.READY for m in self._members.values()
        )

    def _rotate_at(self, member: Member) -> datetime | None:
        if member.lifetime_seconds is None or member.ready_since is None:
            return None
        if member.rotating_from is not None:
            return None
        return datetime.fromisoformat(member.ready_since) + timedelta(
            seconds=member.lifetime_seconds
        )

    def _recent_bans(self, window: timedelta) -> list[str]:
        since = workflow.now() - window
        return [at for at in self._bans if datetime.fromisoformat(at) > since]

    def _state(self) -> PoolState:
        if self._terminate_reason is not None:
            return PoolState.TERMINATING if self._members else PoolState.TERMINATED
        ready = len(self._serving())
        if ready < self._replicas and (self._failures_in_a_row or self._stopped):
            return PoolState.DEGRADED
        if ready != self._replicas or len(self._members) != self._replicas:
            return PoolState.SCALING
        return PoolState.READY

    def _waiting_for(self) -> str | None:
        if self._terminate_reason is not None:
            return f"{len(self._members)} members to end" if self._members else None
        if self._stopped:
            return self._stopped
        if self._start_after is not None:
            return (
                f"backing off until {self._start_after.isoformat(timespec='seconds')} after "
                f"{self._failures_in_a_row} failed members in a row"
            )
        parts = []
        live = self._live()
        starting = [m for m in live if m.state != ProxyState.READY]
        if starting:
            parts.append(f"{len(starting)} members to be Ready")
        removing = [m for m in self._members.values() if m.removing is not None]
        if removing:
            parts.append(f"{len(removing)} members to end")
        rotating = [m.member for m in live if m.rotating_from is not None]
        if rotating:
            parts.append("rotation of " + ", ".join(rotating))
        queued = [m for m in live if m.rotate_reason is not None]
        if queued:
            parts.append(f"{len(queued)} members queued for rotation")
        return "; ".join(parts) or None

    def _member_status(self, m: Member, now: datetime) -> MemberStatus:
        rotate_at = self._rotate_at(m)
        age = (
            (now - datetime.fromisoformat(m.ready_since)).total_seconds() if m.ready_since else None
        )
        return MemberStatus(
            member=m.member,
            state=m.state,
            endpoint=m.endpoint,
            provider=m.provider,
            placement=m.placement,
            generation=m.generation,
            started_at=m.started_at,
            ready_since=m.ready_since,
            age_seconds=age,
            rotate_at=rotate_at.isoformat(timespec="seconds") if rotate_at else None,
            rotating=m.rotating_from is not None,
            banned=m.banned,
            removing=m.removing,
            last_error=m.last_error,
        )

    def _publish(self, state: PoolState | None = None) -> None:
        """ProxyState on the pool, and the counts in the Web UI's current details."""
        state = state or self._state()
        ready = len(self._serving())
        waiting = self._waiting_for()
        lines = [f"**{state}**: {ready} of {self._replicas} Ready, {len(self._members)} members"]
        if waiting:
            lines.append(f"waiting for {waiting}")
        if self._last_error:
            lines.append(f"last error: {self._last_error}")
        if state != (self._published[0] if self._published else None):
            workflow.upsert_search_attributes([STATE.value_set(state)])
        details = tuple(lines)
        if (state, *details) != self._published:
            workflow.set_current_details("\n\n".join(lines))
            self._published = (state, *details)
