"""Delete an instance and wait until its provider no longer knows it.

One sequence for the owner and for orphan GC. What differs is a parameter:
how a call is made (the owner waits out quota on a visible timer, GC does
not), the profiles (GC's give up on one orphan after their schedule-to-close)
and what the caller does with an error (the owner tries again forever, GC
counts it and goes on).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from temporalio import workflow

from workflows.policies import ActivityProfile, DeletionProfiles

with workflow.unsafe.imports_passed_through():
    from activities.models import InstanceInput, InstanceRef
    from activities.provider import ProviderActivities

# How one provider activity is executed: activity method, argument, profile, summary.
Call = Callable[
    [
        Callable[[ProviderActivities, InstanceInput], Awaitable[None]],
        InstanceInput,
        ActivityProfile,
        str,
    ],
    Awaitable[None],
]


async def delete_until_gone(
    ref: InstanceRef, call: Call, profiles: DeletionProfiles, label: str
) -> None:
    """Delete `ref`, then wait until it is gone; an ActivityError is the caller's to judge.

    `label` names the instance in the Web UI's activity summaries.
    """
    await call(
        ProviderActivities.delete_instance, InstanceInput(ref), profiles.delete, f"delete {label}"
    )
    await call(
        ProviderActivities.wait_gone,
        InstanceInput(ref),
        profiles.wait_gone,
        f"wait for {label} to be gone",
    )
