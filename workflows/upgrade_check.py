"""`proxy-operator-worker --check-upgrade`: may this build take over the running fleet?

Before a deploy, every open ProxyLifecycle, ProxyPool and OrphanGC of the
namespace is fetched and its history replayed against this build's workflow
code, as a new worker would replay it at its next workflow task. Two things
stop a deploy (docs/upgrades.md, "The floor"):

- a run started before the floor release: its history lacks the marker its
  workflow's floor runs recorded at their start (workflows/patches.py,
  FLOOR), so it may have taken an old path this build no longer has. Drain
  or end it first.
- a run whose replay fails: a nondeterminism this build would meet live.

Read-only: it lists, fetches and replays, and starts or signals nothing.
Not workflow code: it sits beside the workflows it replays, and no workflow
imports it (activities and start-up never import workflows/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TextIO

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.worker import Replayer

from contract import ORPHAN_GC, PROXY_LIFECYCLE, PROXY_POOL
from workflows.lifecycle import ProxyLifecycle
from workflows.orphan_gc import OrphanGC
from workflows.patches import FLOOR, FLOOR_RELEASE
from workflows.pool import ProxyPool

RUNNING = (
    "ExecutionStatus = 'Running' AND WorkflowType IN "
    f"('{PROXY_LIFECYCLE}', '{PROXY_POOL}', '{ORPHAN_GC}')"
)


@dataclass
class UpgradeCheck:
    """What the check found: runs checked, those before the floor, those that fail to replay."""

    checked: int = 0
    before_floor: list[str] = field(default_factory=list)
    failing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.before_floor and not self.failing


def floor_marker_missing(workflow_type: str, history: WorkflowHistory) -> bool:
    """Whether a run of `workflow_type` lacks the marker its floor release's runs recorded."""
    wanted = {floor.workflow: floor.id for floor in FLOOR}.get(workflow_type)
    if wanted is None:
        return False
    for event in history.events:
        if event.event_type != EventType.EVENT_TYPE_MARKER_RECORDED:
            continue
        patch = event.marker_recorded_event_attributes.details.get("patch-data")
        if patch is not None and json.loads(patch.payloads[0].data).get("id") == wanted:
            return False
    return True


async def check_upgrade(client: Client) -> UpgradeCheck:
    """Replay every open run of the namespace against this build."""
    found = UpgradeCheck()
    replayer = Replayer(
        workflows=[ProxyLifecycle, ProxyPool, OrphanGC],
        namespace=client.namespace,
        # A replay is pure CPU; a long history on a busy machine is no deadlock.
        debug_mode=True,
    )
    async for run in client.list_workflows(RUNNING):
        handle = client.get_workflow_handle(run.id, run_id=run.run_id)
        history = await handle.fetch_history()
        found.checked += 1
        started = run.start_time.isoformat(timespec="seconds")
        named = f"{run.workflow_type} {run.id} (run {run.run_id}, started {started})"
        if floor_marker_missing(run.workflow_type, history):
            found.before_floor.append(named)
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        if result.replay_failure is not None:
            found.failing.append(f"{named}: {result.replay_failure}")
    return found


def report(found: UpgradeCheck, out: TextIO) -> None:
    """One line a run that stops the deploy, then the verdict."""
    for named in found.before_floor:
        print(f"started before {FLOOR_RELEASE}, drain or end it: {named}", file=out)
    for failure in found.failing:
        print(f"fails to replay on this build: {failure}", file=out)
    verdict = "ok" if found.ok else "not ok"
    print(
        f"{verdict}: {found.checked} running workflows checked, "
        f"{len(found.before_floor)} before {FLOOR_RELEASE}, {len(found.failing)} failing replay",
        file=out,
    )
