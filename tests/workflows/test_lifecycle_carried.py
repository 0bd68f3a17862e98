"""Carried state from the floor release still decodes: continue-as-new input outlives releases.

A run that continued as new under 0.3.10 starts its next run under whatever
release is deployed then, with the carried state 0.3.10 wrote. Older shapes
are not read: runs from before the floor are drained before an upgrade
(docs/upgrades.md, "The floor").
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from temporalio.converter import DataConverter, value_to_type

from contract import ProxyState
from workflows.lifecycle import CarriedState
from workflows.lifecycle_carried import MAX_CAUSE, instance_cause, status_of

# A run 0.3.10 started by continue-as-new: its second argument is the carried state.
CONTINUED = (
    Path(__file__).resolve().parents[1] / "histories/0.3.10/continued_as_new_then_terminated.json"
)


def carried_by_the_floor() -> dict[str, Any]:
    """The carried state a 0.3.10 run handed to its next run, as recorded."""
    started = json.loads(CONTINUED.read_text())["history"]["events"][0]
    _, carried = started["workflowExecutionStartedEventAttributes"]["input"]["payloads"]
    state: dict[str, Any] = json.loads(base64.b64decode(carried["data"]))
    return state


def decoded(carried: Any) -> CarriedState:
    """As ProxyLifecycle.run decodes its second argument (workflows/inputs.py)."""
    return value_to_type(CarriedState, carried)


def test_the_floor_release_s_carried_state_gives_the_status_it_had() -> None:
    carried = carried_by_the_floor()
    state = decoded(carried)
    status = status_of(state, waiting_for=None, terminate_reason=None)
    assert status.state == ProxyState.READY
    assert state.current is not None
    assert state.current.name == carried["current"]["name"]
    assert status.instance == carried["current"]["name"]
    assert status.generation == carried["generation"]
    assert [ref.name for ref in state.owned] == [ref["name"] for ref in carried["owned"]]


def test_carried_state_round_trips_through_continue_as_new() -> None:
    state = decoded(carried_by_the_floor())
    state.rotate_reason = "rotate signal"
    state.cause = instance_cause("first start", "2026-01-01T00:00:00+00:00")
    state.next_cause = instance_cause("a rotate signal: " + "x" * 2000, "2026-01-02T00:00:00+00:00")
    assert len(state.next_cause.why) == MAX_CAUSE  # carried state stays bounded
    # What continue-as-new writes: the default converter's JSON.
    (payload,) = DataConverter.default.payload_converter.to_payloads([state])
    again = decoded(json.loads(payload.data))
    assert again == state
