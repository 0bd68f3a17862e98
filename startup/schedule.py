"""The orphan GC schedule, created or updated by every worker at start.

Idempotent and safe when many workers start at once: create, and when the
schedule already exists, update it in place. The update keeps the schedule's
state, so an operator's `temporal schedule toggle --pause` survives worker
restarts; the interval and the action come from the worker's flags.
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
)

from contract import ORPHAN_GC, ORPHAN_GC_SCHEDULE_ID

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = timedelta(minutes=10)
# Workers of many installations should not sweep their clouds in lockstep.
JITTER_FRACTION = 0.1

_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(text: str) -> timedelta:
    """`10m`, `1h30m`, `45s` (the Temporal CLI's style) -> timedelta; at least a second."""
    match = _DURATION.match(text.strip())
    if not text.strip() or match is None:
        raise ValueError(f"invalid duration {text!r}: use e.g. 10m, 1h30m or 45s")
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    duration = timedelta(hours=hours, minutes=minutes, seconds=seconds)
    if duration < timedelta(seconds=1):
        raise ValueError(f"invalid duration {text!r}: must be at least 1s")
    return duration


def orphan_gc_schedule(task_queue: str, interval: timedelta) -> Schedule:
    """Every `interval` with jitter; a sweep still running makes the next one skip."""
    return Schedule(
        action=ScheduleActionStartWorkflow(
            ORPHAN_GC, {}, id=ORPHAN_GC_SCHEDULE_ID, task_queue=task_queue
        ),
        spec=ScheduleSpec(
            intervals=[ScheduleIntervalSpec(every=interval)],
            jitter=interval * JITTER_FRACTION,
        ),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )


async def ensure_orphan_gc_schedule(
    client: Client,
    *,
    task_queue: str,
    interval: timedelta = DEFAULT_INTERVAL,
    schedule_id: str = ORPHAN_GC_SCHEDULE_ID,
) -> None:
    """Create the schedule, or update the one that exists: never a second one."""
    schedule = orphan_gc_schedule(task_queue, interval)
    try:
        await client.create_schedule(schedule_id, schedule)
    except ScheduleAlreadyRunningError:
        pass
    else:
        log.info("created schedule %s: OrphanGC every %s", schedule_id, interval)
        return

    def update(existing: ScheduleUpdateInput) -> ScheduleUpdate:
        schedule.state = existing.description.schedule.state
        return ScheduleUpdate(schedule)

    await client.get_schedule_handle(schedule_id).update(update)
    log.info("updated schedule %s: OrphanGC every %s", schedule_id, interval)
