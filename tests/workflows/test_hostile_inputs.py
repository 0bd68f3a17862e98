"""No input wedges a workflow: hundreds of hostile starts, through the client, on one worker.

ProxyLifecycle, ProxyPool and OrphanGC alike; hostile signals and updates to
running workflows are tests/workflows/test_hostile_handlers.py's.

Each case replaces one path of a valid input (or a whole argument, or adds
one) with a hostile value: huge and negative numbers, NaN and Infinity,
deep nesting, wrong types, long strings, unicode, extra positional arguments,
and payloads the SDK cannot decode at all. Every workflow must either run
(schedule its first activity; a pool: mark itself a pool) or fail as InvalidInput, having
created nothing, and no history may
contain a WorkflowTaskFailed event: a failed workflow task is retried
forever, and such a workflow can no longer be terminated cleanly. Cases are
generated deterministically; the ones that run are terminated.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from activities.gc import GcActivities
from activities.provider import ProviderActivities
from contract import ORPHAN_GC, POOL, PROXY_LIFECYCLE, PROXY_POOL, ErrorType
from providers.memory import MemoryProvider
from tests.helpers.config import build_config
from tests.helpers.temporal import STARVED_TASK
from tests.helpers.waiting import wait_for
from tests.helpers.workers import running
from worker import build_worker

pytestmark = pytest.mark.slow

# Nothing listens on loopback's port 443 here, so a proxy that runs probes
# nothing beyond this machine.
LIFECYCLE_INPUT: dict[str, Any] = {
    "provider": "mem",
    "health": {"target": "https://127.0.0.1/", "interval_seconds": 1},
}
LIFECYCLE_PATHS = [
    ("provider",),
    ("port",),
    ("labels",),
    ("labels", "team"),
    ("health",),
    ("health", "target"),
    ("health", "interval_seconds"),
    ("health", "failure_threshold"),
    ("health", "timeout_seconds"),
    ("health", "heartbeat_timeout_seconds"),
    ("max_lifetime_seconds",),
    ("monitor",),
    ("placement",),
    ("placement", "zone"),
    ("placement", "namespace"),
    ("colour",),
]
NUMBERS = {
    "port",
    "health.interval_seconds",
    "health.failure_threshold",
    "health.timeout_seconds",
    "health.heartbeat_timeout_seconds",
    "max_lifetime_seconds",
    "grace_period_seconds",
    "max_delete_share",
    "max_delete_unchecked",
    "replicas",
    "max_surge",
    "lifetime_jitter",
    "failure_budget",
    "bans.max",
    "bans.window_seconds",
    "spread.0.weight",
}
# Out of every numeric field's range: `max_lifetime_seconds: 10**20`, let
# through, would raise OverflowError in workflow code once Ready.
OUT_OF_RANGE = [10**20, -(10**20), 2**63, 1e308, float("nan"), float("inf"), float("-inf")]
# No members: a pool that runs starts nothing, so the cases stay cheap.
POOL_INPUT: dict[str, Any] = {"replicas": 0, "template": LIFECYCLE_INPUT}
POOL_PATHS = [
    ("replicas",),
    ("template",),
    ("template", "provider"),
    ("template", "health", "target"),
    ("template", "health", "heartbeat_timeout_seconds"),
    ("template", "monitor"),
    ("spread",),
    ("spread", 0),
    ("spread", 0, "provider"),
    ("spread", 0, "weight"),
    ("max_surge",),
    ("lifetime_jitter",),
    ("failure_budget",),
    ("bans",),
    ("bans", "max"),
    ("bans", "window_seconds"),
    ("colour",),
]
GC_INPUT: dict[str, Any] = {"dry_run": True, "grace_period_seconds": 0}
GC_PATHS = [
    ("dry_run",),
    ("grace_period_seconds",),
    ("providers",),
    ("providers", 0),
    ("max_delete_share",),
    ("max_delete_unchecked",),
]


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


HOSTILE: list[Any] = [
    10**20,
    -(10**20),
    -1,
    0,
    2**63,
    1e20,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    1.5,
    True,
    None,
    "",
    "1",
    "x" * 100_000,
    "ünïcødé 🙂 \u202e\u0000",
    "\ud800",  # a lone surrogate: not even valid UTF-8
    [],
    {},
    {"a": {"b": {"c": {}}}},
    nested(200),
]


def json_payload(data: bytes, encoding: bytes = b"json/plain") -> RawValue:
    return RawValue(Payload(metadata={"encoding": encoding}, data=data))


# Arguments the Python client could not even encode, and the SDK cannot decode.
UNDECODABLE = [
    json_payload(b"[" * 100_000 + b"]" * 100_000),
    json_payload(b'{"provider": "mem", "port": ' + b"9" * 5000 + b"}"),
    json_payload(b"{not json"),
    json_payload(b"\xff\xfe", b"binary/who-knows"),
    json_payload(b"{}", b"json/protobuf"),
]


def runs(event: HistoryEvent) -> bool:
    """A lifecycle or GC sweep runs once it schedules an activity; a pool (with no
    members) once it has marked itself a pool (`ProxyPool`), after its validation.

    Not any search-attribute upsert: `workflow.patched` upserts one of its own
    (TemporalChangeVersion) before validation, in a task of its own when the
    validating local activity outlasts the first one on a busy machine.
    """
    if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
        return True
    upserted = event.upsert_workflow_search_attributes_event_attributes.search_attributes
    return POOL.name in upserted.indexed_fields


# What a workflow that failed its validation must not have done.
CREATING_EVENTS = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
    EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED,
}


@dataclass(frozen=True)
class Case:
    workflow: str
    args: list[Any]
    what: str
    # A field the failure must name, when the case must fail.
    must_name: str = ""


def replaced(base: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """`base` with the value at `path` replaced, creating the containers on the way."""
    body = copy.deepcopy(base)
    node: Any = body
    for key, next_key in itertools.pairwise(path):
        if key not in node:
            node[key] = [None] if isinstance(next_key, int) else {}
        node = node[key]
    node[path[-1]] = value
    return body


def shown(value: Any) -> str:
    text = repr(value.payload.data[:20]) if isinstance(value, RawValue) else repr(value)
    return text if len(text) <= 30 else text[:27] + "..."


def cases() -> Iterator[Case]:
    for workflow, base, paths in (
        (PROXY_LIFECYCLE, LIFECYCLE_INPUT, LIFECYCLE_PATHS),
        (PROXY_POOL, POOL_INPUT, POOL_PATHS),
        (ORPHAN_GC, GC_INPUT, GC_PATHS),
    ):
        for path in paths:
            dotted = ".".join(map(str, path))
            for value in HOSTILE:
                must_name = dotted if dotted in NUMBERS and value in OUT_OF_RANGE else ""
                if isinstance(value, float) and value != value:  # NaN is in no list
                    must_name = dotted if dotted in NUMBERS else ""
                yield Case(
                    workflow,
                    [replaced(base, path, value)],
                    f"{dotted} = {shown(value)}",
                    must_name,
                )
        for value in [*HOSTILE, *UNDECODABLE]:
            yield Case(workflow, [value], f"input = {shown(value)}")
            yield Case(workflow, [base, value], f"argument 2 = {shown(value)}")
        yield Case(workflow, [base, None, "extra"], "a third argument")
        yield Case(workflow, [base, {}, {}, {}], "four arguments")


@pytest.fixture
async def worker_queue(temporal_env: WorkflowEnvironment) -> AsyncIterator[str]:
    provider = MemoryProvider()
    config = build_config({"name": "mem", "type": "memory"}, connect_ports=[443])
    acts = ProviderActivities({"mem": provider}, config)
    gc = GcActivities({"mem": provider}, config.installation, temporal_env.client)
    task_queue = f"hostile-{uuid.uuid4().hex[:12]}"
    async with running(build_worker(temporal_env.client, acts, gc=gc, task_queue=task_queue)):
        yield task_queue
    acts.close()


@dataclass
class Outcome:
    case: Case
    handle: WorkflowHandle[Any, Any]
    ran: bool = False
    failure: ApplicationError | None = None


async def settle(client: Client, task_queue: str, case: Case) -> Outcome:
    """Start the case; wait until it fails or schedules its first activity."""
    handle = await client.start_workflow(
        case.workflow,
        args=case.args,
        id=f"hostile-{uuid.uuid4().hex[:12]}",
        task_queue=task_queue,
    )
    outcome = Outcome(case, handle)

    async def settled() -> bool:
        try:
            await asyncio.wait_for(handle.result(), timeout=2)
        except WorkflowFailureError as err:
            assert isinstance(err.cause, ApplicationError), f"{case.what}: {err.cause!r}"
            outcome.failure = err.cause
            return True
        except TimeoutError:
            outcome.ran = any(map(runs, (await handle.fetch_history()).events))
            return outcome.ran
        outcome.ran = True  # completed: an OrphanGC dry run over an empty provider
        return True

    # Hundreds of cases share one worker: on a busy machine (both cores
    # loaded) its workflow tasks took over 5 s each, and a case waited longer
    # than the usual minute for its turn.
    await wait_for(settled, f"{case.workflow} with {case.what} to run or fail", deadline=300)
    return outcome


# About 2 minutes idle; several times that with both cores loaded (each run
# case keeps its proxies or members busy on the one worker until the end).
@pytest.mark.timeout(900)
async def test_no_hostile_input_wedges_a_workflow(
    temporal_env: WorkflowEnvironment, worker_queue: str
) -> None:
    client = temporal_env.client
    all_cases = list(cases())
    assert len(all_cases) > 300
    slots = asyncio.Semaphore(64)

    async def one(case: Case) -> Outcome:
        async with slots:
            return await settle(client, worker_queue, case)

    outcomes = await asyncio.gather(*(one(c) for c in all_cases))
    # Ended however the test goes: a worker does not stop while they run.
    running = [o.handle for o in outcomes if o.ran and o.case.workflow != ORPHAN_GC]
    try:
        wrong = [
            f"{o.case.what}: {o.failure}" if o.failure else f"{o.case.what}: accepted"
            for o in outcomes
            if (o.failure is None and o.case.must_name)
            or (
                o.failure is not None
                and (
                    o.failure.type != ErrorType.INVALID_INPUT
                    or not o.failure.message.startswith("invalid input: ")
                    or o.case.must_name not in o.failure.message
                )
            )
        ]
        assert not wrong, "\n".join(wrong)
        # The proxies and pools that run get hostile signals, then one
        # `terminate` with more arguments than it takes, which must still end
        # them cleanly.
        for handle in running:
            await handle.signal("no-such-signal", args=[{"x": 1}])
            await handle.signal("terminate", args=[UNDECODABLE[0]])  # dropped: undecodable
            await handle.signal("terminate", args=["hostile-input test", {"two": 2}, 3])
        ended = await asyncio.gather(*(asyncio.wait_for(h.result(), 60) for h in running))
        assert {result["state"] for result in ended} == {"Terminated"}
    finally:
        for handle in running:
            with contextlib.suppress(RPCError):  # ended already, as it should have
                await handle.terminate("hostile-input test")

    async def task_failures(outcome: Outcome) -> list[str]:
        async with slots:
            history = await outcome.handle.fetch_history()
        what = f"{outcome.case.workflow} with {outcome.case.what}: "
        created = outcome.failure is not None and any(
            e.event_type in CREATING_EVENTS for e in history.events
        )
        failures = [
            e.workflow_task_failed_event_attributes.failure.message
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        ]
        # A task the deadlock detector failed on a starved machine is not the
        # input's doing: the workflow still reached the outcome checked above,
        # which one that hangs on its input never would.
        return [what + json.dumps(m) for m in failures if not m.startswith(STARVED_TASK)] + (
            [what + "refused, yet started something"] if created else []
        )

    failed_tasks = [
        f for found in await asyncio.gather(*map(task_failures, outcomes)) for f in found
    ]
    assert failed_tasks == []
    ran = {o.case.what for o in outcomes if o.ran and o.case.workflow == PROXY_LIFECYCLE}
    # The valid variants ran, so the cases were not all rejected for one reason.
    assert {"health = {}", "labels = {}", "port = None", "argument 2 = None"} <= ran
    pools_ran = {o.case.what for o in outcomes if o.ran and o.case.workflow == PROXY_POOL}
    assert {"replicas = 0", "bans = {}", "spread = None", "argument 2 = None"} <= pools_ran
