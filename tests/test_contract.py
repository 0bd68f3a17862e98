"""The shared names stay one set, and the arrow between layers points one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from contract import POOL_QUEUE_SUFFIX, PROVIDER_ERRORS, members_task_queue
from providers.errors import TAXONOMY

ROOT = Path(__file__).resolve().parents[1]


def test_the_provider_error_types_are_the_taxonomy_class_names() -> None:
    # Retry policies select on these strings; a renamed class would silently
    # make its errors retry (or not) the wrong way.
    assert {str(t) for t in PROVIDER_ERRORS} == {cls.__name__ for cls in TAXONOMY}


def _imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def _top_level_imports(package: str) -> dict[str, set[str]]:
    return {
        str(path.relative_to(ROOT)): {m.split(".")[0] for m in _imported_modules(path)}
        for path in sorted((ROOT / package).glob("**/*.py"))
    }


def test_activities_and_start_up_never_import_workflows() -> None:
    # Loading an activity must not load a workflow: both import contract instead.
    offenders = {
        path: "workflows"
        for package in ("activities", "startup")
        for path, imported in _top_level_imports(package).items()
        if "workflows" in imported
    }
    assert offenders == {}


def test_the_checker_sees_an_import_of_workflows(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import json\nfrom workflows.lifecycle import X\n")
    assert "workflows.lifecycle" in _imported_modules(module)


@pytest.mark.parametrize(
    ("pool_queue", "members_queue"),
    [
        ("proxy-operator-pools", "proxy-operator"),
        ("team-a-pools", "team-a"),
        # Any other queue keeps everything on its own, as pools always have.
        ("proxy-operator", "proxy-operator"),
        ("pools", "pools"),
        ("proxy-operator-pools-x", "proxy-operator-pools-x"),
        # Nothing left without the suffix: not an empty queue name.
        (POOL_QUEUE_SUFFIX, POOL_QUEUE_SUFFIX),
    ],
)
def test_members_run_on_the_queue_without_the_pools_suffix(
    pool_queue: str, members_queue: str
) -> None:
    assert members_task_queue(pool_queue) == members_queue
