"""Reading processes and the machine from /proc (proc(5)), for tests and benchmarks.

Reading one process is squid.procfs's (the local provider and the
gateway use it too); here is what only tests and benchmarks measure: CPU,
memory, process trees, what a process's environment holds, the ports it
listens on, the machine's load.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from squid import procfs

CLK_TCK = os.sysconf("SC_CLK_TCK")
# Indices in `procfs.stat_fields` (proc(5) field N is at N - 3): fields 14 and 15.
_UTIME, _STIME = 11, 12


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, every thread; 0 once it is gone."""
    fields = procfs.stat_fields(pid)
    if fields is None:
        return 0.0
    return (int(fields[_UTIME]) + int(fields[_STIME])) / CLK_TCK


def children_by_parent() -> dict[int, list[int]]:
    """Every process on the machine, as parent pid -> child pids."""
    tree: dict[int, list[int]] = {}
    for pid in procfs.pids():
        fields = procfs.stat_fields(pid)
        if fields is not None:
            tree.setdefault(int(fields[procfs.PARENT]), []).append(pid)
    return tree


def descendants(pid: int, tree: dict[int, list[int]]) -> list[int]:
    """`pid` and every process below it in `tree` (from `children_by_parent`)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(tree.get(current, []))
    return found


def processes_below(pid: int) -> dict[int, str]:
    """`pid` and every process below it that runs: pid -> its command line."""
    found = {
        p: b" ".join(procfs.command_line(p)).decode()
        for p in descendants(pid, children_by_parent())
    }
    return {p: args for p, args in found.items() if args}


def secrets_held(pids: Iterable[int], secrets: dict[str, str]) -> dict[int, list[str]]:
    """Which of `secrets` (name -> value) the environment of each of `pids` holds; pid -> names.

    A value counts under any name: what a process must not be able to read
    is the secret, whatever variable carries it.
    """
    held = {p: [n for n, v in secrets.items() if v.encode() in environment(p)] for p in pids}
    return {p: names for p, names in held.items() if names}


def environment(pid: int) -> bytes:
    """/proc/<pid>/environ: the environment the process started with; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def listening_ports(pid: int) -> set[int]:
    """The TCP ports `pid` listens on, found as any process of its user on the host can:
    its descriptors' socket inodes, looked up in /proc/net/tcp and tcp6 (state 0A, LISTEN)."""
    inodes = set()
    for descriptor in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(descriptor)
            if target.startswith("socket:["):
                inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:
                ports.add(int(local.rpartition(":")[2], 16))
    return ports


def comm(pid: int) -> str:
    """The process's command name; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def status_value(pid: int, key: str) -> int:
    """A number from /proc/<pid>/status (`VmRSS`, `VmHWM` in KiB, `Threads`); 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def system_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    return total - idle, total


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg prints them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def listen_overflows() -> int:
    """SYNs dropped because a listen queue was full (each costs its client a 1 s retry)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=True))
            return int(table.get("ListenOverflows", 0))
    return 0


def squid_pids(state_dir: Path) -> list[int]:
    """Squid main processes (not their auth helpers) serving from `state_dir`."""
    return [
        pid
        for pid in procfs.processes_under(state_dir)
        if comm(pid) == "squid"  # one that exits meanwhile is no Squid serving
    ]
