"""The monitor activity's heartbeat clock holds while a probe hangs.

The monitor heartbeats rarely (a minute before its heartbeat timeout, to keep
Temporal Cloud actions down), so a heartbeat that waited for a probe would
time the monitor out: the server would take the worker for dead and run the
monitor again elsewhere. Here the proxy is a real listener that accepts the
CONNECT's TCP connection and never answers, so each real probe hangs until
its timeout; heartbeats must go on meanwhile, and the failed probe still
ends the monitor as unhealthy.

The pool's monitor shards (`monitor_members`) are tested here too: that they
name every member that keeps failing, and that a shard its pool no longer
wants (its run continued as new, or cancelled it) ends after its next round
rather than at a heartbeat that rare.
"""

from __future__ import annotations

import asyncio
import socket
import socketserver
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from temporalio import workflow
from temporalio.activity import ActivityCancellationDetails
from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ActivityError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker
from temporalio.workflow import ActivityCancellationType

from activities.models import (
    InstanceRef,
    MonitorInput,
    MonitorReason,
    PoolMonitorInput,
    WatchedMember,
)
from activities.provider import ProviderActivities
from providers.memory import MemoryProvider
from tests.helpers.config import build_config, local_entry
from tests.helpers.waiting import DEADLINE, wait_for
from workflows import policies

# A probe hangs this long (its timeout); the heartbeat clock beats every
# second meanwhile (half of HEARTBEAT_TIMEOUT, which is under twice the slack).
PROBE_TIMEOUT_SECONDS = 8.0
HEARTBEAT_TIMEOUT = timedelta(seconds=2)


class _Silent(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.settimeout(None)
        try:
            self.request.recv(65536)  # the CONNECT, never answered
            self.request.recv(1)  # held until the client gives up
        except OSError:
            pass


class _Tarpit(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def silent_proxy() -> Iterator[int]:
    """A port that accepts connections and never says a word."""
    with _Tarpit(("127.0.0.1", 0), _Silent) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server.server_address[1]
        server.shutdown()


async def test_a_hanging_probe_does_not_stall_the_heartbeats(
    silent_proxy: int, tmp_path: Any
) -> None:
    provider = MemoryProvider()
    instance = provider.add("test", "hanging-proxy", 0)
    config = build_config(local_entry(tmp_path), connect_ports=[443])
    activities = ProviderActivities({"memory": provider}, config)
    env = ActivityEnvironment()
    env.info = replace(env.info, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    beats: list[Any] = []
    env.on_heartbeat = lambda *details: beats.append(details[0])
    ref = InstanceRef(
        "memory", instance.provider_id, instance.name, 0, ip="127.0.0.1", port=silent_proxy
    )
    try:
        outcome = await env.run(
            activities.monitor,
            MonitorInput(
                ref,
                "https://example.com/",
                interval_seconds=1,
                failure_threshold=1,
                max_duration_seconds=3600,
                probe_timeout_seconds=PROBE_TIMEOUT_SECONDS,
            ),
        )
    finally:
        activities.close()
    assert outcome.reason is MonitorReason.UNHEALTHY, outcome
    assert outcome.last_probe is not None and not outcome.last_probe.ok
    # Beats while the one probe hung: none had a probe to show yet.
    during = [b for b in beats if b["last_probe"] is None]
    assert len(during) >= 3, f"{len(during)} heartbeats in an {PROBE_TIMEOUT_SECONDS:g} s hang"


def test_the_silent_proxy_really_is_silent(silent_proxy: int) -> None:
    with socket.create_connection(("127.0.0.1", silent_proxy), timeout=5) as conn:
        conn.sendall(b"CONNECT example.com:443 HTTP/1.1\r\n\r\n")
        conn.settimeout(1)
        with pytest.raises(TimeoutError):
            conn.recv(1)


def _shard(silent_port: int, closed_port: int) -> PoolMonitorInput:
    return PoolMonitorInput(
        [
            WatchedMember("pool/0", "memory", f"127.0.0.1:{silent_port}"),
            WatchedMember("pool/1", "memory", f"127.0.0.1:{closed_port}"),
            WatchedMember("pool/2", "memory", "not an endpoint"),
        ],
        "https://example.com/",
        interval_seconds=0.5,
        failure_threshold=2,
        max_duration_seconds=3600,
        probe_timeout_seconds=1.0,
    )


def _closed_port() -> int:
    """A port nothing listens on: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_pool_shard_names_every_member_that_keeps_failing(
    silent_proxy: int, tmp_path: Any
) -> None:
    config = build_config(local_entry(tmp_path), connect_ports=[443])
    activities = ProviderActivities({"memory": MemoryProvider()}, config)
    env = ActivityEnvironment()
    env.info = replace(env.info, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    try:
        outcome = await env.run(activities.monitor_members, _shard(silent_proxy, _closed_port()))
    finally:
        activities.close()
    assert outcome.reason is MonitorReason.UNHEALTHY, outcome
    failing = {f.member: f for f in outcome.failing}
    assert sorted(failing) == ["pool/0", "pool/1", "pool/2"]
    assert "timeout" in failing["pool/0"].detail and "refused" in failing["pool/1"].detail
    assert failing["pool/2"].endpoint == "not an endpoint"
    assert all(f.detail.startswith("2 failed probes in a row") for f in failing.values())


@pytest.mark.parametrize(
    ("details", "quiet"),
    [
        (ActivityCancellationDetails(not_found=True), True),
        (ActivityCancellationDetails(cancel_requested=True), False),
    ],
)
async def test_a_pool_shard_whose_run_is_gone_ends_quietly_a_cancelled_one_does_not(
    silent_proxy: int, tmp_path: Any, details: ActivityCancellationDetails, quiet: bool
) -> None:
    """A pool that continued as new left its shards behind: they return, and log nothing."""
    config = build_config(local_entry(tmp_path), connect_ports=[443])
    activities = ProviderActivities({"memory": MemoryProvider()}, config)
    env = ActivityEnvironment()
    env.info = replace(env.info, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    # A heartbeat after a round of probes: the shard is at work when cancelled.
    probed = asyncio.Event()
    env.on_heartbeat = lambda *beat: probed.set() if beat[0]["round"] else None
    shard = replace(_shard(silent_proxy, _closed_port()), failure_threshold=100)
    running = asyncio.ensure_future(env.run(activities.monitor_members, shard))
    try:
        await asyncio.wait_for(probed.wait(), 30)
        assert not running.done()  # the threshold is far off
        env.cancel(details)
        if quiet:
            outcome = await running
            assert outcome.reason is MonitorReason.HANDOVER
        else:
            with pytest.raises(BaseException):  # noqa: B017 (CancelledError, either kind)
                await running
    finally:
        activities.close()


async def test_a_pool_shard_left_behind_by_a_handover_ends_after_its_next_round(
    silent_proxy: int, tmp_path: Any, temporal_env: WorkflowEnvironment
) -> None:
    """A handover's cancel reaches a shard only with a heartbeat's reply, up to
    a minute later; meanwhile the next run's shards probe the same members.
    So a shard asks the server between rounds whether its run is still its
    pool's open run, and ends once it is not."""
    client = temporal_env.client
    # A pool no worker runs: its one run stays open until the test ends it.
    pool = await client.start_workflow(
        "ProxyPool", id=f"pool-{uuid.uuid4().hex[:8]}", task_queue=f"nobody-{uuid.uuid4().hex}"
    )
    config = build_config(local_entry(tmp_path), connect_ports=[443])
    activities = ProviderActivities({"memory": MemoryProvider()}, config)
    shard = replace(_shard(silent_proxy, _closed_port()), failure_threshold=100)

    def shard_of(run_id: str, beats: list[dict[str, Any]]) -> asyncio.Future[Any]:
        env = ActivityEnvironment(client=client)
        env.info = replace(
            env.info,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            workflow_id=pool.id,
            workflow_run_id=run_id,
        )
        env.on_heartbeat = lambda *beat: beats.append(beat[0])
        return asyncio.ensure_future(env.run(activities.monitor_members, shard))

    current_beats: list[dict[str, Any]] = []
    current = shard_of(pool.result_run_id or "", current_beats)
    # A shard of a run the pool has continued from.
    left_behind = shard_of(str(uuid.uuid4()), [])
    try:
        outcome = await asyncio.wait_for(left_behind, 60)
        assert outcome.reason is MonitorReason.HANDOVER, outcome
        assert outcome.probes > 0  # it probed until it asked

        async def checked_open() -> bool:
            return any(beat["run_open_at"] for beat in current_beats)

        # The shard of the open run asked too, and probes on.
        await wait_for(checked_open, "the open run's shard to find its run open")
        assert not current.done()
        await pool.terminate("the test is over")
        outcome = await asyncio.wait_for(current, 60)
        assert outcome.reason is MonitorReason.HANDOVER, outcome
    finally:
        for running in (current, left_behind):
            running.cancel()
        activities.close()
        if (await pool.describe()).status is WorkflowExecutionStatus.RUNNING:
            await pool.terminate("the test is over")


@workflow.defn(name="ShardOwner", sandboxed=False)
class ShardOwner:
    """Runs one pool monitor shard and, when signalled `stop`, cancels it and waits
    for it to end, as an ending pool does (workflows/pool_monitor.py)."""

    def __init__(self) -> None:
        self._stop = False

    @workflow.run
    async def run(self, shard: PoolMonitorInput) -> str:
        handle = workflow.start_activity_method(
            ProviderActivities.monitor_members,
            shard,
            start_to_close_timeout=policies.POOL_MONITOR.start_to_close,
            heartbeat_timeout=policies.POOL_MONITOR.heartbeat,
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        await workflow.wait_condition(lambda: self._stop)
        handle.cancel()
        try:
            return str((await handle).reason)
        except ActivityError:
            return "cancelled at a heartbeat"

    @workflow.signal
    def stop(self) -> None:
        self._stop = True


async def test_a_pool_shard_its_run_cancels_ends_after_its_next_round(
    tmp_path: Any, temporal_env: WorkflowEnvironment
) -> None:
    """A pool that ends cancels its shards and waits for them. The cancel
    reaches a shard only with a heartbeat's reply, which the SDK sends at most
    every 80 s for the pool monitor's heartbeat timeout; so a shard also asks
    the server between rounds whether its run has asked to cancel it, and
    ends then, well before its next heartbeat would have told it."""
    client = temporal_env.client
    config = build_config(local_entry(tmp_path), connect_ports=[443])
    activities = ProviderActivities({"memory": MemoryProvider()}, config)
    task_queue = f"shards-{uuid.uuid4().hex[:8]}"
    shard = PoolMonitorInput(
        [WatchedMember("pool/0", "memory", f"127.0.0.1:{_closed_port()}")],
        "https://example.com/",
        interval_seconds=0.5,
        failure_threshold=10_000,
        max_duration_seconds=3600,
        probe_timeout_seconds=1.0,
    )
    try:
        async with Worker(
            client,
            task_queue=task_queue,
            workflows=[ShardOwner],
            activities=[activities.monitor_members],
        ):
            owner = await client.start_workflow(
                ShardOwner.run, shard, id=f"owner-{uuid.uuid4().hex[:8]}", task_queue=task_queue
            )

            async def probing() -> bool:
                pending = (await owner.describe()).raw_description.pending_activities
                return any(p.last_started_time.seconds for p in pending)

            await wait_for(probing, "the shard to start")
            await owner.signal(ShardOwner.stop)
            ended = await asyncio.wait_for(owner.result(), 2 * DEADLINE)
    finally:
        activities.close()
    assert ended == MonitorReason.HANDOVER
