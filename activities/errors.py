"""Provider errors become Temporal ApplicationErrors here, and only here.

The error type is the taxonomy's name (contract.ErrorType), so retry policies
(workflows/policies.py) select on it without importing providers.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from contract import QUOTA_RETRY_DELAY, ErrorType
from providers.base import Disruption
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded


def to_application_error(err: ProviderError) -> ApplicationError:
    """Map one taxonomy error onto the ApplicationError the workflow will see."""
    delay: timedelta | None = None
    if err.retry_after_seconds is not None:
        delay = timedelta(seconds=err.retry_after_seconds)
    if isinstance(err, QuotaExceeded) and delay is None:
        delay = QUOTA_RETRY_DELAY
    # A NotFound's disruption travels as its one detail (`disruption_of`).
    details = (err.disruption.value,) if isinstance(err, NotFound) and err.disruption else ()
    return ApplicationError(
        err.message,
        *details,
        type=type(err).__name__,  # an ErrorType of the provider taxonomy
        non_retryable=isinstance(err, Permanent),
        next_retry_delay=delay,
    )


def is_not_found(err: ApplicationError) -> bool:
    """Whether a provider call failed because the instance does not exist."""
    return err.type == ErrorType.NOT_FOUND


def disruption_of(err: ApplicationError) -> Disruption | None:
    """The disruption a NotFound carries: the platform took the instance away."""
    if not is_not_found(err) or not err.details:
        return None
    return Disruption(err.details[0])


def instance_disrupted(message: str) -> ApplicationError:
    """The platform took the instance away while we waited on it: replace, spend no crash.

    Benign, as InstanceLost: the workflow shows it and acts on it.
    """
    return ApplicationError(
        message,
        type=ErrorType.INSTANCE_DISRUPTED,
        non_retryable=True,
        category=ApplicationErrorCategory.BENIGN,
    )


def instance_lost(message: str) -> ApplicationError:
    """The instance died or vanished while we waited on it: replace, do not retry.

    Benign: the workflow shows it (`status.last_error`) and acts on it, and it
    is what a terminate's deletion makes of a first probe still running, so
    the SDK logs it at debug instead of as a warning with a traceback.
    """
    return ApplicationError(
        message,
        type=ErrorType.INSTANCE_LOST,
        non_retryable=True,
        category=ApplicationErrorCategory.BENIGN,
    )


def invalid_input(message: str) -> ApplicationError:
    """Input no retry can fix; the message names the field."""
    return ApplicationError(message, type=ErrorType.INVALID_INPUT, non_retryable=True)
