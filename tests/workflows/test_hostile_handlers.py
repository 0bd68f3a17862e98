"""Every signal, update and query argument, sent a hostile corpus while its workflow runs:
none wedges it.

Anyone who may signal or update workflows in the namespace can send these
handlers anything, so each is untrusted input. HANDLERS gives, for every
signal and update ProxyLifecycle, ProxyPool and OrphanGC define, and every
query of theirs that takes an argument (read from
the classes' Temporal definitions: a handler added without an entry here
fails `test_every_handler_has_a_corpus`), a valid request and its fields.
Each case replaces the whole argument or one field with a hostile value
(wrong types, null, nested objects, 1 MB strings, unicode and control
characters, unparsable and extreme dates, negative, huge, NaN and infinite
numbers, deep nesting), drops a field, adds an unknown one, or sends no,
extra or undecodable arguments. After each:

- a signal: the workflow task that took it completed, the workflow still
  runs and answers `status`; no run of it has a WorkflowTaskFailed event
  (a failed task is retried forever: the pool would refuse every update);
- an update: a value of the wrong type is rejected before acceptance as
  InvalidInput naming the field, not as a Python error; a value of the right
  type may be taken (or refused as InvalidInput);
- a query (the pool's `status` page): a value of the wrong type fails that
  query alone, naming the field; the workflow answers the next;
- terminate: the workflow ends Terminated, with a bounded reason.

The hostile starts are tests/workflows/test_hostile_inputs.py's.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from contract import ErrorType
from tests.helpers.run_chain import failed_tasks
from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for
from tests.workflows.test_hostile_inputs import (  # noqa: F401 (the memory worker's fixture)
    LIFECYCLE_INPUT,
    UNDECODABLE,
    nested,
    worker_queue,
)
from workflows.inputs import MAX_REASON
from workflows.lifecycle import ProxyLifecycle
from workflows.orphan_gc import OrphanGC
from workflows.pool import ProxyPool
from workflows.pool_autoscale import NOT_AUTOSCALED

pytestmark = pytest.mark.slow

# Placeholders in a valid request, filled in when it is sent: a live member
# of the pool under test, and the time now (a report must not be stale).
MEMBER = "<member>"
NOW = "<now>"
MB = 1_000_000


class Kind(Enum):
    SIGNAL = "signal"
    UPDATE = "update"
    QUERY = "query"


class Type(Enum):
    """A field's JSON type: a value of another type must be refused naming the field."""

    TEXT = "text"
    WHOLE = "whole number"
    FLAG = "flag"


@dataclass(frozen=True)
class Field:
    type: Type
    required: bool = False


@dataclass(frozen=True)
class Handler:
    """One signal or update: a valid request and its fields."""

    kind: Kind
    valid: dict[str, Any]
    fields: dict[str, Field]
    # terminate: each case ends the workflow, so each gets a workflow of its own.
    ends: bool = False
    # The argument may be left out (or null): a query's page.
    optional: bool = False


REASON = {"reason": "hostile corpus"}
HANDLERS: dict[type, dict[str, Handler]] = {
    ProxyLifecycle: {
        "terminate": Handler(Kind.SIGNAL, REASON, {"reason": Field(Type.TEXT)}, ends=True),
        "rotate": Handler(Kind.SIGNAL, REASON, {"reason": Field(Type.TEXT)}),
        # A standalone proxy ignores it; a member probes its own instance.
        "instance_failing": Handler(
            Kind.SIGNAL,
            {"endpoint": "127.0.0.1:1", **REASON},
            {"endpoint": Field(Type.TEXT, required=True), "reason": Field(Type.TEXT)},
        ),
    },
    ProxyPool: {
        "terminate": Handler(Kind.SIGNAL, REASON, {"reason": Field(Type.TEXT)}, ends=True),
        "member_changed": Handler(
            Kind.SIGNAL,
            {
                "member": MEMBER,
                "state": "Ready",
                "endpoint": "127.0.0.1:1",
                "provider": "local",
                "generation": 0,
                "ready_since": NOW,
                "at": NOW,
                "seq": 1_000_000,
                "last_error": None,
            },
            {
                "member": Field(Type.TEXT, required=True),
                "state": Field(Type.TEXT, required=True),
                "endpoint": Field(Type.TEXT, required=True),
                "provider": Field(Type.TEXT, required=True),
                "generation": Field(Type.WHOLE, required=True),
                "ready_since": Field(Type.TEXT),
                "at": Field(Type.TEXT, required=True),
                "seq": Field(Type.WHOLE, required=True),
                "last_error": Field(Type.TEXT),
            },
        ),
        # Updates in the order sent: scale last, as it may take the pool to 0.
        "rotate": Handler(
            Kind.UPDATE, {"member": MEMBER}, {"member": Field(Type.TEXT), "all": Field(Type.FLAG)}
        ),
        "report_ban": Handler(
            Kind.UPDATE,
            {"member": MEMBER, "reason": "hostile corpus"},
            {
                "member": Field(Type.TEXT, required=True),
                "reason": Field(Type.TEXT),
                "endpoint": Field(Type.TEXT),
            },
        ),
        "scale": Handler(Kind.UPDATE, {"replicas": 1}, {"replicas": Field(Type.WHOLE, True)}),
        "report_demand": Handler(
            Kind.UPDATE,
            {"gateway": "gw-hostile", "open_tunnels": 1},
            {
                "gateway": Field(Type.TEXT, True),
                "open_tunnels": Field(Type.WHOLE, True),
                "new_tunnels": Field(Type.WHOLE),
                "window_seconds": Field(Type.WHOLE),
            },
        ),
        "wake": Handler(
            Kind.UPDATE, {"gateway": "gw-hostile"}, {"gateway": Field(Type.TEXT, True)}
        ),
        "status": Handler(
            Kind.QUERY,
            {"after": -1, "limit": 5},
            {"after": Field(Type.WHOLE), "limit": Field(Type.WHOLE)},
            optional=True,
        ),
    },
    OrphanGC: {},
}
# The pool under test is fixed: it refuses a gateway's well-formed demand
# report or wake as NotAutoscaled (so the gateway stops sending them), after
# refusing a malformed one as InvalidInput like every update.
FIXED_POOL_REFUSALS = {"report_demand": NOT_AUTOSCALED, "wake": NOT_AUTOSCALED}
# A well-formed ban the pool refuses for its own reasons, as it must: the
# member is banned and not serving yet on its next instance (its endpoint not
# yet confirmed), or the ban limit is reached. Which one a case meets depends
# on how far the first accepted ban's rotation has got.
BAN_REFUSALS = ("is not serving", "ban rate limit")

HOSTILE: list[Any] = [
    None,
    True,
    0,
    -1,
    1.5,
    -(10**20),
    10**20,
    2**63,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "x" * MB,
    "ünïcødé 🙂 \u202e\u0000\x1b[2J\r\n",
    "\ud800",  # a lone surrogate: not even valid UTF-8
    "not-a-date",
    "9999-12-31",
    "9999-12-31T23:59:59+00:00",
    "0001-01-01T00:00:00+14:00",
    "2099-01-01T00:00:00",
    [],
    ["Ready", 1],
    {},
    {"a": {"b": {"c": {}}}},
    nested(200),
]
# Longer than any field's cap (500): must be refused or cut, never kept whole.
LONGEST_KEPT = 500


def of_type(value: Any, spec: Field) -> bool:
    """Whether `value` fits the field's type (and is short enough to be taken as it is)."""
    wanted = spec.type
    if value is None:
        return not spec.required
    if wanted is Type.TEXT:
        return isinstance(value, str) and len(value) <= LONGEST_KEPT
    if wanted is Type.WHOLE:
        return type(value) is int
    return type(value) is bool


def shown(value: Any) -> str:
    text = repr(value.payload.data[:20]) if isinstance(value, RawValue) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Case:
    """One message: its arguments, and the field a rejection must name ("" for any)."""

    what: str
    args: list[Any]
    field: str = ""
    # Of the wrong type or shape: an update must refuse it (as InvalidInput).
    wrong: bool = True


def cases(handler: Handler) -> Iterator[Case]:
    """The corpus for one handler: whole arguments, then field by field."""
    for value in [*HOSTILE, *UNDECODABLE]:
        # An optional argument left out, or given with every field left out.
        defaults = handler.optional and (value is None or value == {})
        yield Case(f"input = {shown(value)}", [value], wrong=not defaults)
    yield Case("no argument", [], wrong=not handler.optional)
    yield Case("extra arguments", [handler.valid, "extra", {"x": 1}])
    yield Case("an unknown field", [{**handler.valid, "colour": "red"}], "colour")
    yield Case("fields nested 200 deep", [{**handler.valid, "x": nested(200)}], "x")
    for name, spec in handler.fields.items():
        without = {k: v for k, v in handler.valid.items() if k != name}
        yield Case(f"no {name}", [without], name, wrong=spec.required)
        for value in HOSTILE:
            body = {**handler.valid, name: value}
            yield Case(f"{name} = {shown(value)}", [body], name, not of_type(value, spec))


def filled(value: Any, member: str) -> Any:
    """A request with its placeholders filled in."""
    if value == MEMBER:
        return member
    if value == NOW:
        return datetime.now(UTC).isoformat()
    if isinstance(value, dict):
        return {k: filled(v, member) for k, v in value.items()}
    if isinstance(value, list):
        return [filled(v, member) for v in value]
    return value


def declared(workflow_class: type) -> set[str]:
    """The signals and updates a workflow class defines (a dynamic handler as None), and
    the queries that take an argument."""
    definition = workflow._Definition.must_from_class(workflow_class)
    queries = {
        name
        for name, query in definition.queries.items()
        if len(inspect.signature(query.fn).parameters) > 1  # more than `self`
    }
    return set(definition.signals) | set(definition.updates) | queries


def test_every_handler_has_a_corpus() -> None:
    for workflow_class, handlers in HANDLERS.items():
        assert declared(workflow_class) == set(handlers), workflow_class.__name__
        definition = workflow._Definition.must_from_class(workflow_class)
        for name, handler in handlers.items():
            wanted = {
                Kind.SIGNAL: definition.signals,
                Kind.UPDATE: definition.updates,
                Kind.QUERY: definition.queries,
            }[handler.kind]
            assert name in wanted, f"{workflow_class.__name__}.{name} is no {handler.kind.value}"


def test_the_corpus_has_every_kind_of_hostile_value() -> None:
    corpus = list(cases(HANDLERS[ProxyPool]["member_changed"]))
    assert len(corpus) > 250
    whats = {c.what for c in corpus}
    for expected in ("at = 'not-a-date'", "ready_since = '9999-12-31T23:59:59+00:00'", "no at"):
        assert expected in whats


# ---- sending ----------------------------------------------------------------------


@dataclass
class Target:
    """A running workflow the corpus is sent to."""

    handle: WorkflowHandle[Any, Any]
    first_run_id: str
    member: str = ""
    problems: list[str] = field(default_factory=list)


async def started(client: Client, task_queue: str, workflow: str, body: Any) -> Target:
    handle = await client.start_workflow(
        workflow, body, id=f"hostile-{uuid.uuid4().hex[:12]}", task_queue=task_queue
    )
    assert handle.first_execution_run_id is not None
    return Target(handle, handle.first_execution_run_id)


async def answers(target: Target) -> bool:
    """Whether the workflow runs, has no workflow task pending, and answers `status`."""
    description = await target.handle.describe()
    if description.status != WorkflowExecutionStatus.RUNNING:
        return False
    pending = description.raw_description.pending_workflow_task
    if description.raw_description.HasField("pending_workflow_task") and pending.attempt > 1:
        raise AssertionError(f"a workflow task failed (attempt {pending.attempt})")
    if description.raw_description.HasField("pending_workflow_task"):
        return False
    await target.handle.query("status")
    return True


async def signal(target: Target, name: str, case: Case) -> None:
    """Send one hostile signal; wait until the workflow took it and answers again."""
    args = filled(case.args, target.member)
    await target.handle.signal(name, args=args)
    try:
        await wait_for(lambda: answers(target), f"{name} with {case.what} taken", deadline=120)
    except AssertionError as err:
        target.problems.append(f"{name} with {case.what}: {err}")


async def update(target: Target, name: str, case: Case) -> None:
    """Send one hostile update; wrong input must be refused as InvalidInput naming the field."""
    args = filled(case.args, target.member)
    what = f"{name} with {case.what}"
    try:
        await target.handle.execute_update(name, args=args)
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        if (
            isinstance(cause, ApplicationError)
            and not case.wrong
            and (
                cause.type == FIXED_POOL_REFUSALS.get(name)
                or (
                    name == "report_ban"
                    and cause.type == ErrorType.INVALID_INPUT
                    and any(refusal in cause.message for refusal in BAN_REFUSALS)
                )
            )
        ):
            return
        if not isinstance(cause, ApplicationError) or cause.type != ErrorType.INVALID_INPUT:
            target.problems.append(f"{what}: refused as {cause!r}, not as InvalidInput")
        elif case.field not in cause.message:
            target.problems.append(f"{what}: refusal does not name {case.field}: {cause}")
        return
    if case.wrong:
        target.problems.append(f"{what}: accepted")


async def query(target: Target, name: str, case: Case) -> None:
    """Ask one hostile query: wrong input fails that query alone, naming the field."""
    problem = None
    try:
        await target.handle.query(name, args=filled(case.args, target.member))
        problem = "answered" if case.wrong else None
    except WorkflowQueryFailedError as err:
        problem = None if case.field in str(err) else f"refusal does not name {case.field}: {err}"
    if problem is not None:
        target.problems.append(f"{name} with {case.what}: {problem}")


async def hostile_sequence(target: Target, handlers: dict[str, Handler]) -> None:
    """Every case of every handler that leaves the workflow running, one after another."""
    for name, handler in handlers.items():
        if handler.ends:
            continue
        send = {Kind.SIGNAL: signal, Kind.UPDATE: update, Kind.QUERY: query}[handler.kind]
        for case in cases(handler):
            await send(target, name, case)
            if target.problems and handler.kind is Kind.SIGNAL:
                return  # a wedged workflow refuses all that follows: the first one says why
    # Names no handler has: a signal is kept unread, an update refused.
    await target.handle.signal("no-such-signal", {"x": 1})
    with pytest.raises(WorkflowUpdateFailedError):
        await target.handle.execute_update("no-such-update", {"x": 1})
    await wait_for(lambda: answers(target), "the workflow answering after it all", deadline=120)


async def terminated_by_each(
    client: Client, task_queue: str, workflow: str, body: Any, handler: Handler
) -> list[str]:
    """One workflow per terminate case: each ends Terminated, its reason bounded.

    Except an argument the SDK cannot decode: that signal is dropped (logged
    by the worker), the workflow runs on, and a valid terminate ends it.
    """
    slots = asyncio.Semaphore(8)

    async def one(case: Case) -> list[str]:
        what = f"{workflow} terminate with {case.what}"
        async with slots:
            target = await started(client, task_queue, workflow, body)
            await target.handle.signal("terminate", args=case.args)
            if any(isinstance(arg, RawValue) for arg in case.args):
                await wait_for(lambda: answers(target), f"{what} dropped", deadline=120)
                await target.handle.signal("terminate", REASON)
            try:
                result = await asyncio.wait_for(target.handle.result(), 120)
            except WorkflowFailureError as err:
                return [f"{what}: failed: {err.cause}"]
            problems = [f"{what}: {problem}" for problem in await failed(client, target)]
            if result["state"] != "Terminated" or len(result["reason"]) > MAX_REASON:
                problems.append(f"{what}: ended {json.dumps(result)[:200]}")
            return problems

    found = await asyncio.gather(*(one(case) for case in cases(handler)))
    return [problem for problems in found for problem in problems]


async def failed(client: Client, target: Target) -> list[str]:
    return await failed_tasks(client, target.handle.id, target.first_run_id)


async def test_a_running_pool_and_proxy_survive_every_hostile_message(
    temporal_env: WorkflowEnvironment, stack: Stack
) -> None:
    client = temporal_env.client
    proxy = await started(client, stack.task_queue, "ProxyLifecycle", stack.proxy_input())
    pool_input = {"replicas": 1, "template": stack.proxy_input(max_lifetime_seconds=3600)}
    pool = await started(client, stack.task_queue, "ProxyPool", pool_input)

    async def ready() -> bool:
        proxy_status = await proxy.handle.query("status")
        pool_status = await pool.handle.query("status")
        return bool(proxy_status["state"] == "Ready" and pool_status["ready"] == 1)

    await wait_for(ready, "the proxy and the pool's member Ready", deadline=120)
    pool.member = (await pool.handle.query("status"))["members"][0]["member"]

    await asyncio.gather(
        hostile_sequence(proxy, HANDLERS[ProxyLifecycle]),
        hostile_sequence(pool, HANDLERS[ProxyPool]),
    )
    problems = proxy.problems + pool.problems
    problems += await failed(client, proxy) + await failed(client, pool)
    assert not problems, "\n".join(problems)

    for target in (proxy, pool):
        await target.handle.signal("terminate", "hostile corpus done")
        assert (await asyncio.wait_for(target.handle.result(), 120))["state"] == "Terminated"
    await wait_for(lambda: stack.instances() == [], "every instance deleted")


async def test_terminate_ends_a_workflow_whatever_its_input(
    temporal_env: WorkflowEnvironment,
    worker_queue: str,  # noqa: F811
) -> None:
    """Each case its own workflow, on the memory worker: nothing to serve, nothing started."""
    client = temporal_env.client
    problems = await terminated_by_each(
        client, worker_queue, "ProxyLifecycle", LIFECYCLE_INPUT,
        HANDLERS[ProxyLifecycle]["terminate"],
    )  # fmt: skip
    empty_pool = {"replicas": 0, "template": LIFECYCLE_INPUT}
    problems += await terminated_by_each(
        client, worker_queue, "ProxyPool", empty_pool, HANDLERS[ProxyPool]["terminate"]
    )
    assert not problems, "\n".join(problems)


def test_placeholders_are_filled_and_the_valid_request_is_left_alone() -> None:
    handler = HANDLERS[ProxyPool]["member_changed"]
    before = copy.deepcopy(handler.valid)
    sent: dict[str, Any] = filled(handler.valid, "pool/0")
    assert handler.valid == before
    assert sent["member"] == "pool/0"
    assert datetime.fromisoformat(sent["at"]).tzinfo is not None
