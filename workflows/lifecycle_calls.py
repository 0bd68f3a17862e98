"""A lifecycle's provider calls, which wait out quota and provider trouble on visible timers.

Transient provider errors (5xx, 429, timeouts, a refused API connection) and
activity timeouts are not retried inside Temporal, where nothing shows them:
`ProviderCalls` waits each one out on a timer while `status.waiting_for`
says what for, and never gives up, however long, since a create given up
strands a proxy and a delete given up leaks an instance that bills every
hour. An outage never spends the crash budget. The lifecycle's own calls
carry their wait across continue-as-new (`CarriedState.provider_wait`); a
long wait hands the run over between two calls, with none in flight
(`ProviderCalls.in_flight`, workflows/lifecycle_handover.py).

`Waits` is what `status.waiting_for` is read from: every wait in progress
(provider, quota, backoff, a failing first probe), by its timer's summary.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from activities.provider import ProviderActivities
    from contract import QUOTA_RETRY_DELAY, ErrorType
    from workflows import failures, policies
    from workflows.lifecycle_carried import CarriedState, ProviderWait

A = TypeVar("A")
R = TypeVar("R")

# A provider that keeps failing (5xx, 429, timeouts, refused connections) is
# waited out on a visible timer: PROVIDER_WAIT (5 s doubling to 10 minutes),
# or the provider's own Retry-After. Never given up on, however long.
PROVIDER_WAIT = policies.Backoff(first=timedelta(seconds=5), cap=timedelta(minutes=10))

# How a cancelled activity ends: waited for, so none outlives the workflow.
CANCELLATION = ActivityCancellationType.WAIT_CANCELLATION_COMPLETED


class Waits:
    """Every wait in progress, by its timer's summary: `status.waiting_for` shows the newest."""

    def __init__(self, publish: Callable[[], None]) -> None:
        # `publish`: the lifecycle's one step that tells the world of a change.
        self._publish = publish
        self._waits: dict[str, str] = {}

    @property
    def newest(self) -> str | None:
        """What `status.waiting_for` says: the wait begun last, or None."""
        return next(reversed(self._waits.values()), None)

    def begin(self, key: str, waiting_for: str) -> None:
        """Show a wait (again: re-inserted, the newest wait is the one shown)."""
        self._waits.pop(key, None)
        self._waits[key] = waiting_for
        self._publish()

    def calling_again(self, summary: str, wait: ProviderWait) -> None:
        """Keep the wait in status while the call is tried again, under the wait's own timer.

        Between the timer and the call's answer the proxy is still waiting:
        status says so instead of nothing. Not published here, which would
        move the commands that publishing issues in recorded histories: the
        timer's end publishes it, and `status` reads it anyway.
        """
        self._waits.pop(summary, None)
        self._waits[summary] = f"{wait.shown}, calling again"

    def end(self, key: str) -> None:
        """The wait is over: status shows it no more."""
        # Also called from `finally` blocks, which run when the worker evicts
        # this run from its cache and closes its coroutines: outside the
        # workflow's event loop no workflow call may run, and none is needed.
        if self._waits.pop(key, None) is not None and workflow.in_workflow():
            self._publish()

    def forget(self, key: str) -> None:
        """The wait is over; status shows it no more from the next publish on."""
        self._waits.pop(key, None)


class ProviderCalls:
    """One lifecycle run's provider activities, each waiting out quota and provider trouble."""

    def __init__(
        self,
        waits: Waits,
        carried: CarriedState,
        *,
        terminate_reason: Callable[[], str | None],
        note_error: Callable[[str], None],
        between_calls: Callable[[bool], Awaitable[None]],
    ) -> None:
        # `terminate_reason`: set once terminate or cancel arrived. `between_calls`:
        # after a wait's timer, before the next call (whether the wait is the
        # lifecycle's own, carried): where a long wait hands the run over.
        self._waits = waits
        self._carried = carried
        self._terminate_reason = terminate_reason
        self._note_error = note_error
        self._between_calls = between_calls
        # Provider activities running now, of every task: a run hands over
        # only when none is, so none reports to a closed run.
        self.in_flight = 0

    async def call(
        self,
        activity: Callable[[ProviderActivities, A], Awaitable[R]],
        arg: A,
        profile: policies.ActivityProfile,
        summary: str,
        *,
        interruptible: bool = True,
    ) -> R:
        """Execute one provider activity; wait out quota and provider trouble on visible timers.

        `status.waiting_for` says "waiting for provider: <message>" for
        PROVIDER_WAIT, doubling each time. Terminate and cancel end an
        `interruptible` call between attempts at once; a completed activity's
        result is never thrown away, so a create that succeeded is cleaned up.
        """
        # The lifecycle's own calls (interruptible: one at a time) carry their
        # wait across continue-as-new; cleanup's deletions, several at once,
        # each keep their own and start again in the next run.
        carried = interruptible
        wait = (self._carried.provider_wait if carried else None) or ProviderWait(since="")
        try:
            return await self._waiting_out_the_provider(
                activity, arg, profile, summary, interruptible=interruptible, wait=wait
            )
        finally:
            # The wait is over, however it ended (a hand-over carried a copy);
            # status shows it no more from the next publish on.
            self._waits.forget(summary)
            if carried:
                self._carried.provider_wait = None

    async def cleanup_call(
        self,
        activity: Callable[[ProviderActivities, A], Awaitable[R]],
        arg: A,
        profile: policies.ActivityProfile,
        summary: str,
    ) -> R:
        """A provider call that terminate does not interrupt: the deletes that end a proxy."""
        return await self.call(activity, arg, profile, summary, interruptible=False)

    async def wait(
        self, waiting_for: str, delay: timedelta, *, summary: str, interruptible: bool
    ) -> None:
        """Sleep on a timer while status and the Web UI say what for.

        An interruptible wait ends at once on terminate or cancel (raising
        CancelledError), instead of when its timer fires.
        """
        self._waits.begin(summary, waiting_for)
        try:
            if interruptible:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: self._terminate_reason() is not None,
                        timeout=delay,
                        timeout_summary=summary,
                    )
                self._raise_if_stopping()
            else:
                await workflow.sleep(delay, summary=summary)
        finally:
            self._waits.end(summary)

    async def _waiting_out_the_provider(
        self,
        activity: Callable[[ProviderActivities, A], Awaitable[R]],
        arg: A,
        profile: policies.ActivityProfile,
        summary: str,
        *,
        interruptible: bool,
        wait: ProviderWait,
    ) -> R:
        """`call`'s loop; `wait` is its progress, carried for the lifecycle's calls."""
        carried = interruptible
        while True:
            if interruptible:
                self._raise_if_stopping()
            if wait.shown:  # a wait this run took over
                self._waits.calling_again(summary, wait)
            try:
                self.in_flight += 1
                try:
                    result = await policies.execute(
                        activity,
                        arg,
                        profile,
                        summary,
                        retry_policy=policies.PROVIDER_RETRY,
                        cancellation_type=CANCELLATION,
                    )
                finally:
                    self.in_flight -= 1
                return result
            except ActivityError as err:
                if interruptible and not failures.cancelled(err):
                    self._raise_if_stopping()
                if failures.cause_type(err) == ErrorType.QUOTA_EXCEEDED:
                    waiting_for = "quota"
                    delay = failures.next_retry_delay(err) or QUOTA_RETRY_DELAY
                elif failures.provider_trouble(err):
                    waiting_for = "provider"
                    delay = failures.next_retry_delay(err) or PROVIDER_WAIT.delay(
                        wait.provider_failures
                    )
                    wait.provider_failures += 1
                else:
                    raise
                wait.failed_calls += 1
                wait.since = wait.since or workflow.now().isoformat(timespec="seconds")
                if carried:
                    self._carried.provider_wait = wait
                self._note_error(failures.message(err))
                wait.shown = (
                    f"waiting for {waiting_for}: {failures.message(err)} "
                    f"(since {wait.since}, {wait.failed_calls} failed calls)"
                )
                self._waits.calling_again(summary, wait)
                await self.wait(
                    wait.shown,
                    delay,
                    summary=f"waiting for {waiting_for} ({summary})",
                    interruptible=interruptible,
                )
                await self._between_calls(carried)

    def _raise_if_stopping(self) -> None:
        """End an interruptible call once terminate or cancel has arrived."""
        reason = self._terminate_reason()
        if reason is not None:
            raise asyncio.CancelledError(reason)
