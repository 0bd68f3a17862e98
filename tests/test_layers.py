"""The top-level packages import one another in layers, read from their source.

From the bottom: the client (proxy_operator), which a scraper installs on
its own and which holds the gateway username grammar; squid, which every
provider, the gateway and its router run; then providers, activities,
workflows, the gateway and the entry points. An import pointing back up a
layer would make a circle, load the operator into a scraper, or copy more
than the standard library into the router's directory (gateway/squid.py).
Imports are read with `ast`, so nothing here runs the code it checks.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENT = "proxy_operator"
# What the client may import beyond the standard library: its extras, each
# loaded only by the module that needs it (docs/scrapers.md).
CLIENT_EXTRAS = frozenset({"scrapy", "twisted", "requests", "httpx"})
# The packages below which squid sits: it runs under all of them.
ABOVE_SQUID = frozenset({"providers", "gateway", "workflows", "activities", "startup"})
ENTRY_POINTS = frozenset({"worker", "cli", "contract"})


def _ours() -> dict[str, list[Path]]:
    """Every top-level package and module the project ships, with its source files.

    The names come from pyproject.toml, the client's too, wherever it is
    installed from; `find_spec` finds a top-level name without importing it.
    """
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    names = {p.split(".")[0] for p in setuptools["packages"]} | set(setuptools["py-modules"])
    files = {}
    for name in sorted(names | {CLIENT}):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, f"{name} is not importable"
        locations = spec.submodule_search_locations
        files[name] = (
            sorted(Path(locations[0]).glob("**/*.py")) if locations else [Path(spec.origin)]
        )
    return files


def _imported(path: Path) -> set[str]:
    """The top-level names `path` imports, in any block (TYPE_CHECKING and functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _import_graph(packages: Mapping[str, Iterable[Path]]) -> dict[str, set[str]]:
    """For each package, the other packages of `packages` it imports."""
    return {
        name: set().union(*(_imported(f) for f in files)) & set(packages) - {name}
        for name, files in packages.items()
    }


def _circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Each circle of imports once, as the path that walks it back to its start."""
    found: list[list[str]] = []

    def walk(path: list[str]) -> None:
        for successor in sorted(graph[path[-1]]):
            if successor == path[0]:
                found.append([*path, successor])
            # Start each circle at its smallest name, so it is reported once.
            elif successor not in path and successor > path[0]:
                walk([*path, successor])

    for start in sorted(graph):
        walk([start])
    return found


def _offenders(files: Iterable[Path], allowed: set[str]) -> dict[str, list[str]]:
    return {str(path): sorted(outside) for path in files if (outside := _imported(path) - allowed)}


def test_no_top_level_packages_import_each_other_in_a_circle() -> None:
    assert _circles(_import_graph(_ours())) == []


def test_squid_imports_nothing_of_the_packages_that_run_it() -> None:
    ours = _ours()
    above = ABOVE_SQUID | ENTRY_POINTS
    assert above <= set(ours)
    assert _offenders(ours["squid"], set(sys.stdlib_module_names) | set(ours) - above) == {}


def test_the_client_imports_only_the_standard_library_and_its_extras() -> None:
    # A scraper installs the client alone: an import of anything of the
    # operator (or of a library it does not declare) fails on its machine.
    allowed = set(sys.stdlib_module_names) | CLIENT_EXTRAS | {CLIENT}
    assert _offenders(_ours()[CLIENT], allowed) == {}


def test_the_checker_sees_a_circle_through_three_packages(tmp_path: Path) -> None:
    sources = {
        "low": "import json\nfrom top.x import y\n",
        "mid": "import low\n",
        "top": "def f() -> None:\n    from mid import z\n",
    }
    packages = {}
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
        packages[name] = [tmp_path / f"{name}.py"]

    assert _circles(_import_graph(packages)) == [["low", "top", "mid", "low"]]
