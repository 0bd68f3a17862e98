"""Asking the worker about a proxy's target: what only it knows of providers, placement, ports.

Both a lifecycle's input and a pool's template (and each spread entry) are
checked this way, in the `validate_target` local activity, which also names
the worker's installation.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.models import TargetCheck, ValidateTargetInput
    from activities.provider import ProviderActivities
    from workflows import policies


def target_input(
    provider: str, port: int | None, placement: Any, health_target: str
) -> ValidateTargetInput:
    """The activity's input from raw fields; a placement that is not an object counts as none."""
    return ValidateTargetInput(
        provider=provider,
        port=port,
        placement=(
            {k: str(v) for k, v in placement.items() if v is not None}
            if isinstance(placement, dict)
            else {}
        ),
        health_target=health_target,
    )


async def check_target(target: ValidateTargetInput) -> TargetCheck:
    """The worker's verdict: every problem with the target, and its installation."""
    return await workflow.execute_local_activity_method(
        ProviderActivities.validate_target,
        target,
        start_to_close_timeout=policies.VALIDATE.start_to_close,
        schedule_to_close_timeout=policies.VALIDATE.schedule_to_close,
        retry_policy=policies.TRANSIENT_RETRY,
    )
