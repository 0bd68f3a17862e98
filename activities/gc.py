"""Orphan GC's look-ups: which of this installation's instances does nobody own?

Only instances of this installation and this Temporal namespace are
considered: owners are looked up in this namespace, so an instance another
namespace made would always look orphaned here. Instances made before the
namespace tag existed are kept and reported, never judged.

Ownership is decided by Temporal, never guessed from the instance: a
ProxyLifecycle lists every instance it owns or is creating in its
`ProxyInstances` search attribute, and publishes a name there before it asks a
provider to create it. So an instance is owned exactly while its owner
workflow (the `proxy-operator/owner` tag) is running and lists its name.
Names are unique per zone only: of two instances of one name (a twin a
create left in another zone), the owner's is the one it serves from (its
`ProxyEndpoint`), and the other is an orphan once past the grace period.

Two steps keep this cheap and safe:

- `gc_survey` lists one provider's instances and compares them, inside the
  activity, with one paged visibility query over the running lifecycles. A
  fleet of 10,000 costs a handful of Temporal calls, and only the few
  candidates cross a payload (payloads are limited to a few MB).
- `gc_confirm` describes each candidate's owner directly before the workflow
  deletes anything, because visibility lags: a workflow started a moment ago,
  or one that has just published a new instance, may not be listed yet.
  Describe reads the workflow's own state, so it is never behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import TypeVar

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionDescription, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import invalid_input, to_application_error
from activities.metrics import ORPHANS_DELETED, ORPHANS_FOUND
from contract import ENDPOINT, INSTANCES, PROVIDER, PROXY_LIFECYCLE, STATE
from providers.base import Instance, Provider
from providers.errors import classify
from providers.naming import (
    GENERATION_KEY,
    INSTALLATION_KEY,
    MANAGED_BY_KEY,
    MANAGED_BY_VALUE,
    NAMESPACE_KEY,
    OWNER_KEY,
)

T = TypeVar("T")


class Decision(StrEnum):
    """What `gc_confirm` decides about one candidate."""

    ORPHAN = "orphan"  # nobody owns it: delete
    OWNED = "owned"  # its owner lists it after all: keep
    SKIPPED = "skipped"  # its owner may still adopt it: keep for now


# Visibility page size: the server's maximum, so 10,000 owners are 10 calls.
VISIBILITY_PAGE_SIZE = 1000
# At most this many candidates (and young instances) cross one payload, a few
# hundred KB; the workflow asks again with a cursor for the rest.
SURVEY_LIMIT = 1000
# Describes in flight at once, so a burst of candidates cannot flood the server.
DESCRIBE_CONCURRENCY = 20


@dataclass(frozen=True)
class Candidate:
    """An instance the bulk look-up found no owner for; confirmed before deletion."""

    provider: str
    provider_id: str
    name: str
    # The owner workflow id from the tag; empty when the tag is missing.
    owner: str
    generation: int
    created_at: str
    # Set when its owner lists its name but serves that name from another
    # instance, at this endpoint: a twin (a same-name VM in another zone).
    twin_served_at: str = ""

    @classmethod
    def of(cls, provider: str, instance: Instance, *, twin_served_at: str = "") -> Candidate:
        """The candidate `instance` of `provider` is, read from its tags."""
        generation = instance.tags.get(GENERATION_KEY, "")
        return cls(
            provider=provider,
            provider_id=instance.provider_id,
            name=instance.name,
            owner=instance.tags.get(OWNER_KEY, ""),
            generation=int(generation) if generation.isdigit() else -1,
            created_at=_aware(instance.created_at).isoformat(),
            twin_served_at=twin_served_at,
        )


@dataclass(frozen=True)
class SurveyInput:
    provider: str
    grace_period_seconds: float
    # Only candidates whose provider_id sorts after this one: how a sweep
    # fetches its next page of candidates without handling one twice.
    after: str = ""
    # None: SURVEY_LIMIT.
    limit: int | None = None


@dataclass(frozen=True)
class Survey:
    """One provider compared with the running lifecycles.

    `seen`, `owned` and `young` count every instance of the listing; the
    candidates are those after the cursor, in provider_id order, up to the
    limit.
    """

    seen: int
    owned: int
    # Not owned, but younger than the grace period: kept this time.
    young: int
    # provider_id -> why it is kept, for up to `limit` of them.
    young_ids: dict[str, str]
    candidates: list[Candidate]
    # More candidates follow the last one returned.
    more: bool
    # Temporal calls this survey made: visibility pages.
    lookups: int
    # Not owned, but without a namespace tag (made before it existed): kept,
    # since nothing says which namespace to look their owner up in.
    untagged: int = 0
    # provider_id -> why it is kept, for up to `limit` of them.
    untagged_ids: dict[str, str] = field(default_factory=dict)

    @property
    def unowned(self) -> int:
        """Every candidate of the listing, after the cursor or not: what a sweep would delete."""
        return self.seen - self.owned - self.young - self.untagged


@dataclass(frozen=True)
class ConfirmInput:
    candidates: list[Candidate]


@dataclass(frozen=True)
class Verdict:
    """One candidate, what `gc_confirm` decided about it, and why (shown in the sweep's report)."""

    candidate: Candidate
    verdict: Decision
    reason: str


@dataclass(frozen=True)
class Confirmation:
    """`gc_confirm`'s result: a verdict for every candidate of the batch."""

    verdicts: list[Verdict]
    # Temporal calls made: one describe per distinct owner.
    lookups: int


@dataclass(frozen=True)
class DeletedInput:
    provider: str
    count: int


@dataclass(frozen=True)
class _Listed:
    """A running owner as visibility lists it: its instance names, and where it serves."""

    names: frozenset[str]
    # ProxyEndpoint: set only while the owner is Ready.
    endpoint: str = ""


@dataclass(frozen=True)
class _Owner:
    """What a direct describe says about one owner workflow id; status None: no such id."""

    status: WorkflowExecutionStatus | None
    workflow_type: str = ""
    instances: frozenset[str] = frozenset()
    # Whether it has published its state, which it does in its first task
    # together with the instance it is about to create or adopt.
    published: bool = False
    # ProxyEndpoint: where it serves, while Ready.
    endpoint: str = ""


class GcActivities:
    """Orphan GC's activities over the worker's providers and Temporal client."""

    def __init__(
        self, providers: Mapping[str, Provider], installation: str, client: Client
    ) -> None:
        self._providers = dict(providers)
        self._installation = installation
        self._client = client

    @activity.defn(name="gc_providers")
    async def providers(self) -> list[str]:
        """The providers this worker serves: what a sweep covers by default."""
        return list(self._providers)

    @activity.defn(name="gc_survey")
    async def survey(self, inp: SurveyInput) -> Survey:
        """List this installation's instances on one provider and find the candidates.

        An instance is owned when a running lifecycle lists it; instances
        younger than the grace period are kept without further look-ups.
        Everything else is a candidate for `gc_confirm`.
        """
        # Both at once: a cloud listing takes as long as the visibility pages.
        instances, (owners, lookups) = await asyncio.gather(
            self._list(inp.provider), self._running_owners(inp.provider)
        )
        served = _twins_served(instances, owners)
        now = datetime.now(UTC)
        grace = timedelta(seconds=inp.grace_period_seconds)
        limit = inp.limit or SURVEY_LIMIT
        owned = young = untagged = 0
        young_ids: dict[str, str] = {}
        untagged_ids: dict[str, str] = {}
        candidates: list[Candidate] = []
        for instance in instances:
            listed = owners.get(instance.tags.get(OWNER_KEY, ""))
            twin_served_at = served.get(instance.provider_id, "")
            if listed is not None and instance.name in listed.names and not twin_served_at:
                owned += 1
                continue
            if NAMESPACE_KEY not in instance.tags:
                untagged += 1
                if len(untagged_ids) < limit:
                    untagged_ids[instance.provider_id] = (
                        f"no {NAMESPACE_KEY} tag (made before instances carried one): "
                        "its owner's namespace is unknown; delete it by hand if it is an orphan"
                    )
                continue
            age = now - _aware(instance.created_at)
            if age < grace:
                young += 1
                if len(young_ids) < limit:
                    young_ids[instance.provider_id] = (
                        f"created {int(age.total_seconds())} s ago, within the grace period"
                    )
            elif instance.provider_id > inp.after:
                candidates.append(
                    Candidate.of(inp.provider, instance, twin_served_at=twin_served_at)
                )
        candidates.sort(key=lambda c: c.provider_id)
        return Survey(
            seen=len(instances),
            owned=owned,
            young=young,
            young_ids=young_ids,
            candidates=candidates[:limit],
            more=len(candidates) > limit,
            lookups=lookups,
            untagged=untagged,
            untagged_ids=untagged_ids,
        )

    @activity.defn(name="gc_confirm")
    async def confirm(self, inp: ConfirmInput) -> Confirmation:
        """Describe each candidate's owner directly: the verdict the workflow acts on.

        Describe reads the owner's own state, not the lagging visibility store.
        A running owner that has not run its first task yet keeps the
        instance for now: a new run of a reused workflow id adopts the
        instance its name points at, and says so only in that first task.
        """
        owner_ids = sorted({c.owner for c in inp.candidates if c.owner})
        slots = asyncio.Semaphore(DESCRIBE_CONCURRENCY)

        async def describe(owner_id: str) -> _Owner:
            async with slots:
                return await self._describe(owner_id)

        described = await asyncio.gather(*(describe(o) for o in owner_ids))
        owners = dict(zip(owner_ids, described, strict=True))
        verdicts = [_verdict(c, owners.get(c.owner)) for c in inp.candidates]
        found = sum(v.verdict is Decision.ORPHAN for v in verdicts)
        if found:
            ORPHANS_FOUND.labels(inp.candidates[0].provider).inc(found)
        return Confirmation(verdicts, lookups=len(owner_ids))

    @activity.defn(name="gc_record_deleted")
    async def record_deleted(self, inp: DeletedInput) -> None:
        """Count orphans the workflow deleted and saw gone."""
        ORPHANS_DELETED.labels(inp.provider).inc(inp.count)

    async def _list(self, provider_name: str) -> list[Instance]:
        """Every instance of this installation, this operator and this namespace, on one provider.

        Instances without a namespace tag are included; the survey keeps them.
        """
        provider = self._providers.get(provider_name)
        if provider is None:
            raise invalid_input(f"providers: unknown provider {provider_name!r}")
        found = await _threaded(provider.list_by_tag, INSTALLATION_KEY, self._installation)
        # list_by_tag selects on one tag; the others are checked here, so an
        # instance some other tool tagged alike is never touched.
        namespace = self._client.namespace
        return [
            i
            for i in found
            if i.tags.get(MANAGED_BY_KEY) == MANAGED_BY_VALUE
            and i.tags.get(INSTALLATION_KEY) == self._installation
            and i.tags.get(NAMESPACE_KEY, namespace) == namespace
        ]

    async def _running_owners(self, provider_name: str) -> tuple[dict[str, _Listed], int]:
        """Running lifecycles on this provider -> what each lists; pages used.

        One query, paged: the cost grows with the fleet's size over a thousand,
        not with the number of instances.
        """
        query = (
            f"WorkflowType = '{PROXY_LIFECYCLE}' AND ExecutionStatus = 'Running' "
            f"AND {PROVIDER.name} = '{_quote(provider_name)}'"
        )
        listing = self._client.list_workflows(query, page_size=VISIBILITY_PAGE_SIZE)
        owners: dict[str, _Listed] = {}
        pages = 0
        while True:
            await listing.fetch_next_page()
            pages += 1
            for execution in listing.current_page or ():
                attributes = execution.typed_search_attributes
                owners[execution.id] = _Listed(
                    frozenset(attributes.get(INSTANCES) or ()), attributes.get(ENDPOINT) or ""
                )
            if not listing.next_page_token:
                return owners, pages

    async def _describe(self, owner_id: str) -> _Owner:
        try:
            description = await self._client.get_workflow_handle(owner_id).describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return _Owner(status=None)
            raise
        return _owner(description)


def _owner(description: WorkflowExecutionDescription) -> _Owner:
    attributes = description.typed_search_attributes
    return _Owner(
        status=description.status,
        workflow_type=description.workflow_type,
        instances=frozenset(attributes.get(INSTANCES) or ()),
        published=attributes.get(STATE) is not None,
        endpoint=attributes.get(ENDPOINT) or "",
    )


def _twins_served(instances: list[Instance], owners: Mapping[str, _Listed]) -> dict[str, str]:
    """Twins -> the endpoint their owner serves their name from, on another instance.

    Names are unique per zone only: a create that reached a fallback zone
    and then adopted or inserted elsewhere can leave the same name in two
    zones, and the name the owner lists covers one of them. Which one is
    told by where the owner serves (its ProxyEndpoint): the others are not
    its instances. Without a served endpoint among them (the owner not
    Ready, or serving another generation) they are all kept.
    """
    by_name: dict[tuple[str, str], list[Instance]] = {}
    for instance in instances:
        by_name.setdefault((instance.tags.get(OWNER_KEY, ""), instance.name), []).append(instance)
    served: dict[str, str] = {}
    for (owner, name), same in by_name.items():
        listed = owners.get(owner)
        if len(same) < 2 or listed is None or name not in listed.names or not listed.endpoint:
            continue
        if any(i.endpoint == listed.endpoint for i in same):
            served.update(
                (i.provider_id, listed.endpoint) for i in same if i.endpoint != listed.endpoint
            )
    return served


def _verdict(c: Candidate, owner: _Owner | None) -> Verdict:
    if not c.owner:
        return Verdict(c, Decision.ORPHAN, "no owner tag")
    if owner is None or owner.status is None:
        return Verdict(c, Decision.ORPHAN, f"owner {c.owner} does not exist")
    if owner.status is not WorkflowExecutionStatus.RUNNING:
        return Verdict(c, Decision.ORPHAN, f"owner {c.owner} is {owner.status.name.lower()}")
    if owner.workflow_type != PROXY_LIFECYCLE:
        return Verdict(c, Decision.ORPHAN, f"{c.owner} is now a {owner.workflow_type}, not a proxy")
    if c.name in owner.instances and c.twin_served_at and owner.endpoint == c.twin_served_at:
        return Verdict(
            c,
            Decision.ORPHAN,
            f"owner {c.owner} serves {c.name} from another instance of that name, at "
            f"{c.twin_served_at}: a twin in another zone",
        )
    if c.name in owner.instances and c.twin_served_at:
        return Verdict(
            c,
            Decision.SKIPPED,
            f"owner {c.owner} lists {c.name} but no longer serves it at {c.twin_served_at}: "
            "cannot tell which instance of that name is its own",
        )
    if c.name in owner.instances:
        return Verdict(c, Decision.OWNED, f"owner {c.owner} lists it (visibility was behind)")
    if not owner.published:
        return Verdict(c, Decision.SKIPPED, f"owner {c.owner} has not started yet and may adopt it")
    return Verdict(c, Decision.ORPHAN, f"owner {c.owner} no longer uses generation {c.generation}")


def _aware(moment: datetime) -> datetime:
    """Providers report UTC; a naive timestamp is read as UTC, not local time."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _quote(value: str) -> str:
    """A string literal for a visibility query."""
    return value.replace("\\", "\\\\").replace("'", "\\'")


async def _threaded(fn: Callable[..., T], *args: object) -> T:
    """Run a sync provider call off the event loop; taxonomy errors become ApplicationErrors."""
    try:
        return await asyncio.to_thread(fn, *args)
    except Exception as err:
        raise to_application_error(classify(err)) from err
