"""`make clean`: remove what `make run` and the build left, unless workflows still run there.

`.data/temporal.db` holds every workflow `make run` started. Deleting it
while one is open forgets that proxy, and its Squid (started by the worker)
is then nobody's; so this refuses, naming them, until they are terminated or
`make clean FORCE=1` says to go ahead. It refuses too while `make run` or one
of its Squids is running from `.data`. It reads the database itself, with
Python's sqlite3, so it needs no server and no virtualenv: `make clean`
removes the virtualenv too.

What it removes besides `.data`: the Squid directory that a root worker
moved under /run/proxy-operator because Squid's user could not reach
`.data/local-proxies` (docs/providers.md), and the build's leftovers
(`*.egg-info`, `__pycache__`, `build/`, the tools' caches).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sqlite3
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from squid.process import RUNTIME_ROOT, runtime_dir  # noqa: E402
from squid.procfs import command_lines, processes_under  # noqa: E402

# WorkflowExecutionStatus RUNNING, as Temporal's SQL persistence stores it.
RUNNING = 1
# Temporal's own workflows (its scanners) run in this namespace, and a
# schedule (orphan GC's) is a workflow of its own, open while the schedule
# exists, whose id starts with this: neither runs a proxy.
SYSTEM_NAMESPACE = "temporal-system"
SYSTEM_WORKFLOW_PREFIX = "temporal-sys-"
OPEN_WORKFLOWS = """
    SELECT n.name, c.workflow_id FROM current_executions c
    JOIN namespaces n ON n.id = c.namespace_id
    WHERE c.status = ? AND n.name != ? AND substr(c.workflow_id, 1, ?) != ?
    ORDER BY n.name, c.workflow_id
"""
BUILD_LEFTOVERS = (".mypy_cache", ".ruff_cache", ".pytest_cache", "build")
# Shown at most, of a long list of open workflows.
SHOWN = 10


def open_workflows(database: Path) -> list[str]:
    """`namespace/workflow id` of every open workflow in a dev server's database."""
    if not database.exists():
        return []
    connection = sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)
    try:
        prefix = SYSTEM_WORKFLOW_PREFIX
        query = (RUNNING, SYSTEM_NAMESPACE, len(prefix), prefix)
        rows = connection.execute(OPEN_WORKFLOWS, query).fetchall()
    finally:
        connection.close()
    return [f"{namespace}/{workflow_id}" for namespace, workflow_id in rows]


def users_of(data: Path) -> list[int]:
    """Processes running from `data`: its dev server (by its --db-filename) and Squids."""
    database = str(data / "temporal.db").encode()
    found = {pid for pid, args in command_lines() if database in args}
    for squids in (data / "local-proxies", runtime_dir(data / "local-proxies")):
        found.update(processes_under(squids))
    return sorted(found)


def refusal(data: Path) -> str | None:
    """Why `data` must stay, or None when nothing runs from it."""
    running = users_of(data)
    if running:
        pids = " ".join(str(pid) for pid in running)
        return f"processes still run from {data} (pids {pids}): stop `make run` (Ctrl-C) first"
    try:
        workflows = open_workflows(data / "temporal.db")
    except sqlite3.Error as err:
        return f"cannot read {data / 'temporal.db'} to look for open workflows: {err}"
    if workflows:
        shown = ", ".join(workflows[:SHOWN])
        more = f" and {len(workflows) - SHOWN} more" if len(workflows) > SHOWN else ""
        return (
            f"{len(workflows)} workflows are still open in {data / 'temporal.db'}: {shown}{more}. "
            "Terminate them under `make run` (docs/operations.md), so their proxies are deleted"
        )
    return None


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def leftovers(root: Path) -> list[Path]:
    """What the build and the tools left in the checkout, outside the virtualenv."""
    found = [root / name for name in BUILD_LEFTOVERS if (root / name).exists()]
    found += sorted(root.glob("*.egg-info"))
    for directory, subdirectories, _ in os.walk(root):
        if "__pycache__" in subdirectories:
            found.append(Path(directory) / "__pycache__")
        # Not into the virtualenv, .data or .git, nor what is being removed.
        subdirectories[:] = [
            name for name in subdirectories if not name.startswith(".") and name != "__pycache__"
        ]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    # So tests can run it on a checkout of their own.
    parser.add_argument("--checkout", type=Path, default=ROOT)
    parser.add_argument(
        "--force", action="store_true", help="remove the data even while workflows are open"
    )
    args = parser.parse_args(argv)
    checkout: Path = args.checkout.resolve()
    data = checkout / ".data"
    if not args.force:
        why = refusal(data)
        if why is not None:
            print(f"make clean: refused: {why}; or `make clean FORCE=1`.", file=sys.stderr)
            return 1
    moved = runtime_dir(data / "local-proxies")
    left = []
    for path in (data, moved, *leftovers(checkout)):
        try:
            remove(path)
        except OSError as err:
            left.append(f"{path}: {err.strerror}")
    with contextlib.suppress(OSError):  # absent, not empty, or root's
        RUNTIME_ROOT.rmdir()
    if left:
        # A root worker's Squid directory, say, which only root may remove.
        print("make clean: could not remove " + "; ".join(left), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
