"""squid.process's process mechanics, on real processes standing in for Squid.

Launching, awaiting and stopping do not depend on what runs: a Python child
that ignores SIGTERM, leaves a helper behind, listens or fails stands in for
the Squid that would, in milliseconds. Squid itself goes through them in
tests/providers/test_local.py and tests/gateway/test_squid.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from squid import procfs
from squid.process import SquidExited, accepts, await_ready, clear_stale_pid_file, launch, stop
from tests.helpers.waiting import wait_until

# A stop's bound, short enough for a test.
GRACE = 0.5
# Long enough to outlast any test; the fixture kills what is left.
SLEEP = "import time; time.sleep(600)"
IGNORES_SIGTERM = "; ".join(
    [
        "import signal",
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
        "print('up', flush=True)",
        SLEEP,
    ]
)
# Forks a helper (which stays in its process group), prints the helper's pid, and waits.
LEAVES_A_HELPER = (
    "import subprocess, sys;"
    f"helper = subprocess.Popen([sys.executable, '-c', {SLEEP!r}]);"
    f"print(helper.pid, flush=True); {SLEEP}"
)
FAILS = "print('starting'); print('FATAL: Bungled squid.conf line 3'); print('exiting')"


class Started:
    """Processes a test starts, each in a session of its own; their groups are killed after it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.processes: list[subprocess.Popen[bytes]] = []

    def run(self, code: str) -> subprocess.Popen[bytes]:
        """`code` launched as Squid would be, its output in the directory's squid.out."""
        process = launch([sys.executable, "-c", code], self.directory, self.output)
        self.processes.append(process)
        return process

    @property
    def output(self) -> Path:
        return self.directory / "squid.out"

    def first_line(self) -> str:
        """The first line the output file holds, once it holds one."""
        wait_until(lambda: b"\n" in self.output.read_bytes(), 10, "the child's first line")
        return self.output.read_text().splitlines()[0]

    def cleanup(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Started]:
    processes = Started(tmp_path)
    try:
        yield processes
    finally:
        processes.cleanup()


def exited(process: subprocess.Popen[bytes]) -> bool:
    return process.poll() is not None


def test_launch_appends_the_output_to_its_file(started: Started) -> None:
    started.output.write_text("earlier run\n")
    process = started.run(FAILS)
    process.wait()

    assert started.output.read_text().splitlines() == [
        "earlier run",
        "starting",
        "FATAL: Bungled squid.conf line 3",
        "exiting",
    ]


def test_a_launched_process_leads_a_session_of_its_own(started: Started) -> None:
    """So a signal to our process group (a Ctrl-C, a killed worker's group) never reaches it."""
    process = started.run(IGNORES_SIGTERM)
    assert started.first_line() == "up"
    assert os.getsid(process.pid) == process.pid != os.getsid(0)
    assert procfs.process_group(process.pid) == process.pid


def test_stop_ends_a_process_that_obeys_sigterm_with_sigterm(started: Started) -> None:
    process = started.run(SLEEP)

    stop(process.pid, lambda: exited(process), GRACE)

    assert process.returncode == -signal.SIGTERM


def test_stop_escalates_to_sigkill_for_a_process_that_ignores_sigterm(started: Started) -> None:
    process = started.run(IGNORES_SIGTERM)
    assert started.first_line() == "up"  # the handler is in place

    stop(process.pid, lambda: exited(process), GRACE)

    assert process.returncode == -signal.SIGKILL


def test_stop_of_a_group_kills_what_outlived_its_leader(started: Started) -> None:
    process = started.run(LEAVES_A_HELPER)
    helper = int(started.first_line())
    assert procfs.process_group(helper) == process.pid

    stop(process.pid, lambda: exited(process), GRACE, group=True)

    assert process.returncode == -signal.SIGTERM  # the leader obeyed SIGTERM ...
    # ... and its helper, which SIGTERM never reached, is killed with the group.
    wait_until(lambda: not procfs.running(helper), 10, "the helper to die")


def test_stop_of_one_process_leaves_its_group(started: Started) -> None:
    process = started.run(LEAVES_A_HELPER)
    helper = int(started.first_line())

    stop(process.pid, lambda: exited(process), GRACE)

    assert procfs.running(helper)


def test_await_ready_raises_with_the_logs_excerpt_when_the_process_exits(
    started: Started,
) -> None:
    process = started.run(FAILS)

    with pytest.raises(SquidExited) as raised:
        await_ready(process, lambda: False, 30, [started.output, started.directory / "none.log"])

    assert raised.value.excerpt == "FATAL: Bungled squid.conf line 3"


def test_await_ready_returns_once_the_address_accepts(started: Started) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        process = started.run(SLEEP)
        assert not accepts("127.0.0.1", port)
        listener.listen()

        assert await_ready(process, lambda: accepts("0.0.0.0", port), 30, [started.output])


def test_await_ready_gives_up_after_its_deadline_while_the_process_runs(
    started: Started,
) -> None:
    process = started.run(SLEEP)

    assert not await_ready(process, lambda: False, GRACE, [started.output])
    assert not exited(process)


def test_a_pid_file_of_a_zombie_or_a_gone_process_is_removed(
    started: Started, tmp_path: Path
) -> None:
    pid_file = tmp_path / "squid.pid"
    process = started.run(IGNORES_SIGTERM)
    assert started.first_line() == "up"
    pid_file.write_text(f"{process.pid}\n")

    clear_stale_pid_file(pid_file)
    assert pid_file.exists()  # it runs: Squid is right to refuse a second start

    process.kill()
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # a zombie, unreaped
    clear_stale_pid_file(pid_file)
    assert not pid_file.exists()

    process.wait()
    pid_file.write_text(f"{process.pid}\n")
    clear_stale_pid_file(pid_file)
    assert not pid_file.exists()
