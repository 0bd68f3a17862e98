"""The orphan GC schedule: created once, updated in place, never duplicated.

The unit tests check the worker's flags; the others run against the session's
dev server, the last one through `python worker.py` exactly as an operator
starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from temporalio.client import (
    Client,
    ScheduleActionStartWorkflow,
    ScheduleDescription,
    ScheduleOverlapPolicy,
)
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from contract import ORPHAN_GC_SCHEDULE_ID as SCHEDULE_ID
from startup.schedule import ensure_orphan_gc_schedule, parse_duration
from tests.helpers.config import PASSWORD
from tests.helpers.waiting import wait_for
from worker import parse_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10m", timedelta(minutes=10)),
        ("1h30m", timedelta(minutes=90)),
        ("45s", timedelta(seconds=45)),
    ],
)
def test_parse_duration(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "10", "5x", "0s", "m"])
def test_parse_duration_rejects_what_the_cli_would_not_take(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def test_worker_flags_turn_the_schedule_off_and_set_its_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    defaults = parse_args([])
    assert defaults.orphan_gc_schedule is True
    assert defaults.orphan_gc_interval == timedelta(minutes=10)
    assert parse_args(["--no-orphan-gc-schedule"]).orphan_gc_schedule is False
    assert parse_args(["--orphan-gc-interval", "1h"]).orphan_gc_interval == timedelta(hours=1)
    monkeypatch.setenv("PROXY_OPERATOR_ORPHAN_GC_SCHEDULE", "off")
    assert parse_args([]).orphan_gc_schedule is False


async def describe(client: Client, schedule_id: str) -> ScheduleDescription:
    return await client.get_schedule_handle(schedule_id).describe()


@pytest.fixture
async def schedule_id(temporal_env: WorkflowEnvironment) -> AsyncIterator[str]:
    schedule_id = f"orphan-gc-test-{uuid.uuid4().hex[:8]}"
    yield schedule_id
    with contextlib.suppress(RPCError):
        await temporal_env.client.get_schedule_handle(schedule_id).delete()


@pytest.mark.slow
async def test_created_then_updated_in_place_keeping_a_pause(
    temporal_env: WorkflowEnvironment, schedule_id: str
) -> None:
    client = temporal_env.client
    await ensure_orphan_gc_schedule(client, task_queue="queue-a", schedule_id=schedule_id)

    created = await describe(client, schedule_id)
    [interval] = created.schedule.spec.intervals
    assert interval.every == timedelta(minutes=10)
    assert created.schedule.spec.jitter == timedelta(minutes=1)
    assert created.schedule.policy.overlap == ScheduleOverlapPolicy.SKIP
    action = created.schedule.action
    assert isinstance(action, ScheduleActionStartWorkflow)
    assert (action.workflow, action.task_queue, action.id) == ("OrphanGC", "queue-a", SCHEDULE_ID)

    await client.get_schedule_handle(schedule_id).pause(note="paused by an operator")
    # Workers starting together: neither fails, and one schedule remains.
    await asyncio.gather(
        *(
            ensure_orphan_gc_schedule(
                client,
                task_queue="queue-b",
                interval=timedelta(minutes=5),
                schedule_id=schedule_id,
            )
            for _ in range(3)
        )
    )

    updated = await describe(client, schedule_id)
    [interval] = updated.schedule.spec.intervals
    assert interval.every == timedelta(minutes=5)
    assert isinstance(updated.schedule.action, ScheduleActionStartWorkflow)
    assert updated.schedule.action.task_queue == "queue-b"
    assert updated.schedule.state.paused is True
    await wait_for(
        lambda: _one(client, schedule_id), "visibility to list the schedule exactly once"
    )


@pytest.mark.slow
async def test_each_worker_start_creates_or_updates_the_one_schedule(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """`python worker.py` twice: the schedule exists after the first, is updated by the second."""
    client = temporal_env.client
    config = tmp_path / "providers.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "installation": "schedule-test",
                "proxy": {
                    "auth": {"password_env": "PROXY_PASSWORD"},
                    "allowed_cidrs": ["127.0.0.0/8"],
                },
                "providers": [
                    {"name": "local", "type": "local", "local": {"state_dir": str(tmp_path)}}
                ],
            }
        )
    )
    task_queue = f"schedule-test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": client.service_client.config.target_host,
        "TEMPORAL_NAMESPACE": client.namespace,
        "PROXY_PASSWORD": PASSWORD,
        "PROXY_OPERATOR_METRICS_ADDRESS": "",
    }

    async def start_worker(interval: str) -> None:
        log = tmp_path / f"worker-{interval}.log"
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *(sys.executable, "worker.py", "--providers-config", str(config)),
                *("--task-queue", task_queue, "--orphan-gc-interval", interval),
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            await wait_for(lambda: "worker on task queue" in log.read_text(), "the worker to start")
        finally:
            # Its exit code is tests/test_worker.py's business (and see
            # temporalio/sdk-python#300: a rare crash at interpreter exit).
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 60)

    try:
        await start_worker("7m")
        [interval] = (await describe(client, SCHEDULE_ID)).schedule.spec.intervals
        assert interval.every == timedelta(minutes=7)

        await start_worker("3m")
        [interval] = (await describe(client, SCHEDULE_ID)).schedule.spec.intervals
        assert interval.every == timedelta(minutes=3)
        await wait_for(lambda: _one(client, SCHEDULE_ID), "the schedule listed exactly once")
    finally:
        with contextlib.suppress(RPCError):
            await client.get_schedule_handle(SCHEDULE_ID).delete()


async def _one(client: Client, schedule_id: str) -> bool:
    listed = [s.id async for s in await client.list_schedules() if s.id == schedule_id]
    return listed == [schedule_id]
