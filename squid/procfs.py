"""Reading processes from /proc (proc(5)): whether one still runs, which it is, what it runs.

The local provider knows its Squids again by pid and start time and finds
their helpers by the files they name; the gateway finds its Squid's workers
by parent and argument; stopping either waits until a process is gone.

A process that exited stays in /proc as a zombie until its parent reaps it
(in a container with no init reaping orphans it may stay one): it runs
nothing and holds no socket, so every reader here counts it as gone.

`/proc/<pid>/stat` reads `pid (comm) state ppid pgrp ...`, and the command
name may itself contain ")" or spaces, so the fields are taken after the
last ")". Every reader answers for a process that is gone (None, empty)
rather than raising: a process may exit between any two reads.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")
# Indices in `stat_fields`: proc(5) numbers the fields from 1, and fields 1
# (pid) and 2 (comm) come before, so field N is at N - 3.
STATE, PARENT, GROUP, START_TICKS = 0, 1, 2, 19
# States of a process that has exited: a zombie, and one being torn down.
EXITED = frozenset({"Z", "X"})


def stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (those after the command name); None once it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rpartition(")")[2].split()


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has, whatever `kill -0` says)."""
    fields = stat_fields(pid)
    return fields is not None and fields[STATE] not in EXITED


def start_time(pid: int) -> str | None:
    """`<boot id>/<start time in ticks>` of a running process; None once it exited.

    A pid is reused sooner or later; a pid with this value never is, even
    across reboots, so it tells a process from a later one with its pid.
    """
    fields = stat_fields(pid)
    if fields is None or fields[STATE] in EXITED:
        return None
    return f"{_boot_id()}/{fields[START_TICKS]}"


def parent(pid: int) -> int | None:
    """The parent's pid of a running process; None once it exited."""
    return _live_field(pid, PARENT)


def process_group(pid: int) -> int | None:
    """The process group of a running process; None once it exited."""
    return _live_field(pid, GROUP)


def command_line(pid: int) -> list[bytes]:
    """The process's arguments; empty once it is gone or a zombie (the kernel keeps none)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


def pids() -> Iterator[int]:
    """Every process on the machine (some may be gone by the time they are read)."""
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def command_lines() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, arguments) of every process that has arguments (zombies have none)."""
    for pid in pids():
        args = command_line(pid)
        if args:
            yield pid, args


def children(of: int) -> list[int]:
    """The running processes whose parent is `of`."""
    return [pid for pid in pids() if parent(pid) == of]


def group_members(group: int) -> list[int]:
    """The running processes of process group `group`."""
    return [pid for pid in pids() if process_group(pid) == group]


def processes_under(directory: Path) -> list[int]:
    """Processes with an argument inside `directory` (a Squid and its helpers name its files)."""
    prefix = os.fsencode(directory) + b"/"
    return [pid for pid, args in command_lines() if any(a.startswith(prefix) for a in args)]


def _live_field(pid: int, index: int) -> int | None:
    fields = stat_fields(pid)
    if fields is None or fields[STATE] in EXITED:
        return None
    return int(fields[index])


@functools.cache
def _boot_id() -> str:
    return (PROC / "sys/kernel/random/boot_id").read_text().strip()
