"""Activity inputs scheduled by an older release still decode on this one.

During a rollout a monitor scheduled by an old worker may be picked up by a
new one: the new activity model must take the old JSON. The inputs are taken
as written from the histories the releases we upgrade from recorded (tests/histories/).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.converter import value_to_type

from activities.models import MonitorInput, PoolMonitorInput

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
MODELS: dict[str, type[Any]] = {"monitor": MonitorInput, "monitor_members": PoolMonitorInput}


def scheduled_inputs(activity: str) -> list[tuple[str, Any]]:
    """(release/history, decoded JSON input) of every `activity` a recorded history scheduled."""
    found = []
    for path in sorted(HISTORIES.glob("*/*.json")):
        recorded = json.loads(path.read_text())
        for event in recorded["history"]["events"]:
            scheduled = event.get("activityTaskScheduledEventAttributes")
            if scheduled is None or scheduled["activityType"]["name"] != activity:
                continue
            (payload,) = scheduled["input"]["payloads"]
            source = f"{path.parent.name}/{path.stem}"
            found.append((source, json.loads(base64.b64decode(payload["data"]))))
    return found


@pytest.mark.parametrize("activity", sorted(MODELS))
def test_every_recorded_monitor_input_decodes_with_its_cadence(activity: str) -> None:
    inputs = scheduled_inputs(activity)
    assert inputs, f"{activity}: no recording scheduled one"
    for source, raw in inputs:
        decoded = value_to_type(MODELS[activity], raw)
        cadence = (
            decoded.interval_seconds,
            decoded.failure_threshold,
            decoded.max_duration_seconds,
            decoded.probe_timeout_seconds,
        )
        written = (
            raw["interval_seconds"],
            raw["failure_threshold"],
            raw["max_duration_seconds"],
            raw["probe_timeout_seconds"],
        )
        assert cadence == written, source
        assert decoded.target == raw["target"], source
