"""The instances a lifecycle is deleting: each until it is gone, given up only when refused.

A retired instance is deleted in the background while the lifecycle goes on
(a replacement comes up meanwhile). Quota and provider trouble are waited
out however long they last (workflows/lifecycle_calls.py), as a leaked
instance bills every hour. A Permanent refusal (the provider says the
instance is not ours: its tags name another owner) would be refused again
every time: the lifecycle forgets that instance, names it in its reason, and
ends as Failed once it has deleted everything else, as on a terminate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.models import InstanceRef
    from contract import PERMANENT_DELETE_RETRY_DELAY, ErrorType
    from workflows import failures, policies
    from workflows.deletion import delete_until_gone
    from workflows.lifecycle_calls import ProviderCalls
    from workflows.lifecycle_carried import CarriedState


class Deletions:
    """One lifecycle run's deletions, by provider id, and a refusal that ends the proxy."""

    def __init__(
        self,
        calls: ProviderCalls,
        carried: CarriedState,
        *,
        note_error: Callable[[str], None],
        publish: Callable[[], None],
        terminate: Callable[[str], None],
    ) -> None:
        # `terminate`: a refusal ends the proxy as a terminate signal would
        # (unless one came first), deleting everything else it owns.
        self._calls = calls
        self._carried = carried
        self._note_error = note_error
        self._publish = publish
        self._terminate = terminate
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Set when the provider refused to delete an instance for good: the
        # proxy then ends as Failed with this reason.
        self.refused: str | None = None

    @property
    def pending(self) -> bool:
        """Whether a deletion is under way."""
        return bool(self._tasks)

    def start(self, ref: InstanceRef) -> None:
        """Delete `ref` in the background, unless it is being deleted already."""
        if ref.provider_id not in self._tasks:
            self._tasks[ref.provider_id] = asyncio.create_task(self.delete_and_wait(ref))

    async def finished(self) -> None:
        """Until every deletion started has ended."""
        await asyncio.gather(*self._tasks.values())

    async def delete_and_wait(self, ref: InstanceRef) -> None:
        """Delete and wait until gone; gives up only when the provider refuses for good."""
        while True:
            try:
                await delete_until_gone(ref, self._calls.cleanup_call, policies.DELETION, ref.name)
            except ActivityError as err:
                if failures.cancelled(err):
                    raise  # the caller was cancelled; cleanup deletes what is still owned
                self._note_error(f"deleting {ref.name}: {failures.message(err)}")
                if failures.cause_type(err) == ErrorType.PERMANENT:
                    self._give_up(ref, failures.message(err))
                    return
                await workflow.sleep(
                    PERMANENT_DELETE_RETRY_DELAY, summary=f"retry deleting {ref.name}"
                )
                continue
            self._carried.disown(ref)
            self._tasks.pop(ref.provider_id, None)
            self._publish()
            return

    def _give_up(self, ref: InstanceRef, refusal: str) -> None:
        """Stop deleting an instance the provider refuses to delete; end the proxy as Failed.

        The instance is forgotten (no cleanup asks again) and named in the
        reason, so an operator can look at it; terminate machinery deletes
        everything else the proxy owns, as it does on a terminate signal.
        """
        self._carried.disown(ref)
        self._tasks.pop(ref.provider_id, None)
        reason = (
            f"gave up deleting {ref.name} ({ref.provider_id}): the provider refused "
            f"for good: {refusal}"
        )
        self.refused = self.refused or reason
        self._note_error(reason)
        self._terminate(reason)
        self._publish()
