"""Waiting on conditions with deadlines, never on sleeps: a workflow's status, anything else."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from temporalio.client import WorkflowHandle

from workflows.inputs import MIN_HEARTBEAT_TIMEOUT_SECONDS
from workflows.lifecycle import ProxyLifecycle, ProxyStatus

DEADLINE = 60.0
# wait_for's pauses between checks: doubling from the first to the longest.
FIRST_PAUSE = 0.05
LONGEST_PAUSE = 0.5
# A monitor learns of its cancel only at its next heartbeat, which comes as
# rarely as its heartbeat timeout allows (docs/cost.md): 270 s by default. A
# test that must see its monitor end (an instance that outlives a terminate,
# say) gives the proxy the shortest timeout it may choose, QUICK_HEARTBEAT,
# and waits that long, plus a busy machine's margin.
QUICK_HEARTBEAT = {"heartbeat_timeout_seconds": MIN_HEARTBEAT_TIMEOUT_SECONDS}
MONITOR_CANCEL_DEADLINE = MIN_HEARTBEAT_TIMEOUT_SECONDS + DEADLINE
T = TypeVar("T")


async def status_of(handle: WorkflowHandle[Any, Any]) -> ProxyStatus:
    return await handle.query(ProxyLifecycle.status, result_type=ProxyStatus)


async def pending_activities(handle: WorkflowHandle[Any, Any]) -> list[str]:
    """The activity types a workflow is waiting on now, as the server describes them."""
    description = await handle.describe()
    return [a.activity_type.name for a in description.raw_description.pending_activities]


async def wait_for(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    what: str,
    deadline: float = DEADLINE,
) -> None:
    """Poll `check` until it is true; fail naming `what` after `deadline` seconds.

    Polled often at first, then every LONGEST_PAUSE: a check is most often a
    workflow query, which costs the server and the worker a task each time,
    and a minute-long wait at a steady 10 Hz asked 600 of them.
    """
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline
    pause = FIRST_PAUSE
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > until:
            raise AssertionError(f"timed out after {deadline:.0f}s waiting for {what}")
        await asyncio.sleep(pause)
        pause = min(pause * 2, LONGEST_PAUSE)


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    """`wait_for` for synchronous tests: poll `check` until true, failing after `timeout`."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def wait_status(
    handle: WorkflowHandle[Any, Any],
    predicate: Callable[[ProxyStatus], bool],
    what: str,
    deadline: float = DEADLINE,
) -> ProxyStatus:
    seen: list[ProxyStatus] = []

    async def check() -> bool:
        seen.append(await status_of(handle))
        return predicate(seen[-1])

    try:
        await wait_for(check, what, deadline)
    except AssertionError as err:
        raise AssertionError(f"{err}; last status: {seen[-1] if seen else None}") from None
    return seen[-1]


async def rotated(handle: WorkflowHandle[Any, Any], after: ProxyStatus, reason: str) -> ProxyStatus:
    """Signal `rotate`; the status once a generation newer than `after`'s is Ready."""
    await handle.signal("rotate", {"reason": reason})
    return await wait_status(
        handle,
        lambda s: s.state == "Ready" and s.generation > after.generation,
        f"rotated ({reason})",
    )


def until(fetch: Callable[[], T], done: Callable[[T], bool], timeout: float, every: float) -> T:
    """Poll a real cloud until `done(fetch())`; the last value past `timeout` (the opt-in tests)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(every)
