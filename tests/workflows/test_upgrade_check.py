"""`--check-upgrade` tells a run of the floor release from one started before it."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.client import WorkflowHistory

from tests.helpers.histories import load_history, recorded_names, workflow_type
from workflows.patches import FLOOR_RELEASE
from workflows.upgrade_check import floor_marker_missing

# A recording of each workflow type the floor release recorded.
FIRST_OF_EACH = {
    workflow_type(FLOOR_RELEASE, name): name
    for name in reversed(recorded_names(FLOOR_RELEASE))
    if name not in ("forged_carried_state",)  # refused before any question: no marker
}


def _history(recorded: dict[str, Any]) -> WorkflowHistory:
    return WorkflowHistory.from_json(recorded["workflow_id"], recorded["history"])


@pytest.mark.parametrize(("kind", "name"), sorted(FIRST_OF_EACH.items()))
def test_a_floor_run_has_its_marker_and_one_without_is_before_the_floor(
    kind: str, name: str
) -> None:
    recorded = load_history(FLOOR_RELEASE, name)
    assert not floor_marker_missing(kind, _history(recorded))

    events = recorded["history"]["events"]
    without = [e for e in events if "markerRecordedEventAttributes" not in e]
    assert len(without) < len(events)
    older = {**recorded, "history": {**recorded["history"], "events": without}}
    assert floor_marker_missing(kind, _history(older))
