"""Owners without a worker: real ProxyLifecycle executions that nothing runs.

`start_owner` makes an execution whose search attributes, set at start, say
which instances it owns, exactly as a running lifecycle publishes them. With
the `memory` provider it lets orphan GC run against real Temporal visibility
and describe without a Squid per instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from contract import ENDPOINT, INSTANCES, PROVIDER, STATE
from contract import PROXY_LIFECYCLE as WORKFLOW_TYPE


async def start_owner(
    client: Client,
    workflow_id: str,
    *,
    provider: str,
    instances: Sequence[str],
    task_queue: str,
    state: str | None = "Ready",
    endpoint: str | None = None,
    **options: Any,
) -> WorkflowHandle[Any, Any]:
    """A running ProxyLifecycle that owns `instances`, as visibility and describe see it.

    No worker polls `task_queue`, so it stays running with exactly these
    search attributes until the test terminates it. `state=None` stands for
    a run whose first task has not run yet: a lifecycle publishes its state
    and instances together, in that task. `endpoint`: where a Ready one serves.
    """
    pairs: list[SearchAttributePair[Any]] = [
        SearchAttributePair(PROVIDER, provider),
        SearchAttributePair(INSTANCES, list(instances)),
    ]
    if state is not None:
        pairs.append(SearchAttributePair(STATE, state))
    if endpoint is not None:
        pairs.append(SearchAttributePair(ENDPOINT, endpoint))
    return await client.start_workflow(
        WORKFLOW_TYPE,
        {"provider": provider},
        id=workflow_id,
        task_queue=task_queue,
        search_attributes=TypedSearchAttributes(pairs),
        **options,
    )
