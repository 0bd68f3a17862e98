"""A pool run's event budget: when it continues as new, and the hold before it does.

A pool of 1,000 members plans over all of them at each workflow task, so a
worker that must replay its history (after a restart, an eviction or a
timed-out task) pays that for every task in it. The budget keeps each run
short: past it (or when the server suggests it) the run continues as new.
It keeps that replay to about 0.3 to 0.6 s in process at 1,000 members, a
run holding for a surge of rotations the longest (docs/benchmarks.md).

A run past its budget cannot always continue as new at once: a member it has just
started or told to rotate reports within seconds, and a report that crosses
the continue-as-new is refused by the server (the worker then replays the
run). So the run holds: it issues nothing new, so the commands in flight
end, for MAX_HOLD at most, as a long drain may be among them. Before the
budget is spent, `headroom` says how many removals and rotations a step may
still start (`pool_plan.command_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from temporalio import workflow

# A pool continues as new past either (`EventBudget.spent`).
POOL_EVENT_BUDGET = 500
POOL_HISTORY_BUDGET = 1024 * 1024
# About what one removal or rotation writes into the pool's history: a
# rotation is the `rotate` signal out (2 events), the member's Ready report
# (1) and the check of its new endpoint (3), the workflow tasks around them
# shared with others; a surge of 100 took a run from just under 500 events
# to about 1,030 (5.3 each).
EVENTS_PER_COMMAND = 6
# The longest a run past its budget holds new commands back before it
# plans again.
MAX_HOLD = timedelta(seconds=60)


@dataclass(frozen=True)
class Reading:
    """The budget as one step reads it."""

    # Time to continue as new: the server suggests it, or the run is past its budget.
    spent: bool
    # New commands are held back, so those in flight end before it continues as new.
    holding: bool


class EventBudget:
    """One run's event budget, and since when it has held new commands back."""

    def __init__(self) -> None:
        # When the run began holding new commands back (not carried: each run its own).
        self._hold_since: datetime | None = None

    def spent(self) -> bool:
        """Continue as new when the server suggests it or past the pool's own budget."""
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= POOL_EVENT_BUDGET
            or info.get_current_history_size() >= POOL_HISTORY_BUDGET
        )

    def read(self, now: datetime) -> Reading:
        """Whether the budget is spent, and whether to hold; a hold starts at the first
        step that finds it spent, and stays started for the rest of the run."""
        spent = self.spent()
        if spent and self._hold_since is None:
            self._hold_since = now
        holding = self._hold_since is not None and now - self._hold_since < MAX_HOLD
        return Reading(spent, holding)

    def hold_ends(self) -> datetime | None:
        """When a hold under way gives up waiting and plans again."""
        return None if self._hold_since is None else self._hold_since + MAX_HOLD

    def headroom(self) -> int:
        """The removals and rotations this run's events still hold (`pool_plan.command_batch`)."""
        left = POOL_EVENT_BUDGET - workflow.info().get_current_history_length()
        return max(0, left // EVENTS_PER_COMMAND)
