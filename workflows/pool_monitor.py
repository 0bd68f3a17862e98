"""A pool's monitor: its members probed in shards, one heartbeat for a whole shard.

A proxy of its own pays for its monitor's heartbeats (about 17 billable
actions an hour); a member a pool starts takes `monitor: "pool"` and runs no
monitor: the pool runs one `monitor_members` activity per shard of up to
policies.POOL_MONITOR_SHARD members, which probes the endpoints the pool
advertises and returns when one keeps failing. The pool then signals that
member `instance_failing`, and the member probes its own instance before it
believes it (workflows/lifecycle.py): a signal anyone could send never
replaces a healthy proxy.

A member's shard is the CRC-32 of its id modulo the number of shards, so a
change in one member's endpoint restarts only its shard's activity. A
restart cancels the old activity and goes on without waiting for it (it
ends after its next round, when it asks the server whether its run still
wants it, or at its next heartbeat) and happens at most once per
REFRESH per shard: while a pool rotates hundreds of members an hour, a
newly advertised endpoint waits up to REFRESH for its shard to pick it up
(it has just passed its own first probe), and an old one is probed that
long after it went, which does no harm: a failure is told only about the
endpoint the pool still advertises. A pool that continues as new cancels
its shards and goes: each ends quietly once it finds the run gone, after
a round (it asks the server at most every 5 s) or at its next heartbeat,
whichever comes first. A pool that ends cancels them and waits for them
(`stop`, while its members end), so that none outlives it: each ends
after a round too, once the server lists its cancel as requested.

The pool refreshes after every step, most of which change no endpoint: a
refresh that finds the members, their endpoints and its shards as it left
them returns at once, as the full pass over 1,000 members took a fifth of
a pool's own CPU per step (and so of every replay of its history).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.workflow import ActivityCancellationType, ActivityHandle

with workflow.unsafe.imports_passed_through():
    from activities.models import (
        FailingMember,
        MonitorReason,
        PoolMonitorInput,
        PoolMonitorOutcome,
        WatchedMember,
    )
    from activities.provider import ProviderActivities
    from workflows import policies
    from workflows.inputs import HealthInput

# A shard's activity is restarted for a changed membership at most this often.
REFRESH = timedelta(seconds=60)

# A member the pool advertises, as `refresh` takes it: (member id, provider, endpoint).
Watch = tuple[str, str, str]


def shards(watched: Sequence[Watch], size: int) -> dict[int, list[Watch]]:
    """The members each shard watches, by member id: `size` on average, by the CRC-32
    of the member id."""
    if not watched:
        return {}
    count = -(-len(watched) // size)
    split: dict[int, list[Watch]] = {}
    for watch in sorted(watched):  # member ids are unique: sorted by member id
        split.setdefault(_crc(watch[0]) % count, []).append(watch)
    return split


@functools.lru_cache(maxsize=16_384)
def _crc(member: str) -> int:
    """A member id's CRC-32, kept: a full refresh asks it of every member (pure, so a
    worker's pools may share it)."""
    return zlib.crc32(member.encode())


@dataclass
class _Shard:
    """One running (or ended) shard activity and what it was started to watch."""

    watching: list[Watch]
    started: datetime
    handle: ActivityHandle[PoolMonitorOutcome]


class PoolMonitor:
    """The shard activities of one pool run; `refresh` after every step, `stop` at the end."""

    def __init__(
        self,
        tell: Callable[[FailingMember], None],
        woken: Callable[[], None],
        task_queue: str | None = None,
    ) -> None:
        # `tell`: a member's advertised endpoint keeps failing. `woken`: a
        # shard ended, so the pool steps (and refreshes) again. `task_queue`:
        # where the shards probe from, the members' (None: the pool's own).
        self._tell = tell
        self._woken = woken
        self._task_queue = task_queue
        self._shards: dict[int, _Shard] = {}
        # Cancelled (restarted or stopped), not yet ended.
        self._cancelled: list[ActivityHandle[PoolMonitorOutcome]] = []
        # What the last full refresh was given and returned; `None` after a
        # shard ended or all were cancelled, so the next refresh looks again.
        self._seen: tuple[Watch, ...] | None = None
        self._later: datetime | None = None

    @property
    def watched(self) -> int:
        """How many members the running shards watch."""
        return sum(len(s.watching) for s in self._shards.values() if not s.handle.done())

    def refresh(
        self, watched: Sequence[Watch], health: HealthInput, now: datetime
    ) -> datetime | None:
        """Start what is missing, restart what changed, stop what is gone.

        Returns when to be asked again: a changed shard whose activity
        started less than REFRESH ago waits until then.
        """
        key = tuple(watched)
        if key == self._seen and (self._later is None or now < self._later):
            return self._later  # nothing changed since the last full refresh
        self._seen, self._later = key, self._full_refresh(key, health, now)
        return self._later

    def _full_refresh(
        self, watched: tuple[Watch, ...], health: HealthInput, now: datetime
    ) -> datetime | None:
        wanted = shards(watched, policies.POOL_MONITOR_SHARD)
        later: datetime | None = None
        for index in set(self._shards) - set(wanted):
            self._cancel(self._shards.pop(index).handle)
        for index, members in sorted(wanted.items()):
            shard = self._shards.get(index)
            running = shard is not None and not shard.handle.done()
            if running and shard is not None and shard.watching == members:
                continue
            if shard is not None and (running or _failed(shard.handle)):
                # Changed, or failed (not a normal return): not sooner than REFRESH.
                due = shard.started + REFRESH
                if now < due:
                    later = due if later is None else min(later, due)
                    continue
                self._cancel(shard.handle)
            self._shards[index] = self._start(index, len(wanted), members, health, now)
        return later

    def cancel(self) -> None:
        """Cancel every shard activity; `stop` waits for them to end."""
        for shard in self._shards.values():
            self._cancel(shard.handle)
        self._shards.clear()
        self._seen = None

    async def stop(self) -> None:
        """Cancel every shard activity and wait until each has ended."""
        self.cancel()
        await workflow.wait_condition(lambda: not self._cancelled)

    def _cancel(self, handle: ActivityHandle[PoolMonitorOutcome]) -> None:
        if not handle.done():
            handle.cancel()
            self._cancelled.append(handle)

    def _start(
        self,
        index: int,
        count: int,
        members: list[Watch],
        health: HealthInput,
        now: datetime,
    ) -> _Shard:
        handle = workflow.start_activity_method(
            ProviderActivities.monitor_members,
            PoolMonitorInput(
                [WatchedMember(*w) for w in members],
                health.target,
                interval_seconds=health.interval_seconds,
                failure_threshold=health.failure_threshold,
                max_duration_seconds=policies.MONITOR_PERIOD.total_seconds(),
                probe_timeout_seconds=health.timeout_seconds,
            ),
            task_queue=self._task_queue,
            summary=(
                f"monitor {len(members)} members every {health.interval_seconds:g}s"
                f" (shard {index + 1} of {count})"
            ),
            start_to_close_timeout=policies.POOL_MONITOR.start_to_close,
            heartbeat_timeout=policies.monitor_heartbeat(
                policies.POOL_MONITOR, health.heartbeat_timeout_seconds
            ),
            retry_policy=policies.TRANSIENT_RETRY,
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        handle.add_done_callback(self._ended)
        return _Shard(members, now, handle)

    def _ended(self, handle: ActivityHandle[PoolMonitorOutcome]) -> None:
        """A shard returned: tell who keeps failing; the next refresh starts it again."""
        # Asked first, also of a cancelled shard: a failure nobody looked at is
        # logged by asyncio ("exception was never retrieved") when collected.
        failed = _failed(handle)
        self._seen = None  # the next refresh starts it again
        if handle in self._cancelled:
            self._cancelled.remove(handle)
        elif not failed:
            outcome = handle.result()
            if outcome.reason == MonitorReason.UNHEALTHY:
                for failing in outcome.failing:
                    self._tell(failing)
        self._woken()


def _failed(handle: ActivityHandle[PoolMonitorOutcome]) -> bool:
    """Whether a finished shard activity ended without returning (cancelled or failed)."""
    return handle.cancelled() or handle.exception() is not None
