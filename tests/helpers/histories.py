"""Recording workflow histories for the replay test (tests/workflows/test_replay.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHandle

HISTORIES = Path(__file__).resolve().parent.parent / "histories"


async def record_history(handle: WorkflowHandle[Any, Any], name: str) -> None:
    """Save the history for the replay test when PROXY_OPERATOR_RECORD_HISTORIES=1.

    Run `PROXY_OPERATOR_RECORD_HISTORIES=1 make test` after a deliberate change
    to the workflow's commands, and commit the refreshed tests/histories/.
    """
    if os.environ.get("PROXY_OPERATOR_RECORD_HISTORIES") != "1":
        return
    history = await handle.fetch_history()
    namespace = (await handle.describe()).namespace
    HISTORIES.mkdir(exist_ok=True)
    # The workflow id and the namespace are part of what the workflow
    # computed (instance names), and a history alone carries neither.
    recorded = {
        "workflow_id": handle.id,
        "namespace": namespace,
        "history": json.loads(history.to_json()),
    }
    (HISTORIES / f"{name}.json").write_text(json.dumps(recorded))
