"""Carried state from older runs still decodes: continue-as-new input outlives releases.

A run that continued as new under an older release starts its next run under
whatever release is deployed then, with the carried state the old code wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from temporalio.converter import DataConverter, value_to_type

from contract import ProxyState
from workflows.lifecycle import CarriedState
from workflows.lifecycle_carried import MAX_CAUSE, from_older_release, instance_cause, status_of

# Taken from a 0.1.0 recording, before its release's recordings were retired.
WRITTEN_BY_0_1_0 = Path(__file__).resolve().parent / "written_by_0_1_0.json"


def recorded_carried_state() -> dict[str, Any]:
    """The second argument of a run started by continue-as-new, as an older release wrote it."""
    carried: dict[str, Any] = json.loads(WRITTEN_BY_0_1_0.read_text())["carried_state"]
    return carried


def decoded(carried: Any) -> CarriedState:
    """As ProxyLifecycle.run decodes its second argument (workflows/inputs.py)."""
    return value_to_type(CarriedState, from_older_release(carried))


def test_an_older_release_s_carried_state_gives_the_status_it_had() -> None:
    carried = recorded_carried_state()
    state = decoded(carried)
    status = status_of(state, waiting_for=None, terminate_reason=None)
    old = carried["status"]
    assert status.state == ProxyState.READY
    for key in ("endpoint", "provider_id", "instance", "generation", "ready_since", "replacements"):
        assert getattr(status, key) == old[key], key
    assert status.last_probe is not None and status.last_probe.ok
    assert state.current is not None and state.current.name == old["instance"]
    assert [ref.name for ref in state.owned] == [old["instance"]]
    assert state.next_generation == 2
    # That release did not say why its instance was made: nothing is made up.
    assert state.cause is None and status.cause is None


def test_carried_state_with_fields_since_removed_decodes() -> None:
    carried = recorded_carried_state()
    # Written by releases that had them; no release reads them now.
    carried.update(terminate_reason=None, waiting_for_quota=True)
    state = decoded(carried)
    assert state.current is not None and state.next_generation == 2
    assert not hasattr(state, "waiting_for_quota")


def test_today_s_carried_state_decodes_as_it_was_written() -> None:
    state = decoded(recorded_carried_state())
    state.rotate_reason = "rotate signal"
    state.cause = instance_cause("first start", "2026-01-01T00:00:00+00:00")
    state.next_cause = instance_cause("a rotate signal: " + "x" * 2000, "2026-01-02T00:00:00+00:00")
    assert len(state.next_cause.why) == MAX_CAUSE  # carried state stays bounded
    # What continue-as-new writes: the default converter's JSON.
    (payload,) = DataConverter.default.payload_converter.to_payloads([state])
    again = decoded(json.loads(payload.data))
    assert again == state


def test_anything_else_passes_through_for_the_check_to_refuse() -> None:
    for hostile in (None, [], "status", {"status": "Ready"}, {"current": None}):
        assert from_older_release(hostile) == hostile
