"""An autoscaled pool's decisions, applied: its size, the members a scale-down removes,
and what a gateway learns back.

What to decide is pure (workflows/pool_autoscale.py: the demand gateways
report, the size it calls for and why, when the next decision falls due);
this applies a decision to the pool's record and drains the members a
scale-down removes itself, banned, not serving, then the youngest first
(`pool_autoscale.victims`), where the plan would remove the oldest: the
plan then finds the pool at size. A fixed pool (no `autoscale` in its
input) has no bounds, and none of this does anything.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import pool_autoscale, pool_plan
    from workflows.pool_commands import Commands
    from workflows.pool_input import Autoscale
    from workflows.pool_plan import SCALED_DOWN, Wake
    from workflows.pool_record import PoolRecord


class Scaling:
    """Applies an autoscaled pool's decisions, at each step and on a gateway's `wake`."""

    def __init__(self, *, record: Callable[[], PoolRecord], commands: Commands) -> None:
        # `record`: the pool's record now.
        self._record = record
        self._commands = commands
        # Set once the run has its input: the bounds (None: a fixed pool), and
        # the seconds gateways get to drop a member before it is told to end.
        self.bounds: Autoscale | None = None
        self.drain = 0
        # Why the pool has its size now (`status`); each run says it again.
        self.why: str | None = None

    def step(self, now: datetime) -> None:
        """The pool's size for this step; a scale-down picks its members itself."""
        record = self._record()
        if self.bounds is None or record.autoscale is None or record.terminate_reason is not None:
            return
        self.take(pool_autoscale.decide(record.autoscale, self.bounds, record.replicas, now))

    def take(self, decision: pool_autoscale.Decision) -> None:
        """A decision into the record; the members a scale-down removes told to end."""
        record = self._record()
        record.autoscale, self.why = decision.books, decision.reason
        record.replicas = decision.replicas
        if decision.changed:
            workflow.logger.info("autoscale: %s", decision.reason)
        live = pool_plan.live(record.situation())
        for victim in pool_autoscale.victims(live, len(live) - record.replicas):
            victim.remove(SCALED_DOWN, self.drain)
            self._commands.drain_then_terminate(victim.member, SCALED_DOWN, self.drain)

    def next_wake(self) -> Wake | None:
        """When the next decision falls due, for an autoscaled pool."""
        autoscale = self._record().autoscale
        if self.bounds is None or autoscale is None:
            return None
        due = pool_autoscale.next_wake(autoscale, self.bounds)
        return None if due is None else Wake(due, "autoscale: a decision falls due")

    def answer(self, now: datetime) -> dict[str, Any]:
        """What a gateway learns from a report or a wake: the pool's size and cost."""
        record = self._record()
        return {
            "replicas": record.replicas,
            "member_seconds": pool_autoscale.counted(
                record.usage, record.usage.members, now
            ).member_seconds,
        }
