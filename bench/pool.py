"""ProxyPool against its targets (docs/benchmarks.md).

    python -m bench.pool [--members 200] [--squids 4] [--steady-minutes 3] [--real 20]
        [--workflow-task-slots 8] [--shared-worker] [--save-history FILE]

1. A pool of `--members` on an in-memory provider, every instance served by
   one of `--squids` real local Squids (probes are real), its workers
   processes of their own as deployed (bench/fleet/worker_process.py): one
   for the pool on the pools' task queue, one for its members (or, with
   `--shared-worker`, one for both on one queue); the TLS origin and this
   script outside them: time from start to all Ready, and the
   pool's workflow tasks on the way (the longest and what came before them,
   how many took over a second, how many the server timed out or failed,
   the largest event and history before a continue-as-new, read from its
   histories) and the SDK's own warnings in the workers' logs; then, with
   nothing to scale or rotate, the pool's history events over
   `--steady-minutes`, scaled to a pool-hour, and the workers' CPU meanwhile;
   then the pools' worker restarts, and `rotate {"all": true}` (`max_surge`
   10%) runs until every member serves from a new instance: the pool's
   first task on the new worker (a replay of its run) and its tasks through
   the rotation; then `terminate` until the pool and all its members ended,
   and its tasks through that.
   First, without a server: at the pool's maximum size with every string
   at its cap, the continue-as-new payload and the largest `status` page;
   and the rotations an hour its plans keep up with, 1 h lifetimes.
   `--save-history` writes the largest run's history as JSON, the form
   `Replayer.replay_workflow(WorkflowHistory.from_json(...))` reads, to
   replay or profile it apart.
2. A pool of `--real` real local Squids: time to all Ready, then `rotate
   {"all": true}` to every member on a new instance, one surge at a time.

Real dev server, a local TLS origin. Prints tables, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import Client, WorkflowExecutionDescription, WorkflowHandle
from temporalio.service import RPCError
from temporalio.worker import Replayer

from activities.provider import ProviderActivities
from bench.fleet.parameters import FLEET_PROVIDER, SQUID_PROVIDER
from bench.fleet.sampling import cpu_snapshot
from bench.fleet.squids import SquidGround, create_squids, squid_ground
from bench.fleet.worker_process import WorkerProcess, worker_spec
from contract import MEMBER_CHANGED_SIGNAL, POOL_QUEUE_SUFFIX, ProxyState
from providers.config import Config
from tests.helpers.pool_simulation import T0, rotations_in, simulate
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.worst_pool import LIFETIMES, pages, payload_size, worst_member, worst_state
from tests.helpers.worst_pool import POOL as WORST_POOL
from worker import DEFAULT_MAX_WORKFLOW_TASKS, SERVE_POOLS, build_worker, workflow_task_slots
from workflows.pool import ProxyPool
from workflows.pool_carried import encode
from workflows.pool_input import DEFAULT_PAGE, MAX_PAGE, MAX_REPLICAS, PoolInput
from workflows.pool_status import member_status

POLL = 5.0
SLOWEST = 5
PAGE_LIMITS = (DEFAULT_PAGE, MAX_PAGE)
# A Compute Engine boot (docs/operations.md, Rotation throughput).
ROTATION_BOOT = timedelta(seconds=75)
SURGES: tuple[int | str, ...] = ("3%", 1)
# The memory pool's rotations under way at once when it rotates all its members.
ROTATION_SURGE = "10%"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=200)
    parser.add_argument("--squids", type=int, default=4)
    parser.add_argument("--steady-minutes", type=float, default=3.0)
    parser.add_argument("--real", type=int, default=20)
    parser.add_argument(
        "--workflow-task-slots",
        type=workflow_task_slots,
        default=DEFAULT_MAX_WORKFLOW_TASKS,
        help="the worker's --max-concurrent-workflow-tasks; default %(default)s",
    )
    parser.add_argument(
        "--shared-worker",
        action="store_true",
        help="the pool on its members' task queue and worker, not a worker of its own",
    )
    parser.add_argument(
        "--save-history",
        type=Path,
        metavar="FILE",
        help="write the largest pool run's history to FILE as JSON",
    )
    args = parser.parse_args()
    if args.members > MAX_REPLICAS:
        parser.error(f"--members: a pool holds at most {MAX_REPLICAS} (workflows/pool_input.py)")
    _at_the_maximum()
    env = await start_dev_server()
    try:
        async with squid_ground("pool") as ground:
            await _memory_pool(env.client, ground, args)
            if args.real:
                await _real_pool(env.client, ground, args.real)
    finally:
        await env.shutdown()


async def _memory_pool(client: Client, ground: SquidGround, args: Any) -> None:
    endpoints = await create_squids(ground.squids, ground.config, args.squids)
    spec = worker_spec(client, ground.origin, endpoints, ground.workdir, "pool")
    spec["workflow_task_slots"] = args.workflow_task_slots
    worker = WorkerProcess(_subdirectory(ground.workdir, "members"), spec)
    workers = [worker]
    pool_queue = spec["task_queue"]
    if not args.shared_worker:
        pool_queue += POOL_QUEUE_SUFFIX
        pools_spec = {**spec, "task_queue": pool_queue, "serve": SERVE_POOLS}
        workers.append(WorkerProcess(_subdirectory(ground.workdir, "pools"), pools_spec))
    try:
        for each in workers:
            await each.wait_ready()
        template = {"provider": FLEET_PROVIDER, "health": {"target": ground.origin.url}}
        handle, ready_s = await _start_until_ready(client, pool_queue, args.members, template)
        tasks = await _task_figures(client, handle)
        # Let the last reports and the first reconcile settle, then watch.
        await asyncio.sleep(15)
        events_before = await _events(handle)
        late_before = _late_rounds(await worker.results_now())
        before = [cpu_snapshot(each.pid) for each in workers]
        await asyncio.sleep(args.steady_minutes * 60)
        after = [cpu_snapshot(each.pid) for each in workers]
        events = await _events(handle) - events_before
        late = _late_rounds(await worker.results_now()) - late_before
        restarted: tuple[float, int] | None = None
        if not args.shared_worker:
            # The pools' worker restarts (a deploy, a crash): the pool's next
            # task replays its current run first.
            await workers[1].stop()
            at_restart = await handle.describe()
            workers.append(WorkerProcess(_subdirectory(ground.workdir, "pools-again"), pools_spec))
            await workers[-1].wait_ready()
            restarted = await _first_task_after(client, handle, at_restart)
        rotate_s = await _rotate_all(handle, args.members)
        through_rotation = await _task_figures(client, handle)
        ending_began = time.monotonic()
        await handle.signal("terminate")
        await handle.result()
        ending_s = time.monotonic() - ending_began
        through_end = await _task_figures(client, handle)
        replay_s, replayed_events = await _replay(
            client, handle.id, through_rotation.largest_run, args.save_history
        )
        warnings = sum(
            (_sdk_warnings(each.log.read_text(errors="replace")) for each in workers), Counter()
        )
    finally:
        for each in workers:
            await each.stop()
    wall = after[0].at - before[0].at
    per_hour = events * 3600 / wall
    print(
        f"\nPool of {args.members} on the memory provider ({args.squids} real Squids behind), "
        f"{'one worker' if args.shared_worker else 'the pool on a worker of its own'}, "
        f"{args.workflow_task_slots} workflow task slots each"
    )
    print("| what | figure |\n| --- | --- |")
    print(f"| start to all {args.members} Ready | {ready_s:.1f} s |")
    print(f"| pool runs (continue-as-new) until all Ready | {tasks.runs} |")
    print(
        f"| pool history events until all Ready, every run (members' reports among them) "
        f"| {tasks.events} ({tasks.reports}) |"
    )
    print(f"| longest pool workflow task | {tasks.longest_s:.2f} s |")
    print(f"| pool workflow tasks over 1 s | {tasks.over_1s} of {tasks.tasks} |")
    causes = ", ".join(f"{n} {c}" for c, n in tasks.failed_causes.most_common()) or "none"
    print(f"| pool workflow tasks timed out / failed | {tasks.timed_out} / {tasks.failed} |")
    print(f"| why they failed (server's cause) | {causes} |")
    for took, run, event_id, came_after in tasks.slowest:
        print(f"| a slowest task: run {run}, event {event_id}, after {came_after} | {took:.2f} s |")
    print(f"| largest pool history event (a payload) | {tasks.largest_event / 1024:.0f} KiB |")
    print(f"| largest pool history (one run) | {tasks.largest_history / 1024:.0f} KiB |")
    print(
        f"| replay of the largest run's history ({replayed_events} events), "
        f"in this process, the pool ended | {replay_s:.1f} s |"
    )
    sdk = ", ".join(f"{n} {code}" for code, n in warnings.most_common()) or "none"
    print(f"| SDK warnings in the workers' logs (task duration, payload size) | {sdk} |")
    print(f"| pool history events in {wall / 60:.1f} min of steady state | {events} |")
    print(f"| pool history events per pool-hour (scaled) | {per_hour:.0f} |")
    print(
        f"| pool monitor rounds in steady state (each probes its shard) | {late[None]:.0f}: "
        f"{late[None] - late[1.0]:.0f} started over 1 s late, "
        f"{late[None] - late[10.0]:.0f} over 10 s (an interval) |"
    )
    print(
        f'| `rotate {{"all": true}}` (max_surge {ROTATION_SURGE}) until every member serves '
        f"from a new instance | {rotate_s:.1f} s ({args.members * 3600 / rotate_s:.0f} an hour) |"
    )
    if restarted is not None:
        took, replayed = restarted
        print(
            f"| the pool's first task after its worker restarted (a replay of its run, "
            f"{replayed} events) | {took:.2f} s |"
        )
    _print_tasks_until("the rotation's end", through_rotation)
    print(f"| `terminate` until the pool and every member ended | {ending_s:.1f} s |")
    _print_tasks_until("the pool's end", through_end)
    cpu = [100 * (a.worker - b.worker) / wall for a, b in zip(after, before, strict=True)]
    shares = " + ".join(f"{c:.1f}" for c in cpu)
    print(f"| worker processes' CPU, steady state (members + pool) | {shares} % of a core |")


def _print_tasks_until(when: str, figures: _TaskFigures) -> None:
    causes = ", ".join(f"{n} {c}" for c, n in figures.failed_causes.most_common())
    print(
        f"| pool runs, most events in one, longest task, tasks over 1 s, timed out / failed: "
        f"start to {when} | {figures.runs}, {figures.longest_run}, {figures.longest_s:.2f} s, "
        f"{figures.over_1s} of {figures.tasks}, "
        f"{figures.timed_out} / {figures.failed}{f' ({causes})' if causes else ''} |"
    )


def _at_the_maximum() -> None:
    """What a pool of MAX_REPLICAS carries and answers with every string at its cap, and
    the rotations an hour its plans keep up with (computed, no server)."""
    members = [worst_member(n) for n in range(MAX_REPLICAS)]
    carried = payload_size(encode(worst_state(), WORST_POOL, LIFETIMES))
    largest = {limit: max(map(payload_size, pages(members, limit))) for limit in PAGE_LIMITS}
    unpaged = payload_size([member_status(m) for m in members])
    print(f"\nA pool of {MAX_REPLICAS}, every string at its cap (tests/helpers/worst_pool.py)")
    print("| what | figure |\n| --- | --- |")
    print(f"| continue-as-new payload | {carried / 1024:.0f} KiB |")
    for limit, size in largest.items():
        print(f"| `status` answer, its largest page of {limit} members | {size / 1024:.0f} KiB |")
    print(f"| `status` members, unpaged and uncut (before 0.3.4) | {unpaged / 2**20:.1f} MiB |")
    print(
        f"\nRotations in an hour, {MAX_REPLICAS} members, 1 h lifetimes, "
        f"{ROTATION_BOOT.seconds} s to serve a new instance (on plans alone, "
        "tests/helpers/pool_simulation.py)"
    )
    print("| max_surge | rotations in the third hour |\n| --- | --- |")
    for surge in SURGES:
        inp = PoolInput.model_validate(
            {
                "replicas": MAX_REPLICAS,
                "template": {"provider": "local", "max_lifetime_seconds": 3600},
                "max_surge": surge,
            }
        )
        until = T0 + timedelta(hours=3)
        spans = simulate(inp, until=until, rotation_takes=ROTATION_BOOT)
        print(f"| {surge!r} | {rotations_in(spans, T0 + timedelta(hours=2))} |")


def _subdirectory(workdir: Path, name: str) -> Path:
    (workdir / name).mkdir()
    return workdir / name


async def _real_pool(client: Client, ground: SquidGround, members: int) -> None:
    providers = {SQUID_PROVIDER: ground.squids}
    async with _worker(client, providers, ground.config, ground.origin) as task_queue:
        template = {"provider": SQUID_PROVIDER, "health": {"target": ground.origin.url}}
        handle, ready_s = await _start_until_ready(client, task_queue, members, template)
        started = time.monotonic()
        await handle.execute_update("rotate", {"all": True})
        least_ready = members

        async def rotated() -> bool:
            nonlocal least_ready
            status = await handle.query("status")
            least_ready = min(least_ready, status["ready"])
            return status["ready"] == members and all(
                m["generation"] >= 1 for m in status["members"]
            )

        await _until(rotated)
        rotate_s = time.monotonic() - started
        await handle.signal("terminate")
        await handle.result()
    print(f"\nPool of {members} real local Squids (max_surge 1)")
    print("| what | figure |\n| --- | --- |")
    print(f"| start to all {members} Ready | {ready_s:.1f} s |")
    print(f"| rotate all, to every member on a new instance | {rotate_s:.1f} s |")
    print(f"| fewest Ready members seen while rotating | {least_ready} of {members} |")


class _worker:
    """An in-process worker on a task queue of its own."""

    def __init__(
        self, client: Client, providers: dict[str, Any], config: Config, origin: TlsOrigin
    ) -> None:
        self._acts = ProviderActivities(providers, config, ssl_context=origin.client_ssl_context)
        self._task_queue = f"bench-pool-{uuid.uuid4().hex[:8]}"
        self._worker = build_worker(client, self._acts, task_queue=self._task_queue)
        self._run: asyncio.Task[None] | None = None

    async def __aenter__(self) -> str:
        self._run = asyncio.create_task(self._worker.run())
        return self._task_queue

    async def __aexit__(self, *_: object) -> None:
        await self._worker.shutdown()
        self._acts.close()


async def _start_until_ready(
    client: Client, task_queue: str, members: int, template: dict[str, Any]
) -> tuple[WorkflowHandle[Any, Any], float]:
    started = time.monotonic()
    handle = await client.start_workflow(
        "ProxyPool",
        {"replicas": members, "template": template, "max_surge": ROTATION_SURGE},
        id=f"bench-pool-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
    )

    async def ready() -> bool:
        return bool((await handle.query("status"))["ready"] == members)

    await _until(ready)
    return handle, time.monotonic() - started


async def _rotate_all(handle: WorkflowHandle[Any, Any], members: int) -> float:
    """`rotate {"all": true}`, and how long until every member serves from a new instance."""
    before = await generations(handle)
    started = time.monotonic()
    await handle.execute_update("rotate", {"all": True})

    async def rotated() -> bool:
        status = await handle.query("status")
        if status["ready"] != members or status["waiting_for"] is not None:
            return False
        now = await generations(handle)
        return all(now.get(member, -1) > generation for member, generation in before.items())

    await _until(rotated)
    return time.monotonic() - started


async def _first_task_after(
    client: Client, handle: WorkflowHandle[Any, Any], restart: WorkflowExecutionDescription
) -> tuple[float, int]:
    """Wake the pool, and how long its first task after `restart` took, with how many
    events its run had then: a new worker replays them all in that task.

    Woken by a signal, as an update's first task is speculative: the server
    writes its events only once it completed, stamped alike.
    """
    before = restart.raw_description.workflow_execution_info.history_length
    await handle.signal(MEMBER_CHANGED_SIGNAL, _stranger_report())
    run = client.get_workflow_handle(handle.id, run_id=restart.run_id)

    async def task_completed() -> bool:
        return bool(await _task_durations(run, after=before))

    await _until(task_completed)
    return (await _task_durations(run, after=before))[0], before


async def _task_durations(run: WorkflowHandle[Any, Any], after: int) -> list[float]:
    """The run's completed workflow tasks after event `after`, in seconds, in order."""
    took: list[float] = []
    started: datetime | None = None
    async for event in run.fetch_history_events():
        if event.event_id <= after:
            continue
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            started = event.event_time.ToDatetime()
        elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and started:
            took.append((event.event_time.ToDatetime() - started).total_seconds())
    return took


def _stranger_report() -> dict[str, Any]:
    """A well-formed report of a member no pool has: ignored, but a workflow task."""
    return {
        "member": "nobody/0",
        "state": ProxyState.READY,
        "endpoint": "127.0.0.1:9",
        "provider": FLEET_PROVIDER,
        "generation": 0,
        "ready_since": None,
        "at": datetime.now(UTC).isoformat(),
        "seq": 0,
    }


async def generations(handle: WorkflowHandle[Any, Any]) -> dict[str, int]:
    """Every member's generation, read a `status` page at a time."""
    found: dict[str, int] = {}
    page: dict[str, int] | None = {"limit": MAX_PAGE}
    while page is not None:
        status = await handle.query("status", page)
        found.update((m["member"], m["generation"]) for m in status["members"])
        page = status["next_page"]
    return found


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll `check` until true; a query the busy worker did not answer in time is asked again."""
    while True:
        try:
            if await check():
                return
        except RPCError as err:
            print(f"(query not answered, asked again: {err})")
        await asyncio.sleep(POLL)


@dataclass
class _TaskFigures:
    runs: int = 0
    # Every event of every run, and the members' `member_changed` reports among them.
    events: int = 0
    reports: int = 0
    tasks: int = 0
    longest_s: float = 0.0
    over_1s: int = 0
    timed_out: int = 0
    failed: int = 0
    # Why the failed ones failed, by the server's cause (WorkflowTaskFailedCause).
    failed_causes: Counter[str] = field(default_factory=Counter)
    largest_event: int = 0
    largest_history: int = 0
    # The run with the largest history, to replay.
    largest_run: str = ""
    # The most events in one run (what the pool's event budget bounds).
    longest_run: int = 0
    # The slowest tasks: (seconds, run, WorkflowTaskStarted event id, what came before it).
    slowest: list[tuple[float, int, int, str]] = field(default_factory=list)


async def _task_figures(client: Client, handle: WorkflowHandle[Any, Any]) -> _TaskFigures:
    """The pool's workflow tasks in every run so far, from its histories.

    A task lasts from its WorkflowTaskStarted to its Completed (server time,
    which includes the worker's wait for activations, as the server's task
    timeout does).
    """
    figures = _TaskFigures()
    run_id: str | None = handle.first_execution_run_id or handle.result_run_id
    while run_id:
        figures.runs += 1
        run = client.get_workflow_handle(handle.id, run_id=run_id)
        this_run = run_id
        started: dict[int, datetime] = {}
        run_id = None
        # A task after a failed or timed-out one replays the run's whole history.
        before = "first task of the run"
        events_before = figures.events
        async for event in run.fetch_history_events():
            figures.events += 1
            figures.largest_event = max(figures.largest_event, event.ByteSize())
            when = event.event_time.ToDatetime()
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                started[event.event_id] = when
                size = event.workflow_task_started_event_attributes.history_size_bytes
                if size > figures.largest_history:
                    figures.largest_history, figures.largest_run = size, this_run
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                attributes = event.workflow_task_completed_event_attributes
                took = (when - started[attributes.started_event_id]).total_seconds()
                figures.tasks += 1
                figures.longest_s = max(figures.longest_s, took)
                figures.over_1s += took > 1
                figures.slowest.append((took, figures.runs, attributes.started_event_id, before))
                figures.slowest = sorted(figures.slowest, reverse=True)[:SLOWEST]
                before = "a completed task"
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                signaled = event.workflow_execution_signaled_event_attributes
                figures.reports += signaled.signal_name == MEMBER_CHANGED_SIGNAL
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
                figures.timed_out += 1
                before = "a timed-out task (replays)"
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                figures.failed += 1
                cause = event.workflow_task_failed_event_attributes.cause
                figures.failed_causes[WorkflowTaskFailedCause.Name(cause)] += 1
                before = f"a failed task, {WorkflowTaskFailedCause.Name(cause)} (replays)"
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                attributes_can = event.workflow_execution_continued_as_new_event_attributes
                run_id = attributes_can.new_execution_run_id
        figures.longest_run = max(figures.longest_run, figures.events - events_before)
    return figures


async def _replay(
    client: Client, workflow_id: str, run_id: str, save: Path | None
) -> tuple[float, int]:
    """How long a worker takes to replay this run from its first event (after an eviction,
    a restart or a failed task): the CPU of every workflow task in it, again."""
    history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    if save is not None:
        await asyncio.to_thread(save.write_text, history.to_json())
    replayer = Replayer(workflows=[ProxyPool], namespace=client.namespace, debug_mode=True)
    started = time.monotonic()
    await replayer.replay_workflow(history)
    return time.monotonic() - started, len(history.events)


def _late_rounds(dump: dict[str, Any]) -> Counter[float | None]:
    """The pool monitors' rounds so far: how many started at most `le` seconds late (None: all).

    Read from the worker process's own histogram (activities/metrics.py).
    """
    counts: Counter[float | None] = Counter()
    for le, rounds in dump["pool_monitor_late"]:
        counts[None if le == float("inf") else le] = int(rounds)
    return counts


def _sdk_warnings(log: str) -> Counter[str]:
    """The SDK's coded warnings in the worker's log (TMPRL1104: a task over 5 s; payload
    sizes), by code and workflow type."""
    counts: Counter[str] = Counter()
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():
        if code := re.search(r"\[(TMPRL\d+)\]", line):
            workflow_type = re.search(r"workflow_type=(\w+)", line)
            counts[f"{code[1]} ({workflow_type[1] if workflow_type else 'no workflow type'})"] += 1
    return counts


async def _events(handle: WorkflowHandle[Any, Any]) -> int:
    return len((await handle.fetch_history()).events)


if __name__ == "__main__":
    asyncio.run(main())
