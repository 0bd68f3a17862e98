"""squid.procfs on real processes: running, exited but unreaped (a zombie), and gone.

A zombie is the case that matters: Squid killed while its parent is gone
stays one where nobody reaps (a container), and must read as not running,
or a stop would wait for it and a start would refuse to run beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from squid import procfs

# Sleeps until its stdin closes; says so on stdout once it runs.
WAITER = "import sys; print('up', flush=True); sys.stdin.read()"


@pytest.fixture
def child(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A running child in a session of its own, with an argument naming a file in tmp_path."""
    process = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(tmp_path / "marker")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == b"up\n"
        yield process
    finally:
        process.kill()
        process.wait()


def zombie(process: subprocess.Popen[bytes]) -> None:
    """End `process` and wait until it has exited, leaving it unreaped."""
    assert process.stdin is not None
    process.stdin.close()
    # WNOWAIT: block until it exits, but leave it a zombie in /proc.
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)


def test_a_running_child_reads_as_what_it_is(
    child: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    pid = child.pid
    assert procfs.running(pid)
    assert procfs.parent(pid) == os.getpid()
    assert procfs.process_group(pid) == pid  # its own session, so its own group
    assert procfs.command_line(pid) == [
        os.fsencode(a) for a in (sys.executable, "-c", WAITER, str(tmp_path / "marker"))
    ]
    assert pid in procfs.children(os.getpid())
    assert procfs.group_members(pid) == [pid]
    assert procfs.processes_under(tmp_path) == [pid]
    started = procfs.start_time(pid)
    assert started is not None and started == procfs.start_time(pid)


def test_a_zombie_reads_as_not_running(child: subprocess.Popen[bytes], tmp_path: Path) -> None:
    pid = child.pid
    started = procfs.start_time(pid)
    zombie(child)

    assert Path(f"/proc/{pid}").exists()  # the pid is still taken
    fields = procfs.stat_fields(pid)
    assert fields is not None and fields[procfs.STATE] == "Z"
    assert not procfs.running(pid)
    assert procfs.start_time(pid) is None and started is not None
    assert procfs.parent(pid) is None
    assert procfs.process_group(pid) is None
    assert procfs.command_line(pid) == []
    assert pid not in procfs.children(os.getpid())
    assert procfs.group_members(pid) == []
    assert procfs.processes_under(tmp_path) == []


def test_a_reaped_process_reads_as_gone(child: subprocess.Popen[bytes]) -> None:
    pid = child.pid
    zombie(child)
    child.wait()

    assert procfs.stat_fields(pid) is None
    assert not procfs.running(pid)
    assert procfs.start_time(pid) is None
    assert procfs.command_line(pid) == []


def test_a_command_name_that_looks_like_fields_is_not_read_as_them() -> None:
    """The name comes before the fields and may hold ")" and spaces: ") Z 1 (" is not a zombie."""
    rename = "open('/proc/self/comm', 'w').write(') Z 1 (');"
    process = subprocess.Popen(
        [sys.executable, "-c", rename + WAITER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == b"up\n"
        assert Path(f"/proc/{process.pid}/comm").read_text() == ") Z 1 (\n"
        assert procfs.running(process.pid)
        assert procfs.parent(process.pid) == os.getpid()
    finally:
        process.kill()
        process.wait()
