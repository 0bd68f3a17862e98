"""Carried state from older runs still decodes: continue-as-new input outlives releases.

A run that continued as new under an older release starts its next run under
whatever release is deployed then, with the carried state the old code wrote.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from temporalio.converter import value_to_type

from workflows.lifecycle import CarriedState

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
HISTORY = HISTORIES / "continued_as_new_then_terminated.json"


def recorded_carried_state() -> dict[str, Any]:
    """The second argument of a run started by continue-as-new, as an older release wrote it."""
    started = json.loads(HISTORY.read_text())["history"]["events"][0]
    payloads = started["workflowExecutionStartedEventAttributes"]["input"]["payloads"]
    carried: dict[str, Any] = json.loads(base64.b64decode(payloads[1]["data"]))
    return carried


def test_carried_state_with_fields_since_removed_decodes() -> None:
    carried = recorded_carried_state()
    # Written by releases that had them; no release reads them now.
    carried.update(terminate_reason=None, waiting_for_quota=True)
    state = value_to_type(CarriedState, carried)
    assert state.current is not None
    assert state.current.name == "proxy-wnxoh5jmdwnp4qag"
    assert [ref.name for ref in state.owned] == ["proxy-wnxoh5jmdwnp4qag"]
    assert state.next_generation == 2
    assert not hasattr(state, "waiting_for_quota")
