"""`make clean` (deploy/local/clean.py) on a checkout of its own, with a real dev server's database.

It must not forget a proxy whose workflow is still open in `.data`, nor pull
the database from under a running `make run`; and once it goes ahead it
leaves none of the build's leftovers.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.network import accepts_connections, free_port
from tests.helpers.temporal import TEMPORAL_CLI
from tests.helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CLEAN = ROOT / "deploy" / "local" / "clean.py"
STARTUP_DEADLINE = 60.0


def clean(checkout: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """The script as `make clean` runs it: the system's Python, no virtualenv needed."""
    return subprocess.run(
        [sys.executable, str(CLEAN), "--checkout", str(checkout), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


@contextmanager
def dev_server(database: Path) -> Iterator[str]:
    """`temporal server start-dev` on `database`, as `make run` starts it; its address."""
    port = free_port()
    server = subprocess.Popen(
        [
            TEMPORAL_CLI,
            *("server", "start-dev", "--headless", "--log-level", "error"),
            *("--db-filename", str(database), "--ip", "127.0.0.1", "--port", str(port)),
            *("--http-port", str(free_port()), "--metrics-port", str(free_port())),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: accepts_connections(port), STARTUP_DEADLINE, "the dev server")
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(30)


def temporal(address: str, *args: str) -> None:
    subprocess.run(
        [TEMPORAL_CLI, *args, "--address", address], check=True, capture_output=True, timeout=60
    )


def build_leftovers(checkout: Path) -> list[Path]:
    """What a build and a test run leave: an egg-info, bytecode caches, a tool's cache."""
    made = [
        checkout / "proxy_operator.egg-info",
        checkout / "workflows" / "__pycache__",
        checkout / "tests" / "deploy" / "__pycache__",
        checkout / ".mypy_cache",
    ]
    for path in made:
        path.mkdir(parents=True)
        (path / "x").write_text("x")
    return made


@pytest.mark.slow
def test_clean_refuses_while_workflows_are_open_in_data_and_removes_everything_once_told(
    tmp_path: Path,
) -> None:
    checkout = tmp_path / "checkout"
    data = checkout / ".data"
    data.mkdir(parents=True)
    leftovers = build_leftovers(checkout)
    venv_cache = checkout / ".venv" / "lib" / "__pycache__"
    venv_cache.mkdir(parents=True)

    with dev_server(data / "temporal.db") as address:
        for workflow_id in ("proxy-open", "proxy-closed"):
            start = ("workflow", "start", "--type", "ProxyLifecycle", "--task-queue", "none")
            temporal(address, *start, "--workflow-id", workflow_id)
        temporal(address, "workflow", "terminate", "--workflow-id", "proxy-closed")

        running = clean(checkout)
        assert running.returncode == 1
        assert "stop `make run` (Ctrl-C) first" in running.stderr

    refused = clean(checkout)
    assert refused.returncode == 1, refused.stderr
    assert "1 workflows are still open" in refused.stderr
    assert "default/proxy-open" in refused.stderr
    assert "proxy-closed" not in refused.stderr
    assert "make clean FORCE=1" in refused.stderr
    assert (data / "temporal.db").exists()
    assert all(path.exists() for path in leftovers)

    forced = clean(checkout, "--force")
    assert forced.returncode == 0, forced.stderr
    assert not data.exists()
    assert [path for path in leftovers if path.exists()] == []
    assert venv_cache.exists(), "the virtualenv is the Makefile's to remove"


@pytest.mark.slow
def test_clean_goes_ahead_once_every_workflow_has_ended_but_schedules(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    data = checkout / ".data"
    data.mkdir(parents=True)
    with dev_server(data / "temporal.db") as address:
        temporal(
            address,
            *("workflow", "start", "--type", "ProxyLifecycle", "--task-queue", "none"),
            *("--workflow-id", "proxy-ended"),
        )
        temporal(address, "workflow", "terminate", "--workflow-id", "proxy-ended")
        # A schedule, as the worker makes for orphan GC, is an open workflow of
        # the server's own: no proxy of it is left running.
        temporal(
            address,
            *("schedule", "create", "--schedule-id", "proxy-operator-orphan-gc"),
            *("--interval", "1h", "--workflow-id", "gc", "--type", "OrphanGC"),
            *("--task-queue", "none"),
        )

    done = clean(checkout)
    assert done.returncode == 0, done.stderr
    assert not data.exists()


def make_dry_run(*args: str) -> list[str]:
    """What `make -n` would run, as a user's shell runs it (`make test` runs this test
    inside make, whose MAKEFLAGS would have it print the directories it enters)."""
    command = ["make", "--no-print-directory", "-n", *args]
    dry = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return dry.stdout.splitlines()


def test_make_clean_passes_force_on_and_removes_the_virtualenv_after() -> None:
    assert make_dry_run("clean", "FORCE=1") == [
        "python3 deploy/local/clean.py --force",
        "rm -rf .venv",
    ]
    assert make_dry_run("clean")[0] == "python3 deploy/local/clean.py "


def test_the_files_the_docs_create_in_the_checkout_are_ignored_by_git() -> None:
    created = ["api-tokens", "users", "api.crt", "api.key", "overlays/team-a/kustomization.yaml"]
    created += ["spider.py", "pages.jsonl"]
    checked = subprocess.run(
        ["git", "check-ignore", "--no-index", *created],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert checked.stdout.split() == created
