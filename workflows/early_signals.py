"""Signals that reach a continued run before it has taken over its carried state.

A run started by continue-as-new takes over its previous run's state (the
pool's members, a lifecycle's instance) from its second argument. Signals
can come first: the SDK applies a workflow task's signals before it starts
the run method (temporalio's `_WorkflowInstanceImpl.activate` orders signal
jobs before the start job), the server holds a continued run's first task
back for up to `history.workflowIdReuseMinimalInterval` (1 s by default;
`history.continueAsNewMinInterval` in older servers) while signals keep
arriving, and they all come in that first task. A handler that ran then changed state the takeover
overwrote: a `terminate` sent to a pool or a proxy as it continued as new
was lost (it ran on), a lifecycle's `rotate` too, and a member's `Ready`
report was dropped as coming from an unknown member, so the pool counted
that member as starting until the member's next report, which in steady
state never comes. Such signals are now held and applied again once the
state is taken over.
"""

from __future__ import annotations

from collections.abc import Callable

from workflows.patches import Patches

# Continued runs recorded before this patch lost the signals that came before
# their takeover; replaying them still does (docs/upgrades.md).
EARLY_SIGNALS_PATCH = "early-signals-after-takeover"


class EarlySignals:
    """The signals a run received before its takeover, to be applied again after it."""

    def __init__(self) -> None:
        self._held: list[Callable[[], None]] | None = []
        self._apply_again = False

    @property
    def taken_over(self) -> bool:
        """Whether the run has its state: what an update is checked against waits for it."""
        return self._held is None

    def hold(self, again: Callable[[], None]) -> None:
        """Keep `again` (the handler, with the signal's arguments) until the takeover."""
        if self._held is not None:
            self._held.append(again)

    def decide(self, patches: Patches, continued: bool) -> None:
        """Decide before the run's first await, so a replay records the patch where it was."""
        self._apply_again = continued and patches.taken(EARLY_SIGNALS_PATCH)

    def took_over(self) -> None:
        """The run's state is in place: apply the held signals again, and hold no more.

        Every handler held is one whose effect the takeover replaced, and one
        that may run twice: a report already known is ignored the second time.
        """
        held, self._held = self._held or [], None
        if self._apply_again:
            for again in held:
                again()
