"""What a person reads of a ProxyPool in the Temporal Web UI: pure text, no Temporal API.

The pool's history and its page should tell its story as a member's do
(docs/operations.md, "A pool in the Web UI"):

- `current_details` is the pool's current details (the User Metadata tab):
  its state, its size and counts, then one table row per member, at most
  `DETAIL_ROWS` of them, so a pool of hundreds keeps a small text; a
  reason too long for its cell is cut there and follows the table whole;
- `start_summary` and `start_details` are a member start's static summary
  and details (the child workflow's row in the pool's history, and the
  member's own page): which member, and why it was started;
- `alarm_summary` and `drain_summary` are the pool's timers: what it does
  when each fires.

- `signal_label` is the label of a `rotate` or `terminate` the pool sends
  to a member: Temporal's Python SDK (1.35) takes no summary for a signal to
  another workflow, but it takes an Event Group (experimental), whose label
  the server stores on the SignalExternalWorkflowExecutionInitiated event.
  The cause is in the signal's input too (`{"reason": "pool: ban: ..."}`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from contract import PoolState
from workflows import markdown
from workflows.pool_plan import ABANDONED, Member, MemberPhase

# Member rows in the current details; the rest are counted, and listed by `status`.
DETAIL_ROWS = 20
# The longest text in one table cell (a longer one follows the table whole),
# and in a static summary (the UI shows one line of it).
MAX_CELL = 80
MAX_SUMMARY = 160


def current_details(
    state: PoolState,
    replicas: int,
    ready: int,
    members: Sequence[Member],
    waiting_for: str | None,
    last_error: str | None,
) -> str:
    """The pool's state, size and counts, what it waits for, and a table of its first members.

    The size leads: a pool's static summary is fixed when it starts and
    goes stale with the first `scale`.
    """
    lines = [f"**{state}**: {replicas} replicas, {ready} Ready, {len(members)} members"]
    if waiting_for:
        lines.append(f"waiting for {markdown.text(waiting_for)}")
    if last_error:
        lines.append(f"last error: {markdown.text(last_error)}")
    if members:
        shown = members[:DETAIL_ROWS]
        header = ["member", "state", "endpoint", "generation", "last rotation or ban"]
        lines.append(markdown.table(header, [_row(m) for m in shown]))
        if len(members) > DETAIL_ROWS:
            lines.append(f"and {len(members) - DETAIL_ROWS} more members: the `status` query")
        cut = [(m.member, last_change(m)) for m in shown if len(last_change(m)) > MAX_CELL]
        if cut:
            lines.append("in full:")
            lines.append(
                "\n".join(f"- {markdown.text(name)}: {markdown.text(why)}" for name, why in cut)
            )
    return "\n\n".join(lines)


def _row(member: Member) -> list[str]:
    state = member.state
    if member.phase is not MemberPhase.ACTIVE:
        state += f", {member.phase}"
    # The endpoint its provider confirmed: a reported one is a signal's word.
    endpoint = member.verified
    if member.endpoint and member.endpoint != member.verified:
        endpoint = f"{endpoint} (checking a new one)" if endpoint else "(checking)"
    cells = [member.member, state, endpoint, str(member.generation), last_change(member)]
    return [_cell(c) for c in cells]


def last_change(member: Member) -> str:
    """The ban that keeps it out, else the rotation or removal under way, else the last rotation."""
    if member.banned is not None:
        return f"banned: {member.banned}"
    if member.phase is not MemberPhase.ACTIVE:
        return f"{member.phase}: {member.reason or 'rotate'}"
    if member.last_rotation is not None and member.last_rotation.startswith(ABANDONED):
        return f"rotation {member.last_rotation}"
    if member.last_rotation is not None:
        return f"rotated: {member.last_rotation}"
    return ""


def _cell(text: str) -> str:
    """One table cell: one line, shown as written, bounded (whole below the table)."""
    flat = " ".join(text.split())
    return markdown.text(flat if len(flat) <= MAX_CELL else flat[: MAX_CELL - 1] + "…")


def start_summary(member: Member, cause: str) -> str:
    """The child start's one line: which member, and why."""
    return _line(f"start {member.member}: {cause}")


def signal_label(signal: str, member: str, reason: str) -> str:
    """An outgoing signal's one line: what, to which member, and why."""
    return _line(f"{signal} {member}: {reason}")


def _line(text: str) -> str:
    """One line of at most MAX_SUMMARY characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_SUMMARY else flat[: MAX_SUMMARY - 1] + "…"


def start_details(pool_id: str, member: Member, cause: str) -> str:
    """The child start's details (Markdown): the pool, the cause in full, where and how long."""
    where = member.provider + "".join(f", {k}={v}" for k, v in sorted(member.placement.items()))
    lines = [
        f"**{member.member}**, member of pool `{pool_id}`",
        f"why: {markdown.text(cause)}",
        f"on: {where}",
    ]
    if member.lifetime_seconds is not None:
        lines.append(f"rotated by the pool after {member.lifetime_seconds:.0f}s Ready")
    return "\n\n".join(lines)


def alarm_summary(at: datetime, action: str) -> str:
    """The pool's one timer: when it fires and what the pool does then."""
    return f"at {at.isoformat(timespec='seconds')}: {action}"


def drain_summary(member: str, seconds: int, reason: str) -> str:
    """The wait before a member's `terminate`, while gateways drop it."""
    return f"drain {member} {seconds}s, then terminate it: {reason}"
