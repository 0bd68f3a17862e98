"""A worker SIGKILLed while it monitors a proxy: another worker monitors it, same instance.

The server notices the lost worker only at the monitor's heartbeat timeout
(4.5 minutes by default, docs/cost.md; this proxy chooses the shortest, 30 s);
the retry then runs on the surviving worker, which must truly watch the
proxy: when the proxy dies afterwards, it is replaced. A terminate in that
meantime does not wait for the lost monitor's timeout. Real `python
worker.py` processes, real Squid.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.helpers.procfs import squid_pids
from tests.helpers.waiting import DEADLINE, wait_for, wait_status
from tests.helpers.worker_process import (  # noqa: F401 (fixtures)
    LocalWorker,
    local_worker,
    origin,
    worker_process,
)
from workflows.inputs import MIN_HEARTBEAT_TIMEOUT_SECONDS
from workflows.lifecycle_carried import ProxyStatus
from workflows.policies import MONITOR

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = MIN_HEARTBEAT_TIMEOUT_SECONDS
# The heartbeat timeout, the retry and the new attempt's pick-up, with room
# for a machine whose cores are busy.
RESUMED_WITHIN = HEARTBEAT_TIMEOUT + 120


async def monitor_worker(handle: WorkflowHandle[Any, Any], kind: str = "monitor") -> str | None:
    """The identity of the worker running the workflow's monitor now, if one runs it."""
    description = await handle.describe()
    for pending in description.raw_description.pending_activities:
        if (
            pending.activity_type.name == kind
            and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
        ):
            return pending.last_worker_identity
    return None


def identity(pid: int) -> str:
    """The SDK's default worker identity."""
    return f"{pid}@{os.uname().nodename}"


async def _ready_then_worker_killed(
    temporal_env: WorkflowEnvironment,
    local_worker: LocalWorker,  # noqa: F811
    health: dict[str, Any],
) -> tuple[WorkflowHandle[Any, Any], ProxyStatus]:
    """A proxy Ready and monitored on the first worker, which is then SIGKILLed and restarted."""
    first = local_worker.process
    assert first is not None
    target = f"https://127.0.0.1:{local_worker.origin_port}/"
    handle = await temporal_env.client.start_workflow(
        "ProxyLifecycle",
        {"provider": "local", "health": {"target": target, "interval_seconds": 2, **health}},
        id=f"proxy-{uuid.uuid4().hex[:10]}",
        task_queue=local_worker.task_queue,
    )
    ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready", deadline=120)

    async def monitored_by_first() -> bool:
        return await monitor_worker(handle) == identity(first.pid)

    await wait_for(monitored_by_first, "the monitor running on the first worker", 60)
    first.kill()  # SIGKILL: no drain, no goodbye to the server
    await asyncio.to_thread(first.wait)
    local_worker.restart()
    return handle, ready


async def test_a_killed_monitor_worker_is_replaced_by_another_that_watches_the_same_instance(
    temporal_env: WorkflowEnvironment,
    local_worker: LocalWorker,  # noqa: F811
    state_dir: Path,
) -> None:
    handle, ready = await _ready_then_worker_killed(
        temporal_env, local_worker, {"heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT}
    )
    second = local_worker.process
    assert second is not None

    async def monitored_by_second() -> bool:
        return await monitor_worker(handle) == identity(second.pid)

    await wait_for(monitored_by_second, "the monitor running on the second worker", RESUMED_WITHIN)
    still = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    assert (still.instance, still.generation) == (ready.instance, 0), "the instance was replaced"

    # The new monitor watches: the proxy dies, and is replaced.
    pid = json.loads((state_dir / ready.instance / "instance.json").read_text())["pid"]
    os.kill(int(pid), signal.SIGKILL)
    replaced = await wait_status(
        handle, lambda s: s.state == "Ready" and s.generation == 1, "replaced", deadline=120
    )
    assert replaced.replacements == 1
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"


async def test_a_proxy_terminated_after_its_monitors_worker_was_killed_closes_once_it_is_gone(
    temporal_env: WorkflowEnvironment,
    local_worker: LocalWorker,  # noqa: F811
    state_dir: Path,
) -> None:
    # The default heartbeat timeout, 270 s: the lost monitor ends only then.
    handle, _ = await _ready_then_worker_killed(temporal_env, local_worker, {})
    await handle.signal("terminate")

    await wait_for(lambda: squid_pids(state_dir) == [], "the instance deleted", DEADLINE)
    # Closed well before the lost monitor's heartbeat timeout ends it.
    assert MONITOR.heartbeat is not None
    closing = MONITOR.heartbeat.total_seconds() / 2
    result = await asyncio.wait_for(handle.result(), timeout=closing)
    assert result["state"] == "Terminated"
    assert squid_pids(state_dir) == []
    left = await asyncio.to_thread(lambda: [p for p in state_dir.iterdir() if p.is_dir()])
    assert not left, "the instance's state is left"


async def test_a_killed_worker_running_a_pools_monitor_is_replaced_by_another(
    temporal_env: WorkflowEnvironment,
    local_worker: LocalWorker,  # noqa: F811
) -> None:
    first = local_worker.process
    assert first is not None
    health = {
        "target": f"https://127.0.0.1:{local_worker.origin_port}/",
        "interval_seconds": 2,
        "heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT,
    }
    pool = await temporal_env.client.start_workflow(
        "ProxyPool",
        {"replicas": 1, "template": {"provider": "local", "health": health}},
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=local_worker.task_queue,
    )

    async def watched_by_first() -> bool:
        return await monitor_worker(pool, "monitor_members") == identity(first.pid)

    await wait_for(watched_by_first, "the pool's monitor running on the first worker", 120)
    first.kill()
    await asyncio.to_thread(first.wait)
    second = local_worker.restart()

    async def watched_by_second() -> bool:
        return await monitor_worker(pool, "monitor_members") == identity(second.pid)

    await wait_for(watched_by_second, "the pool's monitor on the second worker", RESUMED_WITHIN)
    await pool.signal("terminate")
    await pool.result()
