"""The replay corpus: the histories a release recorded (tests/workflows/test_replay.py).

`tests/histories/<release>/<name>.json`, one directory per version of the
project (pyproject.toml's `version`): the floor's (the release this code
upgrades from, workflows/patches.py) and the current one's. A release's
recordings are the runs that may still be open in someone's fleet when the
next release reaches it, so they are kept as recorded, save the stack
traces of failures, which no replay reads; each pins a command sequence no
other recording has. `make histories` records the current release's
(docs/upgrades.md says when).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import warnings
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHandle

ROOT = Path(__file__).resolve().parent.parent.parent
HISTORIES = ROOT / "tests" / "histories"
RECORD_ENV = "PROXY_OPERATOR_RECORD_HISTORIES"


def current_release() -> str:
    """The project's version in pyproject.toml: the release a recording belongs to."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        version: str = tomllib.load(file)["project"]["version"]
    return version


def releases() -> list[str]:
    """Every release with recordings, in the order of their directory names."""
    return sorted(path.name for path in HISTORIES.iterdir() if path.is_dir())


def recorded_names(release: str) -> list[str]:
    """The names of a release's recorded histories."""
    return sorted(path.stem for path in (HISTORIES / release).glob("*.json"))


def load_history(release: str, name: str) -> dict[str, Any]:
    """One recording: `workflow_id`, `namespace` (absent from the oldest) and `history`."""
    recorded: dict[str, Any] = json.loads((HISTORIES / release / f"{name}.json").read_text())
    return recorded


def workflow_type(release: str, name: str) -> str:
    """The workflow type a recording ran, read from its first event without loading it whole.

    The corpus is tens of MiB; parametrizing tests by type must stay quick.
    """
    with (HISTORIES / release / f"{name}.json").open() as file:
        head = file.read(4096)
    found = re.search(r'"workflowType": \{"name": "([^"]+)"\}', head)
    if found is None:
        raise ValueError(f"{release}/{name}: no workflow type in its first event")
    return found[1]


async def record_history(handle: WorkflowHandle[Any, Any], name: str) -> None:
    """Add this run's history to the current release's recordings, when recording.

    Only with PROXY_OPERATOR_RECORD_HISTORIES=1 (`make histories` sets it).
    A recording the release already has is kept, not overwritten: it may be
    the only trace of what a run of that release did.
    """
    if os.environ.get(RECORD_ENV) != "1":
        return
    path = HISTORIES / current_release() / f"{name}.json"
    if path.exists():
        kept = path.relative_to(ROOT)
        warnings.warn(f"kept {kept}: a release's recordings are not rewritten", stacklevel=2)
        return
    history = await handle.fetch_history()
    namespace = (await handle.describe()).namespace
    path.parent.mkdir(parents=True, exist_ok=True)
    # The workflow id and the namespace are part of what the workflow
    # computed (instance names), and a history alone carries neither.
    recorded = {
        "workflow_id": handle.id,
        "namespace": namespace,
        "history": without_stack_traces(json.loads(history.to_json())),
    }
    path.write_text(json.dumps(recorded))


def without_stack_traces(value: Any) -> Any:
    """`value` with every failure's `stackTrace` dropped: a replay never reads one.

    A fake that raises the same exception object again grows its traceback
    with each raise, and a month of quota waits recorded megabytes of it.
    """
    if isinstance(value, dict):
        return {k: without_stack_traces(v) for k, v in value.items() if k != "stackTrace"}
    if isinstance(value, list):
        return [without_stack_traces(v) for v in value]
    return value
