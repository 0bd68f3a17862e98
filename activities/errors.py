"""Provider errors become Temporal ApplicationErrors here, and only here.

The error type is the taxonomy class name, so retry policies
(workflows/policies.py) can select on it without importing providers.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio.exceptions import ApplicationError

from providers.errors import Permanent, ProviderError, QuotaExceeded

# Quota and capacity come back in minutes, not seconds, unless the provider
# says when to come back (Retry-After): its own hint wins.
QUOTA_RETRY_DELAY = timedelta(minutes=3)

INSTANCE_LOST = "InstanceLost"
INVALID_INPUT = "InvalidInput"


def to_application_error(err: ProviderError) -> ApplicationError:
    """Map one taxonomy error onto the ApplicationError the workflow will see."""
    delay: timedelta | None = None
    if err.retry_after_seconds is not None:
        delay = timedelta(seconds=err.retry_after_seconds)
    if isinstance(err, QuotaExceeded) and delay is None:
        delay = QUOTA_RETRY_DELAY
    return ApplicationError(
        err.message,
        type=type(err).__name__,
        non_retryable=isinstance(err, Permanent),
        next_retry_delay=delay,
    )


def instance_lost(message: str) -> ApplicationError:
    """The instance died or vanished while we waited on it: replace, do not retry."""
    return ApplicationError(message, type=INSTANCE_LOST, non_retryable=True)
