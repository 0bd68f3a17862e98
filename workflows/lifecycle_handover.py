"""A lifecycle's hand-over to a new run (continue-as-new), so its history stays bounded.

A proxy runs for months; its history must stay far below Temporal's
51,200-event limit. A run hands over once the server suggests it or its
history reaches EVENT_BUDGET: between monitor cycles in Ready or Unhealthy
(`if_suggested`), and between two calls of a long wait for quota or a
provider (`if_long`, `terminating_if_long`), which costs about 11 events a
call and would pass the limit in about ten days of quota. It hands over only
with no provider activity in flight, no handler running and the pool's
signals delivered, so nothing reports to a closed run. The next run takes
the carried state as it was (`CarriedState`) and resumes there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from contract import ProxyState
    from workflows.inputs import ProxyInput
    from workflows.lifecycle_calls import ProviderCalls
    from workflows.lifecycle_carried import CarriedState
    from workflows.lifecycle_deletions import Deletions
    from workflows.lifecycle_monitors import Monitors
    from workflows.lifecycle_publish import StatusPublisher

# A run continues as new once its history has this many events, whether or
# not the server suggests it (its default suggestion comes at about 4,000
# too; a test server may never suggest): far below the 51,200-event limit.
EVENT_BUDGET = 4_000


def history_long() -> bool:
    """Whether this run's history is long enough to hand over (server's word or EVENT_BUDGET)."""
    info = workflow.info()
    return info.is_continue_as_new_suggested() or info.get_current_history_length() >= EVENT_BUDGET


class HandOver:
    """Decides when one lifecycle run continues as new, and does it."""

    def __init__(
        self,
        carried: CarriedState,
        calls: ProviderCalls,
        deletions: Deletions,
        monitors: Monitors,
        publisher: StatusPublisher,
        *,
        proxy_input: Callable[[], ProxyInput | None],
        terminate_reason: Callable[[], str | None],
    ) -> None:
        # `proxy_input`: the checked input, which the next run starts with.
        self._carried = carried
        self._calls = calls
        self._deletions = deletions
        self._monitors = monitors
        self._publisher = publisher
        self._proxy_input = proxy_input
        self._terminate_reason = terminate_reason

    async def if_suggested(self) -> None:
        """Between monitor cycles: hand over to a new run when the server suggests it
        or the run passed EVENT_BUDGET."""
        if not history_long():
            return
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._terminate_reason() is not None:
            return  # run() is about to clean up; a new run would lose the signal
        if self._deletions_calling():
            # Their activities would report to a closed run (a warning in the
            # worker's log): continue after the next monitor cycle instead,
            # rather than leave the instance unmonitored while they finish.
            return
        await self._continue_as_new()

    def due(self) -> bool:
        """A Ready run's history is long, and neither a terminate nor a deletion holds
        its hand-over back (`if_suggested` would refuse it: a wake for it would come
        again at once, for ever)."""
        return self._terminate_reason() is None and history_long() and not self._deletions_calling()

    def _deletions_calling(self) -> bool:
        """Whether a pending deletion is calling its provider now.

        One between calls (waiting out quota or an outage) starts again in
        the next run, so it does not hold back a run that waits for days.
        """
        return self._deletions.pending and self._calls.in_flight != 0

    async def between_calls(self, carried: bool) -> None:
        """After a wait's timer, before the next call: hand over if the history is long.

        `carried`: the wait is the lifecycle's own, which the next run goes on
        with; else it is a deletion's, which hands over only while Terminating.
        """
        if carried:
            await self.if_long()
        elif self._carried.state == ProxyState.TERMINATING:
            await self.terminating_if_long()

    async def if_long(self) -> None:
        """In the middle of a long wait: continue as new once the history is long.

        Called between two calls of the wait, with none in flight; the next run
        resumes the bring-up where this one was (`CarriedState.bringing_up`,
        `CarriedState.provider_wait`).
        """
        if not history_long() or self._calls.in_flight or self._terminate_reason() is not None:
            return
        if self._monitors.retired_running:
            return  # a rotation's old monitor ends within a heartbeat: at the next call
        await self._monitors.drop_old()  # a rotation's old monitor: the next run starts another
        await self._monitors.settle_retired()
        await workflow.wait_condition(workflow.all_handlers_finished)
        await self._publisher.delivered()
        if self._terminate_reason() is None:
            await self._continue_as_new()

    async def terminating_if_long(self) -> None:
        """Terminating, a delete waiting out quota or an outage: continue as new once long.

        As `if_long`, between two calls with none in flight; the next run
        restarts every deletion still owed and goes straight back to
        Terminating with the same reason.
        """
        if not history_long() or self._calls.in_flight:
            return
        if self._monitors.retired_running:
            return
        await workflow.wait_condition(workflow.all_handlers_finished)
        await self._publisher.delivered()
        if self._calls.in_flight:
            return  # another deletion called its provider meanwhile: at its next wait
        self._carried.terminating = self._terminate_reason()
        self._carried.delete_refused = self._deletions.refused
        await self._continue_as_new()

    async def _continue_as_new(self) -> None:
        """Hand over to a new run, carrying the state as it is now."""
        inp = self._proxy_input()
        assert inp is not None
        self._publisher.upsert_owed()
        workflow.continue_as_new(
            args=[
                inp.model_dump(mode="json", exclude_none=True),
                # A copy: unwinding this run's tasks must not change what is carried.
                copy.deepcopy(self._carried),
            ]
        )
