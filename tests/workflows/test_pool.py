"""ProxyPool through the Temporal CLI, with the local provider and real Squids.

What an operator does: start a pool, read `endpoints` and curl through each,
scale up and down, report a ban, rotate everything, terminate. Every update
goes through `temporal workflow update execute`, every read through
`temporal workflow query`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from tests.helpers.config import PASSWORD, USERNAME
from tests.helpers.histories import record_history
from tests.helpers.stacks import Stack, StackOn
from tests.helpers.temporal import start_dev_server
from tests.helpers.waiting import QUICK_HEARTBEAT, wait_for
from tests.helpers.worker_process import (  # noqa: F401 (fixtures)
    LocalWorker,
    local_worker,
    origin,
    worker_process,
)
from tests.workflows.test_cli import curl, temporal

pytestmark = pytest.mark.slow


class PoolCli:
    """One pool, driven only through the CLI."""

    def __init__(self, env: WorkflowEnvironment, stack: Stack) -> None:
        self.env = env
        self.stack = stack
        self.id = f"pool-{uuid.uuid4().hex[:8]}"

    async def start(self, body: dict[str, Any]) -> None:
        started = await temporal(
            self.env, "workflow", "start", "--type", "ProxyPool",
            "--task-queue", self.stack.task_queue, "--workflow-id", self.id,
            "--input", json.dumps(body),
        )  # fmt: skip
        assert started.returncode == 0, started.stderr

    async def query(self, name: str, body: Any = None) -> Any:
        code, out = await self.try_query(name, body)
        assert code == 0, out
        return json.loads(out)["queryResult"][0]

    async def try_query(self, name: str, body: Any = None) -> tuple[int, str]:
        """(exit code, stdout + stderr) of `temporal workflow query`, with `body` as its input."""
        given = () if body is None else ("--input", json.dumps(body))
        out = await temporal(
            self.env, "workflow", "query", "--workflow-id", self.id, "--name", name,
            "-o", "json", *given,
        )  # fmt: skip
        return out.returncode, out.stdout + out.stderr

    async def update(self, name: str, body: dict[str, Any]) -> tuple[int, str]:
        """(exit code, stdout + stderr) of `temporal workflow update execute`."""
        out = await temporal(
            self.env, "workflow", "update", "execute", "--workflow-id", self.id,
            "--name", name, "--input", json.dumps(body),
        )  # fmt: skip
        return out.returncode, out.stdout + out.stderr

    async def wait_ready(self, count: int) -> dict[str, Any]:
        seen: list[dict[str, Any]] = []

        async def check() -> bool:
            seen.append(await self.query("status"))
            status = seen[-1]
            return bool(
                status["ready"] == count
                and len(status["members"]) == count
                and all(m["state"] == "Ready" for m in status["members"])
            )

        try:
            await wait_for(check, f"{count} Ready members", deadline=90)
        except AssertionError as err:
            raise AssertionError(f"{err}; last status: {seen[-1] if seen else None}") from None
        return seen[-1]

    def pool_input(self, replicas: int, **overrides: Any) -> dict[str, Any]:
        return {"replicas": replicas, "template": self.stack.proxy_input(), **overrides}


@pytest.fixture
def pool(temporal_env: WorkflowEnvironment, stack: Stack) -> PoolCli:
    return PoolCli(temporal_env, stack)


async def test_a_pool_serves_scales_bans_rotates_and_terminates(
    pool: PoolCli, stack: Stack, tmp_path: Path
) -> None:
    await pool.start(pool.pool_input(3))
    status = await pool.wait_ready(3)
    assert status["state"] == "Ready"
    members = [m["member"] for m in status["members"]]
    assert members == [f"{pool.id}/{n}" for n in range(3)]

    # Every endpoint a scraper reads works, with the fleet's credentials.
    endpoints = await pool.query("endpoints")
    assert [e["member"] for e in endpoints] == members
    assert all(e["provider"] == "local" for e in endpoints)
    cacert = tmp_path / "ca.pem"
    stack.origin.ca.cert_pem.write_to_path(str(cacert))
    for entry in endpoints:
        reply = await curl(entry["endpoint"], stack.origin.url, cacert, f"{USERNAME}:{PASSWORD}")
        assert reply == ("200", "200")
    # A member's history says which pool started it.
    described = await temporal(pool.env, "workflow", "describe", "--workflow-id", members[0])
    assert pool.id in described.stdout

    code, out = await pool.update("scale", {"replicas": 5})
    assert code == 0, out
    whole = await pool.wait_ready(5)
    assert len(stack.instances()) == 5
    # `status` a page at a time: each page's `next_page` is the next query's input.
    paged, request = [], {"limit": 2}
    while request is not None:
        page = await pool.query("status", request)
        assert page["members_total"] == 5 and len(page["members"]) <= 2
        paged += [m["member"] for m in page["members"]]
        request = page["next_page"]
    assert paged == [m["member"] for m in whole["members"]]
    assert whole["next_page"] is None, "a pool no larger than a page answers whole"
    code, out = await pool.try_query("status", {"limit": 0})
    assert code != 0 and "invalid status request: limit:" in out, out

    # Down to 2: the oldest go, the two newest stay.
    code, out = await pool.update("scale", {"replicas": 2})
    assert code == 0, out
    status = await pool.wait_ready(2)
    kept = [m["member"] for m in status["members"]]
    assert kept == [f"{pool.id}/3", f"{pool.id}/4"]
    await wait_for(lambda: len(stack.instances()) == 2, "the removed members' Squids gone")

    # A ban takes that member out of endpoints at once, then rotates it alone.
    before = {e["member"]: e["endpoint"] for e in await pool.query("endpoints")}
    banned = kept[0]
    code, out = await pool.update("report_ban", {"member": banned, "reason": "403 from shop"})
    assert code == 0, out
    assert banned not in {e["member"] for e in await pool.query("endpoints")}
    # The same ban again is accepted and changes nothing (idempotent). It names
    # the endpoint it was seen on, as a client would: with local Squids the
    # member may be back on a new instance already, and a ban without the
    # endpoint would then be a new one, over the limit.
    again = {"member": banned, "reason": "403 again", "endpoint": before[banned]}
    code, out = await pool.update("report_ban", again)
    assert code == 0, out

    async def ban_served() -> bool:
        now = {e["member"]: e["endpoint"] for e in await pool.query("endpoints")}
        return banned in now and now[banned] != before[banned]

    await wait_for(ban_served, "the banned member back with a new instance", deadline=60)
    after = {e["member"]: e["endpoint"] for e in await pool.query("endpoints")}
    assert after[kept[1]] == before[kept[1]]  # the other member was not touched
    # The ban limit (a quarter of 2 replicas, at least 1, per 10 minutes) is spent.
    code, out = await pool.update("report_ban", {"member": kept[1], "reason": "again"})
    assert code != 0 and "ban rate limit" in out, out
    # `status` shows the limit and when the next ban is accepted, as the refusal says.
    bans = (await pool.query("status"))["bans"]
    assert {k: bans[k] for k in ("limit", "window_seconds", "accepted")} == {
        "limit": 1,
        "window_seconds": 600,
        "accepted": 1,
    }, bans
    assert f"accepted from {bans['next_accepted_at']}" in out, (bans, out)

    # Rotate all: rolling, make before break, never fewer than 2 Ready.
    code, out = await pool.update("rotate", {"all": True})
    assert code == 0, out
    generations = {m["member"]: m["generation"] for m in (await pool.query("status"))["members"]}
    ready_seen: list[int] = []

    async def all_rotated() -> bool:
        status = await pool.query("status")
        ready_seen.append(status["ready"])
        return all(m["generation"] > generations[m["member"]] for m in status["members"]) and (
            status["ready"] == 2
        )

    await wait_for(all_rotated, "every member rotated", deadline=90)
    assert min(ready_seen) >= 2, ready_seen
    await wait_for(lambda: len(stack.instances()) == 2, "the rotated-out Squids gone")

    sent = await temporal(
        pool.env, "workflow", "signal", "--workflow-id", pool.id, "--name", "terminate"
    )
    assert sent.returncode == 0, sent.stderr
    handle = pool.env.client.get_workflow_handle(pool.id)
    result = await handle.result()
    assert result["state"] == "Terminated"
    assert stack.instances() == []
    for member in kept:
        member_result = await pool.env.client.get_workflow_handle(member).result()
        assert member_result["state"] == "Terminated"
    await record_history(handle, "pool_scaled_banned_rotated_terminated")
    # A member's history: banned, rotated twice, terminated by its pool.
    await record_history(pool.env.client.get_workflow_handle(kept[0]), "pool_member")


async def test_a_member_reported_again_while_banned_is_a_no_op(stack: Stack) -> None:
    """A second ban of a member still out of rotation changes nothing and spends no budget.

    The replacement's create is held, so the member stays banned for certain;
    the ban limit of a 2-member pool is 1, so a second ban that counted would
    be refused.
    """
    pool = await stack.start_pool(2)

    async def ready() -> bool:
        return bool((await pool.query("status"))["ready"] == 2)

    await wait_for(ready, "both members Ready")
    stack.provider.create_gate.clear()
    try:
        member = f"{pool.id}/0"
        first = await pool.execute_update("report_ban", {"member": member, "reason": "403"})
        again = await pool.execute_update("report_ban", {"member": member, "reason": "403 again"})

        assert first == {"member": member, "banned": True, "already": False}
        assert again == {"member": member, "banned": False, "already": True}
        assert member not in {e["member"] for e in await pool.query("endpoints")}
        (status,) = [m for m in (await pool.query("status"))["members"] if m["member"] == member]
        assert status["banned"] == "403", "the first reason stands"
    finally:
        stack.provider.create_gate.set()
    await pool.signal("terminate")
    assert (await pool.result())["state"] == "Terminated"
    await wait_for(lambda: stack.instances() == [], "every member's instance gone")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, ["replicas: field required", "template: field required"]),
        (
            {"replicas": -1, "template": {"provider": "local"}},
            ["replicas: input should be greater"],
        ),
        ({"replicas": 2, "template": {}}, ["template.provider: field required"]),
        (
            {"replicas": 2, "template": {"provider": "nowhere", "port": 0}},
            ["template.port: input should be greater", "template.provider"],
        ),
        (
            {"replicas": 2, "template": {"provider": "nowhere"}, "max_surge": 0},
            ["max_surge: must be a count from 1", "template.provider: unknown provider"],
        ),
        (
            {
                "replicas": 2,
                "template": {"provider": "local"},
                "spread": [{"provider": "elsewhere"}],
            },
            ["spread.0.provider: unknown provider 'elsewhere'"],
        ),
        (
            {"replicas": 2, "template": {"provider": "local"}, "lifetime_jitter": 2, "colour": 1},
            ["lifetime_jitter: input should be less", "colour: unknown field"],
        ),
        (
            {
                "replicas": 2,
                "template": {"provider": "local", "placement": {"subnet": "subnet-../x"}},
                "exit_echo_url": "http://checkip.example/",
                "distinct_exits": "yes",
            },
            [
                "exit_echo_url:",
                "must be an https:// URL",
                "distinct_exits:",
                "template.placement.subnet:",
            ],
        ),
        ([1, 2], ["input: expected a JSON object"]),
    ],
)
async def test_bad_pool_input_fails_fast_naming_each_field(
    pool: PoolCli, stack: Stack, body: Any, expected: list[str]
) -> None:
    started = await temporal(
        pool.env, "workflow", "start", "--type", "ProxyPool", "--task-queue", stack.task_queue,
        "--workflow-id", pool.id, "--input", json.dumps(body),
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    with pytest.raises(WorkflowFailureError) as failure:
        await pool.env.client.get_workflow_handle(pool.id).result()
    message = str(failure.value.cause)
    for fragment in expected:
        assert fragment in message
    assert stack.provider.calls["create"] == 0


async def test_updates_reject_bad_requests_before_acceptance(pool: PoolCli, stack: Stack) -> None:
    await pool.start(pool.pool_input(1))
    await pool.wait_ready(1)
    handle = pool.env.client.get_workflow_handle(pool.id)
    events_before = len((await handle.fetch_history()).events)
    rejected = [
        ("scale", {"replicas": "3"}, "replicas: input should be a valid integer"),
        ("scale", {"replicas": 5000}, "replicas: input should be less"),
        ("scale", {}, "replicas: field required"),
        ("rotate", {}, 'give either "member"'),
        ("rotate", {"member": f"{pool.id}/0", "all": True}, 'give either "member"'),
        ("rotate", {"member": "someone-else/0"}, "no member 'someone-else/0'"),
        ("report_ban", {"member": f"{pool.id}/9"}, "no member"),
        ("report_ban", {"reason": "x"}, "member: field required"),
        ("report_ban", {"member": f"{pool.id}/0", "reason": "x" * 600}, "reason:"),
        # A fixed pool takes no bounds, demand or wake (test_pool_autoscale_e2e.py).
        ("scale", {"max_replicas": 3}, "replicas: field required (this pool is not autoscaled"),
        ("report_demand", {"gateway": "gw", "open_tunnels": 5}, "this pool is not autoscaled"),
        ("wake", {"gateway": "gw"}, "this pool is not autoscaled"),
    ]
    for name, body, fragment in rejected:
        code, out = await pool.update(name, body)
        assert code != 0 and fragment in out, (name, body, out)
    # Rejected before acceptance: nothing of them is in the history.
    assert len((await handle.fetch_history()).events) == events_before
    status = await pool.query("status")
    assert status["replicas"] == 1 and status["members"][0]["generation"] == 0
    await handle.signal("terminate")
    await handle.result()
    assert stack.instances() == []


@pytest.fixture
async def own_server() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server of the test's own.

    A sweep ends the running members of every closed pool in the namespace,
    and on the session's server an earlier test may have left some: a test's
    worker stops at its end, whatever its workflows were still doing.
    """
    env = await start_dev_server()
    yield env
    await env.shutdown()


async def test_orphan_gc_ends_the_members_of_a_hard_terminated_pool(
    own_server: WorkflowEnvironment, stack_on: StackOn
) -> None:
    stack = await stack_on(own_server)
    pool = PoolCli(own_server, stack)
    await pool.start(pool.pool_input(2))
    status = await pool.wait_ready(2)
    members = [pool.env.client.get_workflow_handle(m["member"]) for m in status["members"]]
    # `temporal workflow terminate` runs no pool code: the members live on.
    out = await temporal(pool.env, "workflow", "terminate", "--workflow-id", pool.id)
    assert out.returncode == 0, out.stderr
    assert len(stack.instances()) == 2
    # A dry run reports them and ends nothing; within the grace period, nothing either.
    for body in ({"dry_run": True, "grace_period_seconds": 0}, {"grace_period_seconds": 3600}):
        result = await _orphan_gc(pool, stack, body)
        expected = [m.id for m in members] if body.get("dry_run") else []
        assert result["pool_members_ended"] == expected
    assert len(stack.instances()) == 2
    result = await _orphan_gc(pool, stack, {"grace_period_seconds": 0})
    assert result["pool_members_ended"] == [m.id for m in members]
    for member in members:
        assert (await member.result())["state"] == "Terminated"
    assert stack.instances() == []


async def _orphan_gc(pool: PoolCli, stack: Stack, body: dict[str, Any]) -> Any:
    gc_id = f"orphan-gc-{uuid.uuid4().hex[:8]}"
    started = await temporal(
        pool.env, "workflow", "execute", "--type", "OrphanGC", "--task-queue", stack.task_queue,
        "--workflow-id", gc_id, "--input", json.dumps({**body, "providers": ["local"]}),
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    return await pool.env.client.get_workflow_handle(gc_id).result()


async def test_a_worker_killed_mid_scale_converges_with_no_duplicate_and_no_leak(
    temporal_env: WorkflowEnvironment,
    local_worker: LocalWorker,  # noqa: F811
    state_dir: Path,
) -> None:
    origin_port, task_queue = local_worker.origin_port, local_worker.task_queue
    worker = local_worker.process
    assert worker is not None
    client = temporal_env.client
    # The pool's monitor dies with the worker; the pool's end waits for it
    # to be found lost (its heartbeat timeout), so the shortest one.
    health = {"target": f"https://127.0.0.1:{origin_port}/"} | QUICK_HEARTBEAT
    template = {"provider": "local", "health": health}
    handle = await client.start_workflow(
        "ProxyPool",
        {"replicas": 2, "template": template},
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
    )

    async def ready(count: int) -> bool:
        status = await handle.query("status")
        return bool(status["ready"] == count and len(status["members"]) == count)

    await wait_for(lambda: ready(2), "2 Ready", deadline=90)
    # The update waits for a workflow task; on a busy machine that outlasts the default RPC timeout.
    await handle.execute_update("scale", {"replicas": 5}, rpc_timeout=timedelta(minutes=3))

    async def scaling() -> bool:
        return len((await handle.query("status"))["members"]) > 2

    await wait_for(scaling, "the scale under way")
    worker.kill()  # kill -9, mid-scale
    await asyncio.to_thread(worker.wait, 30)
    local_worker.restart()
    await wait_for(lambda: ready(5), "5 Ready after the worker's loss", deadline=240)
    status = await handle.query("status")
    members = [m["member"] for m in status["members"]]
    assert members == [f"{handle.id}/{n}" for n in range(5)]  # no member started twice
    instances = {(await client.get_workflow_handle(m).query("status"))["instance"] for m in members}

    def on_disk() -> set[str]:
        return {p.name for p in state_dir.iterdir() if p.is_dir()}

    # One instance per member, and nothing else left running.
    await wait_for(lambda: on_disk() == instances, "exactly the members' instances on disk")
    assert len(instances) == 5
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"
    assert on_disk() == set()


@pytest.mark.parametrize("pool_id", ["pool with space", "pool'quote", "-starts-with-dash"])
async def test_a_pool_id_that_would_need_quoting_is_refused(
    temporal_env: WorkflowEnvironment, stack: Stack, pool_id: str
) -> None:
    handle = await temporal_env.client.start_workflow(
        "ProxyPool",
        {"replicas": 1, "template": stack.proxy_input()},
        id=pool_id,
        task_queue=stack.task_queue,
    )
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert "workflow id: a pool's id must be" in str(failure.value.cause)
    assert stack.provider.calls["create"] == 0
