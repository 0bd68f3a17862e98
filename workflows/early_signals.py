"""Signals that reach a continued run before it has taken over its carried state.

A run started by continue-as-new takes over its previous run's state (the
pool's members, a lifecycle's instance) from its second argument. Signals
can come first: the SDK applies a workflow task's signals before it starts
the run method (temporalio's `_WorkflowInstanceImpl.activate` orders signal
jobs before the start job), the server holds a continued run's first task
back for up to `history.workflowIdReuseMinimalInterval` (1 s by default;
`history.continueAsNewMinInterval` in older servers) while signals keep
arriving, and they all come in that first task. A handler that runs then
changes state the takeover overwrites: a `terminate` sent to a pool or a
proxy as it continues as new would be lost, a lifecycle's `rotate` too, and
a member's `Ready` report would be dropped as coming from an unknown member.
Such signals are held and applied again once the state is taken over.
"""

from __future__ import annotations

from collections.abc import Callable


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

    def decide(self, continued: bool) -> None:
        """A continued run applies its held signals again; a first run's had no takeover."""
        self._apply_again = continued

    def took_over(self) -> None:
        """The run's state is in place: apply the held signals again, and hold no more.

        Every handler held is one whose effect the takeover replaced, and one
        that may run twice: a report already known is ignored the second time.
        """
        held, self._held = self._held or [], None
        if self._apply_again:
            for again in held:
                again()
