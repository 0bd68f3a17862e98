"""Reading activity failures in workflow code: their taxonomy type, message and delay.

Also `InstanceFailed`, the failure a lifecycle's bring-up raises for
anything a replacement could fix.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, TimeoutError

from contract import ErrorType

if TYPE_CHECKING:
    from activities.models import InstanceRef


def cause_type(err: ActivityError) -> str | None:
    """The ErrorType the activity raised, or None when it raised no ApplicationError."""
    cause = err.cause
    return cause.type if isinstance(cause, ApplicationError) else None


def message(err: ActivityError) -> str:
    cause = err.cause
    return cause.message if isinstance(cause, ApplicationError) else str(cause or err)


def ending_type(err: ApplicationError | ActivityError) -> str:
    """The type a lifecycle fails with for this error: its own, else UNCLASSIFIED."""
    if isinstance(err, ApplicationError):
        return err.type or ErrorType.UNCLASSIFIED
    return cause_type(err) or ErrorType.UNCLASSIFIED


def next_retry_delay(err: ActivityError) -> timedelta | None:
    cause = err.cause
    return cause.next_retry_delay if isinstance(cause, ApplicationError) else None


# What a provider in trouble raises, as opposed to what it says about an instance.
PROVIDER_TROUBLE = frozenset({ErrorType.TRANSIENT, ErrorType.WORKER_SHUTDOWN})


def provider_trouble(err: ActivityError) -> bool:
    """Whether the call failed for reasons of the provider or the workers, not the instance.

    Transient errors and activity timeouts (a worker lost more than once):
    waited out, never counted against the crash budget.
    """
    return isinstance(err.cause, TimeoutError) or cause_type(err) in PROVIDER_TROUBLE


def cancelled(err: ActivityError) -> bool:
    """Whether the activity failed because we cancelled it (terminate, cancel).

    Such a failure must end what awaited it, never count as a broken instance.
    """
    return isinstance(err.cause, CancelledError)


class InstanceFailed(Exception):
    """An instance could not be brought to Ready; the lifecycle replaces it."""

    def __init__(
        self, reason: str, ref: InstanceRef | None = None, *, disrupted: bool = False
    ) -> None:
        super().__init__(reason)
        self.ref = ref
        # The platform took the instance away: no failure of the proxy's.
        self.disrupted = disrupted
