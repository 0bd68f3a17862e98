"""The locks the application installs from (requirements/, `make lock`).

`make test`, `make run`, CI and the image install exactly the pinned versions,
with hashes, and the project itself with `--no-deps`: nothing would notice a
pyproject.toml whose ranges moved while its lock stayed behind. These tests do.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.test_clean import make_dry_run

ROOT = Path(__file__).resolve().parents[2]
APP_LOCK = ROOT / "requirements" / "app.txt"
DEV_LOCK = ROOT / "requirements" / "dev.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)", re.MULTILINE)


def pins(lock: Path) -> dict[str, Version]:
    return {canonicalize_name(name): Version(v) for name, v in PIN.findall(lock.read_text())}


def requirements(*groups: str) -> list[Requirement]:
    """pyproject.toml's requirements: `dependencies`, an extra, or `build-system`."""
    found: list[Requirement] = []
    for group in groups:
        if group == "dependencies":
            listed = PYPROJECT["project"]["dependencies"]
        elif group == "build-system":
            listed = PYPROJECT["build-system"]["requires"]
        else:
            listed = PYPROJECT["project"]["optional-dependencies"][group]
        found += [Requirement(line) for line in listed]
    return found


@pytest.mark.parametrize(
    ("lock", "groups"),
    [
        (APP_LOCK, ("dependencies", "build-system")),
        (DEV_LOCK, ("dependencies", "test", "build-system")),
    ],
    ids=["app", "dev"],
)
def test_the_lock_pins_every_requirement_within_its_range(
    lock: Path, groups: tuple[str, ...]
) -> None:
    pinned = pins(lock)
    stale = []
    for requirement in requirements(*groups):
        locked = pinned.get(canonicalize_name(requirement.name))
        if locked is None or not requirement.specifier.contains(locked, prereleases=True):
            stale.append(f"{requirement} (locked: {locked or 'none'})")

    assert not stale, f"{lock.name} is behind pyproject.toml, run `make lock`: {stale}"


def test_the_tests_run_on_the_versions_the_image_ships() -> None:
    app, dev = pins(APP_LOCK), pins(DEV_LOCK)

    assert {name: dev.get(name) for name in app} == app


def test_make_installs_the_lock_with_hashes_and_the_project_without_resolving() -> None:
    installs = [line for line in make_dry_run("-B", ".venv/.installed") if "pip install" in line]

    assert installs == [
        ".venv/bin/python -m pip install -q --require-hashes -r requirements/dev.txt",
        ".venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .",
    ]


def test_the_image_installs_the_application_lock_with_hashes() -> None:
    steps = (ROOT / "Dockerfile").read_text().split("\nRUN ")
    installs = [
        step.splitlines()[0].removesuffix(" \\") for step in steps if step.startswith("pip install")
    ]

    assert installs == [
        "pip install --require-hashes -r requirements/app.txt",
        "pip install --no-deps --no-build-isolation .",
    ]
