"""Stopping a test's Temporal worker without hanging the suite on a known SDK bug.

sdk-core can leave an activity long poll pending for ever when a worker
shuts down while that poll is in flight and the server answers
`ShutdownWorker` with UNIMPLEMENTED or UNAVAILABLE
(https://github.com/temporalio/sdk-rust/issues/1297): `Worker.shutdown()`
then never returns. A busy CI machine hit it in a fixture's teardown, where
pytest-timeout did not end it (the SDK's shutdown swallows the timeout's
exception), and the whole run waited until CI killed it.

So a test stops its worker with a deadline. Past it the worker is left
behind (its pollers end with the session's server) and a warning says so;
everything the test asserted has already been asserted by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from temporalio.worker import Worker

log = logging.getLogger(__name__)

# Far longer than a healthy shutdown takes (a second or two, the time the
# running activities need to see their cancel), far shorter than CI's patience.
SHUTDOWN_DEADLINE = 60.0


async def stop_worker(worker: Worker, deadline: float = SHUTDOWN_DEADLINE) -> None:
    """Shut `worker` down, giving up after `deadline` seconds (sdk-rust#1297)."""
    try:
        await asyncio.wait_for(asyncio.shield(worker.shutdown()), deadline)
    except TimeoutError:
        log.warning(
            "worker on %s did not shut down within %.0fs (sdk-rust#1297); left behind",
            worker.config().get("task_queue"),
            deadline,
        )


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[Worker]:
    """`async with running(worker)`: as `async with worker`, but its stop is bounded."""
    run = asyncio.get_running_loop().create_task(worker.run())
    try:
        yield worker
    finally:
        await stop_worker(worker)
        if run.done():
            run.result()  # a worker that died: say so rather than only time out
