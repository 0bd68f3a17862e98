"""Compute Engine failures translated into the error taxonomy, once, at the edge.

Errors are read from the API's HTTP status and error reasons, or from the
error codes of a failed operation (`operation_error` makes those look alike).
Every public operation of the provider runs inside `edge()`, so nothing but
the taxonomy escapes it.
"""

from __future__ import annotations

import contextlib
import re
from typing import cast

from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from providers import errors as taxonomy

# Compute Engine counts API rate quotas per minute and says to "wait a minute
# then try your request again" (compute/api-quota): a rate limit is over
# within one, unlike a resource quota, so it is Transient with this hint.
RATE_LIMIT_RETRY_SECONDS = 60.0

# Error reasons (REST `errors[].reason`, ErrorInfo reason, or an operation's
# error code), compared without case and underscores: the REST API says
# `quotaExceeded` where an operation says `QUOTA_EXCEEDED`.
STOCKOUT_REASONS = frozenset({"zoneresourcepoolexhausted", "zoneresourcepoolexhaustedwithdetails"})
_QUOTA_REASONS = STOCKOUT_REASONS | {"quotaexceeded"}
# Rate limits: 403 `rateLimitExceeded` (a project's per-minute API quota),
# `userRateLimitExceeded`, and operation codes such as
# RESOURCE_OPERATION_RATE_EXCEEDED (too many operations on one resource).
# Any reason that names an exceeded rate counts, so a new code of that
# family is waited out, never taken for a bad request.
_RATE_LIMIT = re.compile(r"rate(limit)?exceeded$")
# "The resource ... is not ready": another operation on it is still running.
_RETRYABLE_REASONS = frozenset({"resourcenotready"})
# An organisation policy refusing the request (412 conditionNotMet, or
# CONDITION_NOT_MET in an operation): e.g. constraints/compute.vmExternalIpAccess.
# No retry gets past a policy. (412 also answers a stale fingerprint, which
# this provider never sends.)
_PERMANENT_REASONS = frozenset({"conditionnotmet"})
# Client errors that a later attempt can get past.
_RETRYABLE_STATUS = frozenset({408, 409, 429})


def edge() -> contextlib.AbstractContextManager[None]:
    """Every public operation runs in here: nothing but the taxonomy escapes."""
    return taxonomy.translated(normalise)


def normalise(
    exc: BaseException, *, missing: type[taxonomy.ProviderError] = taxonomy.NotFound
) -> taxonomy.ProviderError:
    """The one translation of Compute Engine failures into the taxonomy.

    Reasons beat status codes: Compute Engine reports quota and rate limits
    as 403, which alone would read as permission denied. A rate limit is
    Transient with a minute's hint (the server's Retry-After if it sent one):
    the pool's endpoint checks and the lifecycle's polls wait it out. `missing` is what a
    404 means to the caller (NotFound, or Permanent on insert).
    """
    if not isinstance(exc, api_exceptions.GoogleAPICallError):
        return taxonomy.classify(exc)  # connection errors, timeouts, unknowns: Transient
    found = reasons(exc)
    code = exc.code or 0
    kind: type[taxonomy.ProviderError]
    rate_limited = any(_RATE_LIMIT.search(r) for r in found)
    if rate_limited:
        kind = taxonomy.Transient
    elif found & _QUOTA_REASONS:
        kind = taxonomy.QuotaExceeded
    elif found & _PERMANENT_REASONS:
        kind = taxonomy.Permanent
    elif found & _RETRYABLE_REASONS:
        kind = taxonomy.Transient
    elif code == 404:
        kind = missing
    elif code in _RETRYABLE_STATUS or not 400 <= code < 500:
        kind = taxonomy.Transient
    else:
        kind = taxonomy.Permanent  # bad request, permission denied, invalid image or machine type
    retry_after = _retry_after(exc)
    if retry_after is None and (rate_limited or code == 429):
        retry_after = RATE_LIMIT_RETRY_SECONDS
    return kind(f"Compute Engine: {exc}", cause=exc, retry_after_seconds=retry_after)


def reasons(exc: api_exceptions.GoogleAPICallError) -> set[str]:
    """The error's reasons, lowercase and without underscores (see STOCKOUT_REASONS)."""
    found = [e.get("reason") for e in exc.errors if isinstance(e, dict)]
    found.append(exc.reason)
    return {r.replace("_", "").lower() for r in found if isinstance(r, str)}


def _retry_after(exc: api_exceptions.GoogleAPICallError) -> float | None:
    headers = getattr(exc.response, "headers", None)
    value = headers.get("Retry-After") if headers is not None else None
    return float(value) if isinstance(value, str) and value.isdigit() else None


def operation_error(
    op: compute_v1.Operation, *, note: str = ""
) -> api_exceptions.GoogleAPICallError:
    """A failed operation as the API error the same failure would be if synchronous.

    Its error codes become the reasons and its HTTP status the class, so
    `normalise` (and the stockout check in `create`) read both alike. `note`
    goes before the operation's own message.
    """
    errors = [{"reason": e.code, "message": e.message} for e in op.error.errors]
    message = "; ".join(f"{e.code}: {e.message}" for e in op.error.errors)
    error = api_exceptions.from_http_status(  # type: ignore[no-untyped-call]  # untyped in api_core
        op.http_error_status_code, f"{note}operation {op.name} failed: {message}", errors=errors
    )
    return cast(api_exceptions.GoogleAPICallError, error)
