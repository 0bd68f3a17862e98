"""A pool's alarm: why it steps again, a change or its one timer.

The pool never polls: it steps when something changed (a report, an update,
a command's end, a shard of its monitor) or when its alarm goes off, for
the earliest thing it must do on its own (`pool_plan.Wake`: a rotation
falling due, a backoff's end, the next reconcile). One timer at a time, so
a pool in steady state writes history only when a member's lifetime ends;
the timer's summary says what it is for (pool_view.alarm_summary).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import pool_view
    from workflows.pool_plan import Wake

# A wake already past is acted on in the step that computed it; one still
# past is retried this much later, never in a busy loop.
MIN_ALARM = timedelta(seconds=1)


class Alarm:
    """Whether the pool should step again (`changed`), and the one timer that sets it."""

    def __init__(self) -> None:
        # Something changed since the pool last stepped: a run steps at its start.
        self.changed = True
        self._timer: asyncio.Task[None] | None = None
        self._at: datetime | None = None

    def note_change(self) -> None:
        """Something changed: the pool steps again."""
        self.changed = True

    def set(self, wake: Wake | None) -> None:
        """One timer for the earliest wake; the one set is kept when early enough."""
        if wake is None:
            return
        if self._timer is not None and not self._timer.done():
            assert self._at is not None
            if self._at <= wake.at:
                return
            self._timer.cancel()
        delay = max(wake.at - workflow.now(), MIN_ALARM)
        self._at = wake.at
        summary = pool_view.alarm_summary(workflow.now() + delay, wake.action)
        self._timer = asyncio.create_task(self._go_off(delay, summary))

    def cancel(self) -> None:
        """No more wakes: the pool has ended its members."""
        if self._timer is not None:
            self._timer.cancel()

    async def _go_off(self, delay: timedelta, summary: str) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await workflow.sleep(delay, summary=summary)
            self.changed = True
