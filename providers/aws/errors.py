"""EC2 failures translated into the error taxonomy, once, at the edge.

EC2 answers every failure with an error code (docs.aws.amazon.com/AWSEC2/
latest/APIReference/errors-overview.html); the code, not the HTTP status,
says what it means: a capacity shortage is a 500, an exhausted instance
quota a 400, throttling a 503. Every public operation of the provider runs
inside `edge()`, so nothing but the taxonomy escapes it.
"""

from __future__ import annotations

import contextlib

from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

from providers import errors as taxonomy

# No capacity for the type in that availability zone: another zone may have
# some (the provider tries its next subnet), or this one minutes later.
CAPACITY_CODES = frozenset(
    {"InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientAddressCapacity"}
)
# The instance type is not offered in that availability zone ("Troubleshoot
# Amazon EC2 instance launch issues", Unsupported): another zone may offer it.
UNSUPPORTED = "Unsupported"
# The spot price in that zone is above max_price; another zone's may be lower.
SPOT_PRICE_TOO_LOW = "SpotMaxPriceTooLow"
# What sends a create on to its next subnet, in another availability zone.
NEXT_ZONE_CODES = CAPACITY_CODES | {UNSUPPORTED, SPOT_PRICE_TOO_LOW}
# Account quotas: retry after minutes, once instances have gone or the limit is raised.
_QUOTA_CODES = CAPACITY_CODES | {
    "InstanceLimitExceeded",
    "VcpuLimitExceeded",
    "MaxSpotInstanceCountExceeded",
    "SecurityGroupLimitExceeded",
    "RulesPerSecurityGroupLimitExceeded",
    # The spot price is above max_price now; it moves, so wait as for capacity.
    SPOT_PRICE_TOO_LOW,
}
GROUP_NOT_FOUND = "InvalidGroup.NotFound"
# Throttling and the server side: retry with backoff. RequestLimitExceeded is
# EC2's throttle (HTTP 503); its request tokens refill every second.
_TRANSIENT_CODES = frozenset(
    {
        "RequestLimitExceeded",
        "Throttling",
        "InternalError",
        "ServiceUnavailable",
        "Unavailable",
        "IncorrectInstanceState",
        "IncorrectState",
        # A security group EC2 does not show yet ("Eventual consistency in
        # the Amazon EC2 API"), or one deleted by hand: the provider forgets
        # the group it knew, and the retry finds or creates it again.
        GROUP_NOT_FOUND,
    }
)
# The instance is not listed: gone, or not visible yet (providers.aws.consistency).
INSTANCE_NOT_FOUND = "InvalidInstanceID.NotFound"
# A RunInstances client token already used with other parameters: the
# instance it made exists (the provider looks it up by token and adopts it).
IDEMPOTENT_MISMATCH = "IdempotentParameterMismatch"


def edge() -> contextlib.AbstractContextManager[None]:
    """Every public operation runs in here: nothing but the taxonomy escapes."""
    return taxonomy.translated(normalise)


def code(exc: BaseException) -> str:
    """EC2's error code of a ClientError, "" for anything else."""
    if not isinstance(exc, ClientError):
        return ""
    return str(exc.response.get("Error", {}).get("Code", ""))


def normalise(exc: BaseException) -> taxonomy.ProviderError:
    """The one translation of EC2 failures into the taxonomy.

    UnauthorizedOperation and AuthFailure (a missing IAM permission, bad
    credentials), no credentials at all, invalid parameters and unknown
    images are Permanent;
    anything unclassified by code is judged by its HTTP status: 5xx is
    Transient, 4xx Permanent. Connection errors and timeouts are Transient.
    """
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        # The default chain found nothing usable: no retry brings credentials.
        return taxonomy.Permanent(f"AWS credentials: {exc}", cause=exc)
    if not isinstance(exc, ClientError):
        return taxonomy.classify(exc)
    found = code(exc)
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    kind: type[taxonomy.ProviderError]
    if found in _QUOTA_CODES:
        kind = taxonomy.QuotaExceeded
    elif found in _TRANSIENT_CODES or status >= 500 or status in (0, 429):
        kind = taxonomy.Transient
    elif found == INSTANCE_NOT_FOUND:
        kind = taxonomy.NotFound
    else:
        kind = taxonomy.Permanent
    message = exc.response.get("Error", {}).get("Message", "")
    return kind(f"EC2: {found or status}: {message}", cause=exc)
