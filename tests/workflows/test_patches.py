"""Every patch is declared with the release that may delete it, and goes by then.

workflows/patches.py declares each patch the workflows ask and each floor
marker they accept (`Patch.retire_in`); docs/upgrades.md says how a patch
is born and retired. These tests keep the declarations the only way a
workflow asks a patch, fail once the project's version (pyproject.toml)
reaches a declaration's release, and count what a run records: one marker
at its start (the floor's), and one for each patch it meets live.
"""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle

from tests.helpers.histories import current_release, load_history, recorded_names, workflow_type
from tests.helpers.stacks import Stack
from tests.helpers.waiting import pending_activities, rotated, wait_for, wait_status
from workflows import patches
from workflows.patches import (
    FLOOR,
    FLOOR_RELEASE,
    LET_GO_OF_LOST_MONITOR,
    LIFECYCLE_FLOOR,
    PATCHES,
    POOL_FLOOR,
    PUBLISH_ENDPOINTS_DIGEST,
    Patch,
)
from workflows.upgrade_check import check_upgrade

CHANGE_VERSION = "TemporalChangeVersion"
WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
# The calls through which a workflow asks a declared patch (workflows/patches.py).
ASKING = {"taken", "keep_floor"}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _asked() -> dict[str, list[str]]:
    """Each name passed to `taken`/`keep_floor` in workflows/, with where; and the SDK's
    own patch calls, under their function's name, which only patches.py may make."""
    asked: dict[str, list[str]] = {}
    for path in sorted(WORKFLOWS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            where = f"{path.name}:{node.lineno}"
            if called in ("patched", "deprecate_patch") and path.name != "patches.py":
                asked.setdefault(f"workflow.{called}", []).append(where)
            elif called in ASKING and node.args and isinstance(node.args[0], ast.Name):
                asked.setdefault(node.args[0].id, []).append(where)
    return asked


def _declared() -> dict[str, Patch]:
    return {name: v for name, v in vars(patches).items() if isinstance(v, Patch)}


def test_every_patch_is_asked_through_its_declaration() -> None:
    declared = _declared()
    asked = _asked()
    direct = {k: v for k, v in asked.items() if k.startswith("workflow.")}
    assert direct == {}, "declare the patch in workflows/patches.py and ask `taken(...)`"
    undeclared = sorted(set(asked) - set(declared))
    assert undeclared == [], f"declare these in workflows/patches.py: {undeclared}"
    unasked = sorted(set(declared) - set(asked))
    assert unasked == [], f"declared but asked nowhere, delete them: {unasked}"
    assert set(declared.values()) == set(FLOOR) | set(PATCHES)
    ids = [patch.id for patch in (*FLOOR, *PATCHES)]
    assert len(ids) == len(set(ids)), ids


@pytest.mark.parametrize("patch", [*FLOOR, *PATCHES], ids=lambda patch: patch.id)
def test_a_patch_goes_by_the_release_it_names(patch: Patch) -> None:
    floor = patch in FLOOR
    assert _release(current_release()) < _release(patch.retire_in), (
        f"release {current_release()} reached {patch.id!r}'s retire_in ({patch.retire_in}): "
        + (
            "delete its keep_floor call and declaration"
            if floor
            else "delete its old path and ask it with keep_floor, as the next floor's marker"
        )
        + " (docs/upgrades.md, 'A patch, from birth to retirement')"
    )


@pytest.mark.parametrize("floor", FLOOR, ids=lambda floor: floor.workflow)
def test_the_floor_marker_is_what_the_floor_release_recorded(floor: Patch) -> None:
    """Every run of the floor release that asked a patch recorded this one first."""
    recordings = [
        name
        for name in recorded_names(FLOOR_RELEASE)
        if workflow_type(FLOOR_RELEASE, name) == floor.workflow
    ]
    assert recordings, f"no {floor.workflow} recording of {FLOOR_RELEASE}"
    for name in recordings:
        markers = _recorded_markers(load_history(FLOOR_RELEASE, name)["history"]["events"])
        assert markers[:1] in ([], [floor.id]), f"{name}: {markers}"
    assert any(
        _recorded_markers(load_history(FLOOR_RELEASE, name)["history"]["events"])
        for name in recordings
    )


def _recorded_markers(events: list[dict[str, Any]]) -> list[str]:
    markers = []
    for event in events:
        details = event.get("markerRecordedEventAttributes", {}).get("details", {})
        if "patch-data" in details:
            data = base64.b64decode(details["patch-data"]["payloads"][0]["data"])
            markers.append(json.loads(data)["id"])
    return markers


async def _patch_markers(handle: WorkflowHandle[Any, Any]) -> tuple[list[str], int]:
    """The ids of the patch markers in the run's history, and its CHANGE_VERSION upserts."""
    markers: list[str] = []
    upserts = 0
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
            details = event.marker_recorded_event_attributes.details
            if "patch-data" in details:
                markers.append(json.loads(details["patch-data"].payloads[0].data)["id"])
        elif event.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes
            upserts += CHANGE_VERSION in fields.indexed_fields
    return markers, upserts


@pytest.mark.slow
async def test_a_proxy_started_rotated_and_terminated_records_one_marker(stack: Stack) -> None:
    handle = await stack.start()
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    second = await rotated(handle, first, "test")
    await wait_for(lambda: stack.instances() == [second.instance], "the old instance deleted")

    async def only_the_new_monitor() -> bool:
        return await pending_activities(handle) == ["monitor"]

    # The rotation over (its deletion and its old monitor ended): Ready with a monitor.
    await wait_for(only_the_new_monitor, "the new instance's monitor alone")
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"

    # The floor's at its start; the terminate found the monitor still running.
    # Each with its TemporalChangeVersion upsert, the floor's deprecated one too:
    # the visibility query of docs/upgrades.md, "The floor", finds it.
    assert await _patch_markers(handle) == ([LIFECYCLE_FLOOR.id, LET_GO_OF_LOST_MONITOR.id], 2)


@pytest.mark.slow
async def test_a_pool_and_its_members_record_one_marker_a_run(stack: Stack) -> None:
    pool = await stack.start_pool(2)

    async def members() -> list[dict[str, Any]]:
        return list((await pool.query("status"))["members"])

    await wait_for(
        lambda: _all_ready(pool, 2), "2 members Ready with verified endpoints", deadline=90
    )
    before = {m["member"]: m["generation"] for m in await members()}
    await pool.execute_update("rotate", {"all": True})

    async def rotated() -> bool:
        now = await members()
        return len(now) == 2 and all(m["generation"] > before[m["member"]] for m in now)

    await wait_for(rotated, "both members rotated", deadline=90)
    await pool.signal("terminate")
    assert (await pool.result())["state"] == "Terminated"
    assert stack.instances() == []

    assert await _patch_markers(pool) == ([POOL_FLOOR.id, PUBLISH_ENDPOINTS_DIGEST.id], 2)
    for member in before:
        member_handle = stack.client.get_workflow_handle(member)
        assert await _patch_markers(member_handle) == ([LIFECYCLE_FLOOR.id], 1), member


async def _all_ready(pool: WorkflowHandle[Any, Any], count: int) -> bool:
    return len(await pool.query("endpoints")) == count


@pytest.mark.slow
async def test_check_upgrade_takes_over_a_fleet_of_this_build(stack: Stack) -> None:
    handle = await stack.start()
    await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    found = await check_upgrade(stack.client)
    assert found.checked >= 1
    assert found.ok, (found.before_floor, found.failing)
    await handle.signal("terminate")
    await handle.result()
