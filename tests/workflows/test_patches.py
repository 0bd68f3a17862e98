"""A run started on this release records one patch marker, its release's, however
many patched paths it takes (workflows/patches.py).

Each marker a run records costs Temporal Cloud actions: the SDK upserts
`TemporalChangeVersion` with it, and a workflow task with a marker is one
`BatchMarkers` more. Up to 0.3.8 a pool member's first task recorded four,
a pool run seven at its start, and a proxy's first rotation in a run one
more. These tests take every path whose patch a proxy or a pool asks in
ordinary life (start, rotation, terminate; a pool's start, `rotate {"all":
true}` and end) and count.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle

from tests.helpers.histories import current_release
from tests.helpers.stacks import Stack
from tests.helpers.waiting import pending_activities, rotated, wait_for, wait_status
from workflows.lifecycle import (
    DISRUPTION_PATCH,
    LET_GO_OF_LOST_MONITOR_PATCH,
    LIFECYCLE_RELEASE,
    LIFECYCLE_RELEASE_0_3_9,
)
from workflows.patches import RELEASE_0_3_9, RELEASE_0_3_10
from workflows.pool import POOL_RELEASE, VERIFY_WAITS_OUT_QUOTA_PATCH
from workflows.pool_feed import PUBLISH_ENDPOINTS_DIGEST_PATCH

CHANGE_VERSION = "TemporalChangeVersion"


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


def test_each_release_marker_covers_exactly_what_its_runs_took() -> None:
    # Frozen: a run that recorded release-0.3.9 took exactly these paths. A
    # patch added to a cover later would be taken, on replay, by runs that
    # never took its path, whose replay could then fail; a new patch is asked
    # on its own until the next release marker covers it (docs/upgrades.md).
    assert LIFECYCLE_RELEASE_0_3_9.patch == POOL_RELEASE.patch == RELEASE_0_3_9
    assert LIFECYCLE_RELEASE_0_3_9.covers == {
        "clean-stop-and-provider-waits",
        "delete-refused-for-good",
        "early-signals-after-takeover",
        "hand-over-long-waits",
        "hand-over-terminating-waits",
        "installation-in-instance-names",
        "member-hands-over-when-long",
        "members-start-quietly",
        "monitor-old-instance-while-rotating",
    }
    assert POOL_RELEASE.covers == {
        "budget-wakes",
        "commands-within-budget",
        "early-signals-after-takeover",
        "hand-over-while-ending",
        "member-drain",
        "members-queue",
        "paced-commands",
        "pool-monitors-members",
        "quiet-handover",
        "shorter-pool-runs",
        "verified-endpoints",
    }
    assert LIFECYCLE_RELEASE.patch == RELEASE_0_3_10
    assert LIFECYCLE_RELEASE.covers == LIFECYCLE_RELEASE_0_3_9.covers | {"one-upsert-a-task"}


def test_patches_since_the_newest_marker_are_covered_by_the_next_release() -> None:
    # Added after 0.3.10 and asked on its own (a marker and an upsert where
    # each decides) until a release marker covers it. Cutting 0.3.11 adds that
    # marker (docs/upgrades.md, "To cut a release"); from 0.3.12 the patch
    # may be deprecated (docs/upgrades.md, "The patches").
    assert LET_GO_OF_LOST_MONITOR_PATCH not in LIFECYCLE_RELEASE.covers
    assert DISRUPTION_PATCH not in LIFECYCLE_RELEASE.covers
    assert VERIFY_WAITS_OUT_QUOTA_PATCH not in POOL_RELEASE.covers
    assert PUBLISH_ENDPOINTS_DIGEST_PATCH not in POOL_RELEASE.covers
    assert current_release() == "0.3.10", (
        f"release {current_release()}: give it a lifecycle ReleaseMarker that covers "
        f"{LET_GO_OF_LOST_MONITOR_PATCH!r}, {DISRUPTION_PATCH!r} and 0.3.10's, and a pool "
        "one that covers "
        f"{VERIFY_WAITS_OUT_QUOTA_PATCH!r}, {PUBLISH_ENDPOINTS_DIGEST_PATCH!r} and 0.3.9's, "
        "then update this test"
    )


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

    # The terminate found the monitor still running: 0.3.10's marker does not cover its patch.
    assert await _patch_markers(handle) == ([RELEASE_0_3_10, LET_GO_OF_LOST_MONITOR_PATCH], 2)


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

    # Asked at every run's start: 0.3.9's marker does not cover it.
    assert await _patch_markers(pool) == ([RELEASE_0_3_9, PUBLISH_ENDPOINTS_DIGEST_PATCH], 2)
    for member in before:
        member_handle = stack.client.get_workflow_handle(member)
        assert await _patch_markers(member_handle) == ([RELEASE_0_3_10], 1), member


async def _all_ready(pool: WorkflowHandle[Any, Any], count: int) -> bool:
    return len(await pool.query("endpoints")) == count
