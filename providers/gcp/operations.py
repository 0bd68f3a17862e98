"""Bounds on API calls, and waiting for Compute Engine's long-running operations.

Writes use the `*_unary` client methods and wait through the injected
operations clients. The SDK's ExtendedOperation would poll through a hidden
operations client of its own, which neither the tests nor the operation
deadline here control.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from google.cloud import compute_v1

from providers.errors import Transient
from providers.gcp.errors import operation_error

# One API call, not counting operation waits; a hung connection must not
# outlive the activity that made it.
CALL_TIMEOUT_SECONDS = 60.0
# Default bound on one operation: the insert in one zone (a zone that reports
# a stockout late leaves the next one its own full budget), a delete, or the
# firewall.
OPERATION_TIMEOUT_SECONDS = 120.0
# `wait` may return before the operation is done, in the worst case at once;
# this keeps a loop of such answers from hammering the API's rate quota.
MIN_WAIT_INTERVAL_SECONDS = 1.0

# One `operations.wait` call of a zonal or global operations client: (name, timeout).
Waiter = Callable[[str, float], compute_v1.Operation]


def wait_done(
    op: compute_v1.Operation, deadline: float, wait: Waiter, budget: float
) -> compute_v1.Operation:
    """The operation once DONE, failed or not; Transient if `deadline` passes first.

    `budget` is the time the caller allowed, for the message. A timeout is
    Transient: the retried call adopts the instance (409) or finds it gone
    (404), so nothing is lost by giving up here.
    """
    while op.status != compute_v1.Operation.Status.DONE:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            status = compute_v1.Operation.Status(op.status).name
            raise Transient(f"Compute Engine operation {op.name} still {status} after {budget:g}s")
        op = wait(op.name, remaining)
        if op.status != compute_v1.Operation.Status.DONE:
            time.sleep(max(0.0, min(MIN_WAIT_INTERVAL_SECONDS, deadline - time.monotonic())))
    return op


def wait_succeeded(op: compute_v1.Operation, deadline: float, wait: Waiter, budget: float) -> None:
    """Wait until `op` is DONE (see `wait_done`); raise its error if it failed."""
    done = wait_done(op, deadline, wait, budget)
    if done.error.errors:
        raise operation_error(done)
