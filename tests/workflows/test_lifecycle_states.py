"""The lifecycle's transition table: complete, enforced, and what the docs show.

workflows/lifecycle_states.py holds the table; the module docstring of
workflows/lifecycle.py and docs/architecture.md carry renderings of it, and
the recorded histories show the transitions real runs made.
"""

from __future__ import annotations

import base64
import json
from itertools import pairwise
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

import workflows.lifecycle
from contract import PROXY_LIFECYCLE, ErrorType, ProxyState
from tests.helpers.histories import load_history, recorded_names, releases, workflow_type
from workflows.lifecycle_states import (
    FINAL,
    INITIAL,
    TRANSITIONS,
    check_transition,
    render_transitions,
)

ROOT = Path(__file__).resolve().parents[2]
# Every recorded lifecycle, found by reading each recording's first event only:
# collection runs in every xdist worker.
LIFECYCLE_RECORDINGS = [
    (release, name)
    for release in releases()
    for name in recorded_names(release)
    if workflow_type(release, name) == PROXY_LIFECYCLE
]


def reachable(start: ProxyState) -> set[ProxyState]:
    seen = {start}
    todo = [start]
    while todo:
        for following in TRANSITIONS[todo.pop()]:
            if following not in seen:
                seen.add(following)
                todo.append(following)
    return seen


def test_every_state_is_in_the_table_and_reachable_from_the_first() -> None:
    assert set(TRANSITIONS) == set(ProxyState)
    assert reachable(INITIAL) == set(ProxyState)


def test_every_state_can_end_and_the_ends_are_terminated_and_failed() -> None:
    assert {ProxyState.TERMINATED, ProxyState.FAILED} == FINAL
    for state in ProxyState:
        assert reachable(state) & FINAL, f"{state} can never end"


def test_an_illegal_transition_is_a_non_retryable_error_naming_both_states() -> None:
    with pytest.raises(ApplicationError) as refused:
        check_transition(ProxyState.TERMINATING, ProxyState.READY)
    assert refused.value.non_retryable
    assert refused.value.type == ErrorType.ILLEGAL_TRANSITION
    assert "Terminating -> Ready" in refused.value.message
    with pytest.raises(ApplicationError, match="none, it is final"):
        check_transition(ProxyState.FAILED, ProxyState.REPLACING)


def test_staying_and_allowed_transitions_pass() -> None:
    check_transition(ProxyState.REPLACING, ProxyState.REPLACING)
    for current, followers in TRANSITIONS.items():
        for following in followers:
            check_transition(current, following)


def test_the_lifecycle_docstring_shows_the_table() -> None:
    docstring = workflows.lifecycle.__doc__ or ""
    assert render_transitions(indent="    ") in docstring, (
        "paste render_transitions(indent='    ') into workflows/lifecycle.py's docstring"
    )


def test_the_architecture_doc_shows_the_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert f"```\n{render_transitions()}\n```" in text, (
        "paste render_transitions() into docs/architecture.md, 'A proxy's states'"
    )


def recorded_states(release: str, name: str) -> list[ProxyState]:
    """The ProxyState values a recorded lifecycle published, in order, repeats dropped."""
    events = load_history(release, name)["history"]["events"]
    states: list[ProxyState] = []
    for event in events:
        upsert = event.get("upsertWorkflowSearchAttributesEventAttributes")
        fields = upsert["searchAttributes"]["indexedFields"] if upsert else {}
        data = fields.get("ProxyState", {}).get("data")
        if data:
            state = ProxyState(json.loads(base64.b64decode(data)))
            if not states or states[-1] != state:
                states.append(state)
    return states


@pytest.mark.parametrize(
    ("release", "name"), LIFECYCLE_RECORDINGS, ids=[f"{r}/{n}" for r, n in LIFECYCLE_RECORDINGS]
)
def test_recorded_runs_made_only_transitions_the_table_allows(release: str, name: str) -> None:
    states = recorded_states(release, name)
    assert states, "a lifecycle publishes its state"
    for current, following in pairwise(states):
        assert following in TRANSITIONS[current], f"{current} -> {following}"
