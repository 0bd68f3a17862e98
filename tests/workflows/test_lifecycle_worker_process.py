"""ProxyLifecycle through `python worker.py` processes: clean ends, and a worker lost mid-create.

The worker runs as an operator runs it, its log captured from its stdout and
stderr (Python's logging and the SDK Core's Rust log both go there), so what
the tests read is what an operator would see.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.fakes.kubernetes import FakeKubernetes
from tests.helpers.config import lifecycle_instance_name
from tests.helpers.network import free_port
from tests.helpers.squid_upstream import SquidUpstreams, requires_squid
from tests.helpers.waiting import pending_activities, wait_for, wait_status
from tests.helpers.worker_process import (  # noqa: F401 (fixtures)
    WORKER_INSTALLATION,
    LocalWorker,
    StartWorker,
    local_worker,
    origin,
    worker_process,
    write_worker_config,
)
from tests.workflows.test_lifecycle_kubernetes import NAMESPACE, PROVIDER, Kubelet

pytestmark = pytest.mark.slow

INSTALLATION = WORKER_INSTALLATION

# What a clean end never leaves in the worker's log: the SDK Core's warning
# for an activity completing after its workflow closed, the SDK's warning for
# an activity failed by a cancel it did not ask for, any traceback, and
# asyncio's report of an activity's failure nobody awaited.
NOISE = (
    "WARN",
    "WARNING",
    "ERROR",
    "Traceback",
    "Activity not found on completion",
    "Completing activity as failed",
    "exception was never retrieved",
)


async def start_proxy(
    client: Client, task_queue: str, provider: str, origin_port: int, **overrides: Any
) -> WorkflowHandle[Any, Any]:
    body = {
        "provider": provider,
        "health": {"target": f"https://127.0.0.1:{origin_port}/", "interval_seconds": 1},
        **overrides,
    }
    return await client.start_workflow(
        "ProxyLifecycle", body, id=f"proxy-{uuid.uuid4().hex[:10]}", task_queue=task_queue
    )


async def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    await asyncio.to_thread(process.wait, 60)


async def test_terminate_cancel_and_rotation_leave_nothing_pending_and_nothing_in_the_log(
    temporal_env: WorkflowEnvironment,
    local_worker: LocalWorker,  # noqa: F811
    state_dir: Path,
    tmp_path: Path,
) -> None:
    origin_port, task_queue = local_worker.origin_port, local_worker.task_queue
    client = temporal_env.client

    # A max-lifetime rotation, then a terminate while the new instance is monitored.
    rotated = await start_proxy(client, task_queue, "local", origin_port, max_lifetime_seconds=10)
    first = await wait_status(rotated, lambda s: s.state == "Ready", "Ready")
    await wait_status(
        rotated, lambda s: s.state == "Ready" and s.generation == 1, "a rotation", deadline=120
    )
    await wait_for(lambda: not (state_dir / first.instance).exists(), "the old instance deleted")
    await rotated.signal("terminate", {"reason": "log test"})
    assert (await rotated.result())["state"] == "Terminated"
    assert await pending_activities(rotated) == []

    # A cancel while Ready.
    cancelled = await start_proxy(client, task_queue, "local", origin_port)
    await wait_status(cancelled, lambda s: s.state == "Ready", "Ready")
    await cancelled.cancel()
    with pytest.raises(WorkflowFailureError):
        await cancelled.result()
    assert await pending_activities(cancelled) == []

    # A terminate while the first probe is still failing: nothing listens on
    # 127.0.0.2, so Squid answers every CONNECT with an error.
    unreachable = {"target": f"https://127.0.0.2:{origin_port}/", "interval_seconds": 1}
    refused = await start_proxy(client, task_queue, "local", origin_port, health=unreachable)
    await wait_status(refused, lambda s: s.last_probe is not None, "a failed first probe")
    await refused.signal("terminate")
    await refused.result()
    assert await pending_activities(refused) == []

    # The log is complete once the worker has drained and exited.
    assert local_worker.process is not None
    await stop(local_worker.process)
    log = (tmp_path / "worker-0.log").read_text()
    assert "worker on task queue" in log
    noisy = [line for line in log.splitlines() if any(word in line for word in NOISE)]
    assert noisy == [], "\n".join(noisy)
    assert await asyncio.to_thread(lambda: [p for p in state_dir.iterdir() if p.is_dir()]) == []


@requires_squid
async def test_a_worker_killed_mid_create_is_replaced_by_a_retry_that_adopts_the_pod(
    temporal_env: WorkflowEnvironment,
    worker_process: StartWorker,  # noqa: F811
    origin: tuple[int, dict[str, str]],  # noqa: F811
    squid_upstreams: SquidUpstreams,
    tmp_path: Path,
) -> None:
    """kill -9 while the create blocks: the Pod exists, its Secret POST hangs.

    The create heartbeats, so the server notices the lost worker within the
    heartbeat timeout (20 s) instead of the 10-minute start-to-close, and the
    retry on the next worker adopts the Pod the first attempt made.
    """
    origin_port, env = origin
    with FakeKubernetes(namespaces=(NAMESPACE,)) as fake:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
                    "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                    "current-context": "fake",
                }
            )
        )
        entry = {"name": PROVIDER, "type": "kubernetes", "kubernetes": {"namespace": NAMESPACE}}
        config = write_worker_config(tmp_path / "providers.yaml", entry, origin_port, INSTALLATION)
        env = {**env, "KUBECONFIG": str(kubeconfig)}
        task_queue = f"test-{uuid.uuid4().hex[:12]}"
        kubelet = Kubelet(fake, squid_upstreams, free_port())
        fake.fail("POST", r"/secrets$", 503, delay=120)  # the first Secret POST hangs

        first = worker_process(config, task_queue, env)
        handle = await start_proxy(
            temporal_env.client, task_queue, PROVIDER, origin_port, port=kubelet.port
        )
        name = lifecycle_instance_name(handle.id, 0, installation=INSTALLATION)
        await wait_for(lambda: kubelet.pod(name) is not None, "the first attempt's pod")
        first.kill()  # SIGKILL: no drain, no goodbye to the server
        await asyncio.to_thread(first.wait)

        second = worker_process(config, task_queue, env)
        await kubelet.run_pod(name)
        ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready", deadline=120)
        assert (ready.instance, ready.generation, ready.replacements) == (name, 0, 0)
        assert (
            kubelet.pod(lifecycle_instance_name(handle.id, 1, installation=INSTALLATION)) is None
        ), "a second pod was made"
        attempts = [
            event.activity_task_started_event_attributes.attempt
            async for event in handle.fetch_history_events()
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
        ]
        assert attempts[0] == 2, "the create was retried, not created again"

        await handle.signal("terminate")
        await kubelet.finish_deletion(name)
        assert (await handle.result())["state"] == "Terminated"
        await stop(second)
        assert kubelet.pod(name) is None
