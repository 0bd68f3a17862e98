"""What a person reads of a ProxyLifecycle in the Temporal Web UI: pure text, no Temporal API.

`current_details` is the proxy's current details (the User Metadata tab):
its state, its instance and why that instance exists and since when, a
rotation under way and why, what it waits for, its last error. A pool
member's static details say why the pool started it; these say why its
current instance is there: the first start, a rotation by age, a rotation
someone asked for (the pool's word, a ban and its reason among them), or
an instance before it that failed.

The causes are worded here (`FIRST_START`, `rotation`, `failed_probes`,
`failed_to_come_up`) and carried as `InstanceCause` (lifecycle_carried.py).
"""

from __future__ import annotations

from datetime import datetime

from contract import ProxyState
from workflows import markdown
from workflows.lifecycle_carried import InstanceCause, ProxyStatus

FIRST_START = "first start"
# What a `rotate` signal without a reason leaves (lifecycle.py).
ROTATE_SIGNAL_DEFAULT = "rotate signal"
# A reason the pool sends starts so (workflows/pool.py).
POOL_WORD = "pool: "


def rotation(reason: str | None, max_lifetime_seconds: int | None) -> str:
    """Why a rotation: the `rotate` signal's reason, else the instance's age."""
    if reason is None:
        return f"rotation by age: Ready for its max lifetime ({max_lifetime_seconds}s)"
    if reason.startswith(POOL_WORD):
        return f"the pool asked for a rotation: {reason.removeprefix(POOL_WORD)}"
    if reason == ROTATE_SIGNAL_DEFAULT:
        return "a rotate signal"
    return f"a rotate signal: {reason}"


def failed_probes(outcome: str, pool_said: str | None) -> str:
    """Why a replacement after the instance failed its probes (and the pool's word, if any)."""
    if pool_said is None:
        return f"the instance before failed its probes: {outcome}"
    return (
        f"the pool's monitor found the instance before failing ({pool_said}) "
        f"and its own probe agreed: {outcome}"
    )


def failed_to_come_up(failure: str) -> str:
    """Why a replacement after an instance never became Ready."""
    return f"the instance before never came up: {failure}"


def current_details(status: ProxyStatus) -> str:
    """The Web UI's account of the proxy (Markdown)."""
    lines = [f"**{status.state}** on `{markdown.text(status.provider or '?')}`"]
    if status.endpoint:
        lines.append(
            f"endpoint `{status.endpoint}` ({status.instance}, generation {status.generation})"
        )
    if status.cause is not None:
        which = "this instance" if status.instance else "a new instance"
        line = f"why {which}: {_cause(status.cause)}"
        if status.state == ProxyState.READY and status.ready_since:
            line += f"; Ready since {_second(status.ready_since)}"
        lines.append(line)
    if status.replaced_because is not None:
        lines.append(f"being replaced: {_cause(status.replaced_because)}")
    if status.waiting_for:
        lines.append(markdown.text(status.waiting_for))
    if status.disruptions:
        lines.append(
            f"{status.disruptions} taken away by the platform (preempted, interrupted, "
            "evicted) and replaced, not counted as crashes"
        )
    if status.last_error:
        at = status.last_error_at or "?"
        lines.append(f"last error ({at}): {markdown.text(status.last_error)}")
    return "\n\n".join(lines)


def _cause(cause: InstanceCause) -> str:
    return f"{markdown.text(cause.why)} ({cause.at})"


def _second(iso: str) -> str:
    """An ISO 8601 time to the second (a carried one may be anything: shown as is then)."""
    try:
        return datetime.fromisoformat(iso).isoformat(timespec="seconds")
    except ValueError:
        return markdown.text(iso)
