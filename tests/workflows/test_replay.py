"""Replay the recorded histories against today's workflow code, as either worker has it.

A change that alters the commands an existing history expects (a new
activity call, a reordered timer) fails here instead of in production, where
it would wedge every running proxy. The corpus holds the recordings of the
release this code upgrades from (workflows/patches.py, FLOOR_RELEASE) and of
the current one (tests/helpers/histories.py): a run either started may still
be open when this code reaches a fleet. docs/upgrades.md says how to replay
a live fleet's own histories before a deploy.
"""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from contract import PROXY_LIFECYCLE, PROXY_POOL
from tests.helpers.histories import (
    HISTORIES,
    current_release,
    load_history,
    recorded_names,
    releases,
    workflow_type,
)
from tests.helpers.sandboxed import SandboxedProxyLifecycle, SandboxedProxyPool
from workflows.lifecycle import ProxyLifecycle
from workflows.orphan_gc import OrphanGC
from workflows.patches import FLOOR_RELEASE
from workflows.pool import ProxyPool
from workflows.versioned import VersionedOrphanGC, VersionedProxyLifecycle, VersionedProxyPool

RECORDINGS = [(release, name) for release in releases() for name in recorded_names(release)]
# What an unversioned worker registers, and what one of a Worker Deployment
# does (worker.build_worker): both replay whatever a release recorded.
REGISTRATIONS: dict[str, list[type]] = {
    "unversioned": [ProxyLifecycle, OrphanGC, ProxyPool],
    "versioned": [VersionedProxyLifecycle, VersionedOrphanGC, VersionedProxyPool],
}
# The workflows that run outside the sandbox (workflows/pool.py, workflows/lifecycle.py).
UNSANDBOXED_RECORDINGS = [
    (r, n) for r, n in RECORDINGS if workflow_type(r, n) in {PROXY_POOL, PROXY_LIFECYCLE}
]


def test_the_current_release_has_recordings() -> None:
    assert recorded_names(current_release()), (
        f"no histories for release {current_release()} (pyproject.toml): `make histories`"
    )


def test_the_corpus_holds_the_floor_and_the_current_release_only() -> None:
    kept = {FLOOR_RELEASE, current_release()}
    retired = sorted(set(releases()) - kept)
    assert retired == [], f"no run of {retired} may reach this code: delete their recordings"


def test_every_recording_belongs_to_a_release() -> None:
    loose = sorted(path.name for path in HISTORIES.glob("*.json"))
    assert loose == [], f"move them into tests/histories/<the release they came from>/: {loose}"


@pytest.mark.parametrize("registration", sorted(REGISTRATIONS))
@pytest.mark.parametrize(("release", "name"), RECORDINGS, ids=[f"{r}/{n}" for r, n in RECORDINGS])
async def test_replays_without_nondeterminism(release: str, name: str, registration: str) -> None:
    recorded = load_history(release, name)
    history = WorkflowHistory.from_json(recorded["workflow_id"], recorded["history"])
    # Histories recorded before the namespace was stored come from the test
    # servers' default namespace.
    namespace = recorded.get("namespace", "default")
    # debug_mode: no deadlock detector. A replay is pure CPU, and on a busy
    # CI machine a workflow task of a long history can take over its 2 s
    # without any deadlock; nondeterminism is what this test is for.
    replayer = Replayer(workflows=REGISTRATIONS[registration], namespace=namespace, debug_mode=True)
    await replayer.replay_workflow(history)


@pytest.mark.parametrize(
    ("release", "name"), UNSANDBOXED_RECORDINGS, ids=[f"{r}/{n}" for r, n in UNSANDBOXED_RECORDINGS]
)
async def test_recordings_replay_inside_the_sandbox(release: str, name: str) -> None:
    """The pool and the lifecycle run unsandboxed: here the sandbox still checks their code."""
    recorded = load_history(release, name)
    history = WorkflowHistory.from_json(recorded["workflow_id"], recorded["history"])
    namespace = recorded.get("namespace", "default")
    replayer = Replayer(
        workflows=[SandboxedProxyLifecycle, SandboxedProxyPool],
        namespace=namespace,
        debug_mode=True,
    )
    await replayer.replay_workflow(history)
