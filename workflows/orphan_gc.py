"""OrphanGC: find and delete every instance nobody owns, and never one somebody does.

Durable workflows make leaks rare, not impossible: `temporal workflow
terminate` runs no cleanup, a create can fail after the cloud made the VM, a
crash during replacement can leave an old generation behind. A Temporal
Schedule (`proxy-operator-orphan-gc`) runs this workflow every few minutes.

For each provider:

1. `gc_survey` lists the installation's instances and compares them with one
   bulk visibility query over the running lifecycles (inside the activity, so
   10,000 instances never cross a payload); instances younger than the grace
   period are kept.
2. The candidates go in batches to `gc_confirm`, which describes each owner
   directly, because visibility lags; a batch is confirmed just before it is
   deleted, so the window in which an owner could change its mind is one
   batch long.
3. Confirmed orphans are deleted through the lifecycle's own `delete_instance`
   and `wait_gone` activities, a batch at a time (bounded concurrency); one
   failure is counted and the sweep goes on.

Before step 2, a circuit breaker: when a provider's survey would delete more
than `max_delete_share` of the instances it saw there, and more than
`max_delete_unchecked` of them, nothing is deleted on that provider and the
run fails as `GcCircuitOpen` with the figures (after sweeping the others). A
worker pointed at the wrong namespace sees every instance as an orphan; this
is what keeps it from wiping the fleet.

A dry run stops after step 2 and reports the same orphans. The workflow never
reads a wall clock: ages are judged by the activities' clocks. Long sweeps
continue as new, carrying their counts, the candidates still to handle and a
cursor.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, ValidationError
from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.errors import invalid_input
    from activities.gc import (
        Candidate,
        ConfirmInput,
        Decision,
        DeletedInput,
        GcActivities,
        Survey,
        SurveyInput,
    )
    from activities.models import InstanceRef
    from activities.pool import OrphanedMembersInput, OrphanedMembersOutput, PoolActivities
    from contract import ORPHAN_GC, ErrorType
    from workflows import policies
    from workflows.deletion import delete_until_gone
    from workflows.failures import message
    from workflows.inputs import Seconds, StrictInput, continued_state, describe_error
    from workflows.patches import ORPHAN_GC_FLOOR, keep_floor

DEFAULT_GRACE_PERIOD_SECONDS = 600
MAX_GRACE_PERIOD_SECONDS = 30 * 24 * 3600
DEFAULT_MAX_DELETE_SHARE = 0.5
DEFAULT_MAX_DELETE_UNCHECKED = 10

# Candidates confirmed, then deleted concurrently, per batch: the bound on
# concurrent deletions, and on how stale a confirmation can get.
BATCH = 20
# Candidates one run handles before it continues as new (7 to 8 history
# events and a few KB each when deleted), unless the server suggests it sooner.
MAX_PER_RUN = 200
# Ids listed per provider and kind in the result; the counts are always exact.
MAX_IDS = 1000
# The Web UI's current details show this many orphans per provider.
DETAILS_IDS = 10


class GcInput(StrictInput):
    """What a user passes to `temporal workflow start --type OrphanGC --input`."""

    dry_run: bool = False
    grace_period_seconds: Annotated[Seconds, Field(ge=0, le=MAX_GRACE_PERIOD_SECONDS)] = (
        DEFAULT_GRACE_PERIOD_SECONDS
    )
    # Provider names; all the worker's providers when unset.
    providers: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=63)]],
            Field(min_length=1, max_length=100),
        ]
        | None
    ) = None
    # The circuit breaker: the largest share of the instances seen on a
    # provider that one sweep deletes, once it would delete more than
    # max_delete_unchecked of them.
    max_delete_share: Annotated[Seconds, Field(ge=0, le=1)] = DEFAULT_MAX_DELETE_SHARE
    max_delete_unchecked: Annotated[int, Field(ge=0, le=1_000_000)] = DEFAULT_MAX_DELETE_UNCHECKED


@dataclass
class ProviderSweep:
    """One provider's outcome: exact counts, and the ids (up to MAX_IDS of each)."""

    provider: str
    seen: int = 0
    owned: int = 0
    orphaned: int = 0
    deleted: int = 0
    skipped: int = 0
    failed: int = 0
    # provider_id -> why it is an orphan; deleted or not (dry run, failure).
    orphans: dict[str, str] = field(default_factory=dict)
    deleted_ids: list[str] = field(default_factory=list)
    # provider_id -> why it was kept this time.
    skips: dict[str, str] = field(default_factory=dict)
    # provider_id -> the error that stopped its deletion.
    failures: dict[str, str] = field(default_factory=dict)
    # Temporal calls made by the look-ups: visibility pages and describes.
    lookups: int = 0
    # Set when the provider could not be listed at all.
    error: str = ""
    # Set when the circuit breaker kept this sweep from deleting: the figures.
    circuit_open: str = ""


@dataclass
class GcResult:
    dry_run: bool
    grace_period_seconds: float
    providers: list[ProviderSweep]
    # Members of closed pools, signalled `terminate` (reported only, in a dry run).
    pool_members_ended: list[str] = field(default_factory=list)


@dataclass
class GcProgress:
    """Where a sweep stands; continue-as-new hands it to the next run."""

    sweeps: list[ProviderSweep] = field(default_factory=list)
    # Index into sweeps of the provider being swept.
    index: int = 0
    # That provider's surveyed candidates not handled yet; None: survey next.
    # Carried over continue-as-new, so a long sweep does not list it again.
    pending: list[Candidate] | None = None
    # Whether the survey found more candidates than it returned.
    more: bool = False
    # provider_id of the last candidate handled: the next survey starts after it.
    cursor: str = ""


@workflow.defn(name=ORPHAN_GC)
class OrphanGC:
    def __init__(self) -> None:
        self._progress = GcProgress()
        self._handled = 0
        self._dry_run = False
        self._finished = False
        # Where 0.3.10's sweeps recorded the marker: before the first command,
        # as a patch marker after a local activity's marker does not replay.
        keep_floor(ORPHAN_GC_FLOOR)

    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> GcResult:
        # Untyped, so no argument can fail to decode outside our validation.
        inp = await self._validated(raw, carried, extra)
        self._dry_run = inp.dry_run
        self._show()
        progress = self._progress
        while progress.index < len(progress.sweeps):
            await self._sweep(progress.sweeps[progress.index], inp)
            progress.index += 1
            progress.pending, progress.more, progress.cursor = None, False, ""
        members = await _end_members_of_closed_pools(inp)
        self._finished = True
        self._show()
        result = GcResult(inp.dry_run, inp.grace_period_seconds, progress.sweeps, members)
        opened = [s.circuit_open for s in progress.sweeps if s.circuit_open]
        if opened and not inp.dry_run:
            raise ApplicationError(
                "circuit breaker open, nothing deleted on "
                + "; ".join(opened)
                + ". Check that this worker uses the right Temporal namespace and "
                "installation; if these deletions are intended, run OrphanGC once with a "
                "higher max_delete_share or max_delete_unchecked",
                result,
                type=ErrorType.GC_CIRCUIT_OPEN,
                non_retryable=True,
            )
        return result

    # ---- validation -----------------------------------------------------------------

    async def _validated(self, raw: Any, carried: Any, extra: tuple[Any, ...]) -> GcInput:
        """The input, or a non-retryable failure naming every bad field.

        Provider names are checked against the worker's own providers (a
        local activity); a continued run has done all this already. Carried
        progress is honoured only from this workflow's own continue-as-new:
        forged candidates would be deleted without being listed.
        """
        state, argument_problems = continued_state(GcProgress, carried, extra)
        inp, problems = _parse(raw)
        if argument_problems:
            raise invalid_input("invalid input: " + "; ".join(argument_problems + problems))
        if state is not None and inp is not None:
            self._progress = state
            return inp
        configured = await workflow.execute_local_activity_method(
            GcActivities.providers,
            start_to_close_timeout=policies.VALIDATE.start_to_close,
            schedule_to_close_timeout=policies.VALIDATE.schedule_to_close,
            retry_policy=policies.TRANSIENT_RETRY,
        )
        wanted = raw.get("providers") if isinstance(raw, dict) else None
        if isinstance(wanted, list):
            known = ", ".join(configured) or "none"
            problems += [
                f"providers.{i}: unknown provider {name!r} (configured: {known})"
                for i, name in enumerate(wanted)
                if isinstance(name, str) and name and name not in configured
            ]
        if problems or inp is None:
            raise invalid_input("invalid input: " + "; ".join(problems))
        names = dict.fromkeys(inp.providers or configured)
        self._progress.sweeps = [ProviderSweep(name) for name in names]
        return inp

    # ---- the sweep ------------------------------------------------------------------

    async def _sweep(self, sweep: ProviderSweep, inp: GcInput) -> None:
        """Survey one provider, then confirm and delete its candidates batch by batch."""
        progress = self._progress
        while True:
            if progress.pending is None:
                try:
                    survey = await policies.execute(
                        GcActivities.survey,
                        SurveyInput(sweep.provider, inp.grace_period_seconds, progress.cursor),
                        policies.GC_SURVEY,
                        f"survey {sweep.provider}",
                    )
                except ActivityError as err:
                    sweep.error = message(err)
                    self._show()
                    return
                sweep.lookups += survey.lookups
                if not progress.cursor:
                    # Later surveys list the provider again; count each instance once.
                    sweep.seen, sweep.owned = survey.seen, survey.owned
                    sweep.skipped = survey.young + survey.untagged
                    sweep.skips.update(survey.young_ids)
                    sweep.skips.update(survey.untagged_ids)
                    sweep.circuit_open = _breaker(sweep.provider, survey, inp)
                    if sweep.circuit_open and not inp.dry_run:
                        self._show()
                        return
                progress.pending, progress.more = survey.candidates, survey.more
                self._show()
            while progress.pending:
                batch = progress.pending[:BATCH]
                await self._handle(sweep, batch, inp)
                progress.pending = progress.pending[BATCH:]
                progress.cursor = batch[-1].provider_id
                self._handled += len(batch)
                self._show()
                self._continue_as_new_if_long(inp)
            if not progress.more:
                return
            progress.pending = None

    async def _handle(self, sweep: ProviderSweep, batch: list[Candidate], inp: GcInput) -> None:
        """Confirm one batch, then delete its orphans concurrently."""
        try:
            confirmation = await policies.execute(
                GcActivities.confirm,
                ConfirmInput(batch),
                policies.GC_CONFIRM,
                f"confirm {_plural(len(batch), 'candidate')} on {sweep.provider}",
            )
        except ActivityError as err:
            for candidate in batch:
                _fail(sweep, candidate.provider_id, f"could not confirm: {message(err)}")
            return
        sweep.lookups += confirmation.lookups
        orphans: list[Candidate] = []
        for verdict in confirmation.verdicts:
            provider_id = verdict.candidate.provider_id
            if verdict.verdict == Decision.OWNED:
                sweep.owned += 1
            elif verdict.verdict == Decision.ORPHAN:
                sweep.orphaned += 1
                _note(sweep.orphans, provider_id, verdict.reason)
                orphans.append(verdict.candidate)
            else:
                sweep.skipped += 1
                _note(sweep.skips, provider_id, verdict.reason)
        if inp.dry_run or not orphans:
            return
        errors = await asyncio.gather(*(self._delete(c) for c in orphans))
        deleted = 0
        for candidate, error in zip(orphans, errors, strict=True):
            if error is None:
                deleted += 1
                sweep.deleted += 1
                if len(sweep.deleted_ids) < MAX_IDS:
                    sweep.deleted_ids.append(candidate.provider_id)
            else:
                _fail(sweep, candidate.provider_id, error)
        if deleted:
            await workflow.execute_local_activity_method(
                GcActivities.record_deleted,
                DeletedInput(sweep.provider, deleted),
                start_to_close_timeout=policies.VALIDATE.start_to_close,
                schedule_to_close_timeout=policies.VALIDATE.schedule_to_close,
                retry_policy=policies.TRANSIENT_RETRY,
            )

    async def _delete(self, candidate: Candidate) -> str | None:
        """Delete and wait until gone, as the owner would have; the error, or None."""
        ref = InstanceRef(
            provider=candidate.provider,
            provider_id=candidate.provider_id,
            name=candidate.name,
            generation=candidate.generation,
            created_at=candidate.created_at,
        )
        try:
            await delete_until_gone(
                ref, policies.execute, policies.GC_DELETION, f"orphan {ref.name}"
            )
        except ActivityError as err:
            return message(err)
        return None

    def _continue_as_new_if_long(self, inp: GcInput) -> None:
        """Keep each run's history short; the next run picks up where this one stands."""
        if self._handled < MAX_PER_RUN and not workflow.info().is_continue_as_new_suggested():
            return
        workflow.continue_as_new(args=[inp.model_dump(mode="json"), self._progress])

    # ---- visibility -----------------------------------------------------------------

    def _show(self) -> None:
        """The Web UI's current details: the counts so far and the orphans found."""
        if self._dry_run:
            mode = "dry run, finished: deleted nothing" if self._finished else "dry run"
        else:
            mode = "finished" if self._finished else "deleting orphans"
        lines = [
            f"**Orphan GC** ({mode})",
            "",
            "| provider | seen | owned | orphaned | deleted | skipped | failed |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        sweeps = self._progress.sweeps
        for s in sweeps:
            lines.append(
                f"| {s.provider} | {s.seen} | {s.owned} | {s.orphaned} | {s.deleted} "
                f"| {s.skipped} | {s.failed} |"
            )
        for s in sweeps:
            if s.error:
                lines.append(f"\n`{s.provider}` could not be swept: {s.error}")
            if s.circuit_open:
                lines.append(f"\ncircuit breaker open on {s.circuit_open}")
            shown = list(s.orphans.items())[:DETAILS_IDS]
            if shown:
                lines.append(f"\norphans on `{s.provider}`:")
                lines += [f"- `{provider_id}`: {reason}" for provider_id, reason in shown]
                if s.orphaned > len(shown):
                    lines.append(f"- and {s.orphaned - len(shown)} more")
        workflow.set_current_details("\n".join(lines))


async def _end_members_of_closed_pools(inp: GcInput) -> list[str]:
    """Signal `terminate` to members whose pool closed more than the grace period ago.

    A hard-terminated pool runs no code; its members outlive it by design
    (workflows/pool.py). Ended by signal, each deletes its own instance, so
    the next sweep finds nothing of theirs. Returns the members (up to MAX_IDS).
    """
    try:
        found: OrphanedMembersOutput = await workflow.execute_activity_method(
            PoolActivities.end_orphaned_members,
            OrphanedMembersInput(inp.grace_period_seconds, inp.dry_run),
            summary="end members of closed pools",
            start_to_close_timeout=policies.GC_SURVEY.start_to_close,
            schedule_to_close_timeout=policies.GC_SURVEY.schedule_to_close,
            retry_policy=policies.TRANSIENT_RETRY,
        )
    except ActivityError as err:
        workflow.logger.warning("could not end members of closed pools: %s", message(err))
        return []
    return found.members[:MAX_IDS]


def _parse(raw: Any) -> tuple[GcInput | None, list[str]]:
    """The validated input, or every problem as `field: message`; no input means defaults."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return None, [f"input: expected a JSON object, got {type(raw).__name__}"]
    try:
        return GcInput.model_validate(raw), []
    except ValidationError as exc:
        return None, [describe_error(err) for err in exc.errors()]


def _breaker(provider: str, survey: Survey, inp: GcInput) -> str:
    """The figures when a sweep would delete too much of what it saw, else ""."""
    would, seen = survey.unowned, survey.seen
    if would <= inp.max_delete_unchecked or would <= inp.max_delete_share * seen:
        return ""
    return (
        f"`{provider}`: {would} of the {seen} instances seen would be deleted "
        f"({would / seen:.0%}), more than max_delete_share {inp.max_delete_share:.0%} "
        f"and more than max_delete_unchecked {inp.max_delete_unchecked}"
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _note(ids: dict[str, str], provider_id: str, reason: str) -> None:
    if len(ids) < MAX_IDS:
        ids[provider_id] = reason


def _fail(sweep: ProviderSweep, provider_id: str, error: str) -> None:
    sweep.failed += 1
    _note(sweep.failures, provider_id, error)
