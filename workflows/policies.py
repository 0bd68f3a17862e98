"""Retry policies and timeouts for every activity, derived from the error taxonomy.

Defined once here; call sites pick a profile by name and never spell out a
policy of their own.

| error          | behaviour                                                        |
| -------------- | ---------------------------------------------------------------- |
| Transient      | a lifecycle's provider calls: handed to the workflow, which      |
|                | waits on a visible timer, "waiting for provider" (seconds        |
|                | doubling to 10 minutes), and never gives up; elsewhere retried   |
|                | by Temporal, exponential backoff capped at a minute              |
| QuotaExceeded  | handed to the workflow, which waits `next_retry_delay` (minutes) |
|                | on a visible timer while `status` says "waiting for quota"       |
| Permanent      | fails fast with the provider's message (non-retryable)           |
| NotFound       | delete: success; while provisioning: the instance vanished, and  |
|                | the activity reports InstanceLost so the workflow replaces it    |
|                | (InstanceDisrupted when its platform took it: no crash counted)  |

Deletes never give up: Temporal retries Transient forever, and the workflow
loops on Quota and Permanent with a long delay, because a leaked VM bills
every hour.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityCancellationType

from contract import ErrorType

# What no retry of the same call can fix: the workflow decides.
NON_RETRYABLE: list[str] = [
    ErrorType.PERMANENT,
    ErrorType.QUOTA_EXCEEDED,
    ErrorType.INSTANCE_LOST,
    ErrorType.INSTANCE_DISRUPTED,
    ErrorType.INVALID_INPUT,
]
TRANSIENT_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(minutes=1),
    non_retryable_error_types=NON_RETRYABLE,
)


@dataclass(frozen=True)
class Backoff:
    """A workflow's own wait between attempts: `first`, doubling each time up to `cap`."""

    first: timedelta
    cap: timedelta

    def delay(self, attempt: int) -> timedelta:
        """`first * 2**attempt`, at most `cap`; any `attempt`, however many, stays in range."""
        delay = self.first
        for _ in range(attempt):
            if delay >= self.cap:
                break
            delay *= 2
        return min(delay, self.cap)


# Before replacing what failed: a lifecycle's instance that failed again before
# it stayed healthy (its crash loop), or a pool's member that ended Failed. A
# pool member that could not start at all waits its `first`.
REPLACE_BACKOFF = Backoff(first=timedelta(seconds=10), cap=timedelta(minutes=5))


# A lifecycle's provider calls: Transient goes straight back to the workflow,
# which waits it out on a timer `status` shows (workflows/lifecycle.py). A
# lost worker (heartbeat or start-to-close timeout) is still retried here,
# at once and a few times, so the retry adopts what the lost attempt made.
PROVIDER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
    non_retryable_error_types=[ErrorType.TRANSIENT, *NON_RETRYABLE],
)


@dataclass(frozen=True)
class ActivityProfile:
    """Timeouts and retries for one kind of activity call."""

    start_to_close: timedelta
    heartbeat: timedelta | None = None
    schedule_to_close: timedelta | None = None


# A create heartbeats while the provider call runs (a GCP insert waits on its
# operation), so a worker lost mid-create is noticed within the heartbeat
# timeout and the retry, on another worker, adopts what the first attempt made.
CREATE = ActivityProfile(start_to_close=timedelta(minutes=10), heartbeat=timedelta(seconds=20))
WAIT_RUNNING = ActivityProfile(
    start_to_close=timedelta(minutes=15), heartbeat=timedelta(seconds=30)
)
WAIT_HEALTHY = ActivityProfile(start_to_close=timedelta(minutes=5), heartbeat=timedelta(seconds=30))
# How long the monitor runs before it reports back even when all is well:
# each report-back is a new activity (a billable schedule, a first heartbeat,
# a timer), so a long period keeps steady state cheap (docs/cost.md).
MONITOR_PERIOD = timedelta(hours=2)
# A monitor heartbeats on a clock of its own, whatever its probe interval
# (activities/provider.py): every `timeout - 60 s` (at least every half
# timeout), and each heartbeat is a billed action. The timeout is how long a
# lost worker leaves what it monitored unwatched: 270 s for a proxy of its
# own (a heartbeat every 210 s, about 17 actions an hour; back on another
# worker within 5 minutes), 100 s for a pool's monitor, which watches up to
# POOL_MONITOR_SHARD members under one heartbeat (within 2 minutes). A
# cancelled monitor hears of it only at a heartbeat, but a terminate or a
# rotation deletes its instance first: the monitor's next probe fails, it
# finds the instance gone and ends, so waiting for it adds about a probe
# interval to the deletion the workflow waits for anyway, and a terminate
# waits no longer than that for a monitor its worker lost (docs/cost.md).
MONITOR = ActivityProfile(
    start_to_close=MONITOR_PERIOD + timedelta(minutes=10), heartbeat=timedelta(seconds=270)
)
POOL_MONITOR = replace(MONITOR, heartbeat=timedelta(seconds=100))
# Members per pool monitor activity: enough that a 1,000-member pool runs 5,
# few enough that one worker's share of probes stays on time (bench.fleet).
POOL_MONITOR_SHARD = 200


def monitor_heartbeat(profile: ActivityProfile, heartbeat_timeout_seconds: int | None) -> timedelta:
    """The heartbeat timeout of a monitor: the proxy's own choice, else the profile's."""
    if heartbeat_timeout_seconds is not None:
        return timedelta(seconds=heartbeat_timeout_seconds)
    assert profile.heartbeat is not None
    return profile.heartbeat


@dataclass(frozen=True)
class DeletionProfiles:
    """The two calls of deleting an instance: the delete, then waiting until it is gone."""

    delete: ActivityProfile
    wait_gone: ActivityProfile


# A proxy's owner: no schedule-to-close, so Temporal retries Transient forever.
DELETION = DeletionProfiles(
    delete=ActivityProfile(start_to_close=timedelta(minutes=10)),
    wait_gone=ActivityProfile(
        start_to_close=timedelta(minutes=20), heartbeat=timedelta(seconds=30)
    ),
)
VALIDATE = ActivityProfile(
    start_to_close=timedelta(seconds=10), schedule_to_close=timedelta(seconds=30)
)

# A pool's check of a member's reported endpoint with its provider: a lookup
# by name where the provider has one, else a list call, retried through a
# provider's hiccups for a while; past that the pool asks again at its next
# step (after a QuotaExceeded's delay).
VERIFY = ActivityProfile(
    start_to_close=timedelta(seconds=30), schedule_to_close=timedelta(minutes=10)
)

# Orphan GC's own calls. Unlike a proxy's owner, GC gives up on one instance
# and counts it as failed: the next sweep tries again, while one stuck delete
# would hold this sweep, and the schedule skips every sweep while one runs.
GC_SURVEY = ActivityProfile(
    start_to_close=timedelta(minutes=5), schedule_to_close=timedelta(minutes=15)
)
GC_CONFIRM = ActivityProfile(
    start_to_close=timedelta(minutes=1), schedule_to_close=timedelta(minutes=10)
)
GC_DELETION = DeletionProfiles(
    delete=replace(DELETION.delete, schedule_to_close=timedelta(minutes=30)),
    wait_gone=replace(DELETION.wait_gone, schedule_to_close=timedelta(minutes=30)),
)

A = TypeVar("A")
R = TypeVar("R")


async def execute(
    activity: Callable[[Any, A], Awaitable[R]],
    arg: A,
    profile: ActivityProfile,
    summary: str,
    *,
    retry_policy: RetryPolicy = TRANSIENT_RETRY,
    cancellation_type: ActivityCancellationType = ActivityCancellationType.TRY_CANCEL,
) -> R:
    """Execute one activity method with its profile's timeouts and the given retries."""
    return await workflow.execute_activity_method(
        activity,
        arg,
        summary=summary,
        start_to_close_timeout=profile.start_to_close,
        heartbeat_timeout=profile.heartbeat,
        schedule_to_close_timeout=profile.schedule_to_close,
        retry_policy=retry_policy,
        cancellation_type=cancellation_type,
    )
