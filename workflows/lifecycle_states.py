"""ProxyLifecycle's states and the transitions between them, as one table.

The workflow enforces this table (`check_transition`), and the diagram in
workflows/lifecycle.py's docstring and the state section of
docs/architecture.md are rendered from it (`render_transitions`);
tests/workflows/test_lifecycle_states.py fails when either disagrees.
Staying in a state is not a transition: a replacement that fails again stays
Replacing, a rotation happens while the proxy stays Ready (the old instance
serves until the new one passes its first probe).
"""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

from contract import ErrorType, ProxyState

# Terminate and cancel end every state that is not final.
_TERMINATE = "terminate signal or workflow cancel"
_FAIL = "invalid input, a Permanent error, or the crash budget spent"

# For each state: the states it may go to, and when it does.
TRANSITIONS: dict[ProxyState, dict[ProxyState, str]] = {
    ProxyState.PROVISIONING: {
        ProxyState.READY: "the first instance passed its first probe",
        ProxyState.REPLACING: "the first instance failed, crash budget left",
        ProxyState.TERMINATING: _TERMINATE,
        ProxyState.FAILED: _FAIL,
    },
    ProxyState.READY: {
        ProxyState.UNHEALTHY: "the monitor found the instance failing or gone",
        ProxyState.TERMINATING: _TERMINATE,
        ProxyState.FAILED: _FAIL,
    },
    ProxyState.UNHEALTHY: {
        ProxyState.REPLACING: "the failed instance retired (backoff if failures repeat)",
        ProxyState.TERMINATING: _TERMINATE,
        ProxyState.FAILED: _FAIL,
    },
    ProxyState.REPLACING: {
        ProxyState.READY: "a new generation passed its first probe",
        ProxyState.TERMINATING: _TERMINATE,
        ProxyState.FAILED: _FAIL,
    },
    ProxyState.TERMINATING: {
        ProxyState.TERMINATED: "every instance the workflow owned is gone",
        ProxyState.FAILED: "the provider refused an instance's delete for good (Permanent)",
    },
    ProxyState.TERMINATED: {},
    ProxyState.FAILED: {},
}

# Where a proxy starts, before its input is validated.
INITIAL = ProxyState.PROVISIONING
FINAL = frozenset(state for state, following in TRANSITIONS.items() if not following)


def check_transition(current: ProxyState, following: ProxyState) -> None:
    """Refuse a transition the table does not allow.

    An illegal transition is a bug in the workflow, never something a retry
    could fix: the error is non-retryable and names both states.
    """
    if following != current and following not in TRANSITIONS[current]:
        allowed = ", ".join(TRANSITIONS[current]) or "none, it is final"
        raise ApplicationError(
            f"illegal state transition {current} -> {following} (allowed: {allowed})",
            type=ErrorType.ILLEGAL_TRANSITION,
            non_retryable=True,
        )


def render_transitions(indent: str = "") -> str:
    """The table as text, one transition a line: what the docs show."""
    width = max(len(state) for state in TRANSITIONS)
    lines = [
        f"{indent}{current:<{width}} -> {following:<{width}}  {when}"
        for current, followers in TRANSITIONS.items()
        for following, when in followers.items()
    ]
    return "\n".join(lines)
