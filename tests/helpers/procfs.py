"""Reading processes and the machine from /proc (proc(5)), for tests and benchmarks.

`/proc/<pid>/stat` starts with `pid (comm) state ppid ...`, and the command
name may itself contain ")" or spaces, so every field is read after the last
")". Field numbers below are proc(5)'s, counted from 1.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
# Index in `stat_fields` of proc(5) field N is N - 3 (fields 1 and 2 come before).
_STATE, _PPID, _UTIME, _STIME = 0, 1, 11, 12


def stat_fields(pid: int) -> list[str]:
    """Fields 3.. of /proc/<pid>/stat (after the command name); OSError once it is gone."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rpartition(")")[2].split()


def is_zombie(pid: int) -> bool:
    """The process exited and only waits for its parent to reap it."""
    return stat_fields(pid)[_STATE] == "Z"


def is_running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has, whatever `kill -0` says)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not is_zombie(pid)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, every thread; 0 once it is gone."""
    try:
        fields = stat_fields(pid)
    except (OSError, ValueError):
        return 0.0
    return (int(fields[_UTIME]) + int(fields[_STIME])) / CLK_TCK


def children_by_parent() -> dict[int, list[int]]:
    """Every process on the machine, as parent pid -> child pids."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                tree.setdefault(int(stat_fields(int(entry.name))[_PPID]), []).append(
                    int(entry.name)
                )
    return tree


def descendants(pid: int, tree: dict[int, list[int]]) -> list[int]:
    """`pid` and every process below it in `tree` (from `children_by_parent`)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(tree.get(current, []))
    return found


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
