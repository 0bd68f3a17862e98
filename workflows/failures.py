"""Reading activity failures in workflow code: their taxonomy type, message and delay."""

from __future__ import annotations

from datetime import timedelta

from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

# The failure type when an error carries no taxonomy type of its own.
UNCLASSIFIED = "Failed"


def error_type(err: ActivityError) -> str | None:
    cause = err.cause
    return cause.type if isinstance(cause, ApplicationError) else None


def message(err: ActivityError) -> str:
    cause = err.cause
    return cause.message if isinstance(cause, ApplicationError) else str(cause or err)


def failure_type(err: ApplicationError | ActivityError) -> str:
    if isinstance(err, ApplicationError):
        return err.type or UNCLASSIFIED
    return error_type(err) or UNCLASSIFIED


def next_retry_delay(err: ActivityError) -> timedelta | None:
    cause = err.cause
    return cause.next_retry_delay if isinstance(cause, ApplicationError) else None


def cancelled(err: ActivityError) -> bool:
    """Whether the activity failed because we cancelled it (terminate, cancel).

    Such a failure must end what awaited it, never count as a broken instance.
    """
    return isinstance(err.cause, CancelledError)
