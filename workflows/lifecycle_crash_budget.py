"""A lifecycle's crash budget: how many failed instances in a row it replaces before it fails.

An instance that fails before it stayed healthy for STABLE_AFTER spends the
budget; CRASH_BUDGET of them in a row end the proxy as Failed, since a proxy
that cannot keep one instance up would otherwise create and delete them for
ever. Between them the lifecycle backs off (REPLACE_BACKOFF); the first
replacement after a healthy spell starts at once. The counts are carried
(`CarriedState.failures_in_a_row`, `disruptions_in_a_row`), so a run that
continues as new keeps the budget where it was.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from contract import ErrorType
    from workflows.lifecycle_calls import ProviderCalls
    from workflows.lifecycle_carried import CarriedState
    from workflows.patches import DISRUPTIONS_SPARE_THE_CRASH_BUDGET, taken
    from workflows.policies import REPLACE_BACKOFF

# Crash-loop budget: this many instances in a row that fail before staying
# healthy for STABLE_AFTER end the workflow as Failed. Between them the
# workflow waits REPLACE_BACKOFF (10 s doubling to 5 minutes); the first
# replacement after a healthy spell starts at once.
CRASH_BUDGET = 5
STABLE_AFTER = timedelta(minutes=10)


def ready_for(carried: CarriedState) -> timedelta:
    """How long the current instance has been Ready (zero when none is)."""
    ready_since = carried.ready_since
    if ready_since is None:
        return timedelta(0)
    return workflow.now() - datetime.fromisoformat(ready_since)


class CrashBudget:
    """Spends and restores one lifecycle's crash budget, backing off between failures."""

    def __init__(
        self,
        calls: ProviderCalls,
        carried: CarriedState,
        *,
        raise_if_stopping: Callable[[], None],
        note_error: Callable[[str], None],
    ) -> None:
        self._calls = calls
        self._carried = carried
        self._raise_if_stopping = raise_if_stopping
        self._note_error = note_error

    def stable_left(self) -> timedelta | None:
        """Time until the current instance has been Ready for STABLE_AFTER, if that matters."""
        carried = self._carried
        if carried.failures_in_a_row == 0 or carried.ready_since is None:
            return None
        return max(timedelta(0), STABLE_AFTER - ready_for(carried))

    def forgive_if_stable(self) -> None:
        """An instance that stayed healthy long enough resets the crash budget."""
        if ready_for(self._carried) >= STABLE_AFTER:
            self._carried.failures_in_a_row = 0

    async def count_failure(self, reason: str, *, disrupted: bool = False) -> None:
        """Spend the crash budget; fail the workflow when it is gone, else back off.

        The first failure after a healthy spell is replaced at once; repeated
        ones wait longer each time. An instance its platform took away
        (`disrupted`: preempted, interrupted, evicted) is no failure of the
        proxy's: it is counted apart and never fails the proxy
        (DISRUPTIONS_SPARE_THE_CRASH_BUDGET), but a platform that keeps taking instances away
        before one is Ready is backed off from the same way, so it costs a
        create every few minutes, not a loop of them.
        """
        self._raise_if_stopping()
        carried = self._carried
        if disrupted and taken(DISRUPTIONS_SPARE_THE_CRASH_BUDGET):
            carried.disruptions += 1
            carried.disruptions_in_a_row += 1
            self._note_error(f"platform disruption, no crash counted: {reason}")
            await self._back_off(carried.disruptions_in_a_row, "instances taken away")
            return
        carried.failures_in_a_row += 1
        self._note_error(reason)
        in_a_row = carried.failures_in_a_row
        if in_a_row >= CRASH_BUDGET:
            raise ApplicationError(
                f"gave up after {in_a_row} failed instances in a row; last: {reason}",
                type=ErrorType.CRASH_LOOP,
                non_retryable=True,
            )
        await self._back_off(in_a_row, "failed instances")

    async def _back_off(self, in_a_row: int, what: str) -> None:
        """Replace the first of a row at once; wait REPLACE_BACKOFF before each after."""
        if in_a_row == 1:
            return
        delay = REPLACE_BACKOFF.delay(in_a_row - 2)
        await self._calls.wait(
            f"backing off after {in_a_row} {what} in a row",
            delay,
            summary=f"back off {int(delay.total_seconds())}s",
            interruptible=False,  # the lifecycle is cancelled on terminate, and this timer with it
        )
