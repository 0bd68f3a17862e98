"""CPU and memory of every party in the fleet benchmark, read from /proc."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tests.helpers.procfs import (
    children_by_parent,
    comm,
    cpu_seconds,
    descendants,
    listen_overflows,
    load_average,
    status_value,
    system_busy,
)


@dataclass
class CpuSnapshot:
    at: float
    worker: float
    dev_server: float
    squids: float
    bench: float
    system: tuple[float, float]
    load: str
    overflows: int


def cpu_snapshot(worker_pid: int) -> CpuSnapshot:
    """CPU seconds so far of each party; the squids and the dev server are our children."""
    tree = children_by_parent()
    ours = tree.get(os.getpid(), [])
    dev = [p for p in ours if comm(p) == "temporal"]
    squids = [p for p in ours if comm(p) == "squid"]
    return CpuSnapshot(
        at=time.monotonic(),
        worker=cpu_seconds(worker_pid),
        dev_server=sum(cpu_seconds(p) for root in dev for p in descendants(root, tree)),
        squids=sum(cpu_seconds(p) for root in squids for p in descendants(root, tree)),
        bench=time.process_time(),
        system=system_busy(),
        load=load_average(),
        overflows=listen_overflows(),
    )


@dataclass
class Memory:
    """The worker's resident memory: sampled all along the window, and its peak."""

    rss_kib: list[int]
    hwm_kib: int
    threads: int


def rss_kib(pid: int) -> int:
    return status_value(pid, "VmRSS")


def memory_at_end(pid: int, rss: list[int]) -> Memory:
    """`rss` (sampled in the window) with a last sample, the peak RSS and the thread count."""
    return Memory([*rss, rss_kib(pid)], status_value(pid, "VmHWM"), status_value(pid, "Threads"))
