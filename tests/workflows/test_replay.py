"""Replay every recorded history against today's workflow code.

A change that alters the commands an existing history expects (a new
activity call, a reordered timer) fails here instead of in production, where
it would wedge every running proxy. Histories are recorded by the workflow
tests with PROXY_OPERATOR_RECORD_HISTORIES=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workflows.lifecycle import ProxyLifecycle
from workflows.orphan_gc import OrphanGC
from workflows.pool import ProxyPool

HISTORIES = {
    path.stem: json.loads(path.read_text())
    for path in sorted((Path(__file__).resolve().parent.parent / "histories").glob("*.json"))
}


def test_histories_are_committed() -> None:
    assert len(HISTORIES) >= 5, "record them: PROXY_OPERATOR_RECORD_HISTORIES=1 make test"


@pytest.mark.parametrize("name", sorted(HISTORIES))
async def test_replays_without_nondeterminism(name: str) -> None:
    recorded = HISTORIES[name]
    history = WorkflowHistory.from_json(recorded["workflow_id"], recorded["history"])
    # Histories recorded before the namespace was stored come from the test
    # servers' default namespace.
    namespace = recorded.get("namespace", "default")
    replayer = Replayer(workflows=[ProxyLifecycle, OrphanGC, ProxyPool], namespace=namespace)
    await replayer.replay_workflow(history)
