"""The locks the application installs from (requirements/, `make lock`).

`make test`, `make run`, CI and the image install exactly the pinned versions,
with hashes, and the project itself with `--no-deps`: nothing would notice a
pyproject.toml whose ranges moved while its lock stayed behind. These tests do.
The client distribution (clients/python) keeps ranges, as a library should;
its lock (requirements/client.txt) is only the wheels its install test uses.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.test_clean import make_dry_run

ROOT = Path(__file__).resolve().parents[2]
APP_LOCK = ROOT / "requirements" / "app.txt"
DEV_LOCK = ROOT / "requirements" / "dev.txt"
CLIENT_LOCK = ROOT / "requirements" / "client.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CLIENT_PYPROJECT = tomllib.loads((ROOT / "clients" / "python" / "pyproject.toml").read_text())
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)", re.MULTILINE)


def pins(lock: Path) -> dict[str, Version]:
    return {canonicalize_name(name): Version(v) for name, v in PIN.findall(lock.read_text())}


def requirements(pyproject: dict[str, Any], *groups: str) -> list[Requirement]:
    """A pyproject.toml's requirements: `dependencies`, an extra, or `build-system`."""
    found: list[Requirement] = []
    for group in groups:
        if group == "dependencies":
            listed = pyproject["project"]["dependencies"]
        elif group == "build-system":
            listed = pyproject["build-system"]["requires"]
        else:
            listed = pyproject["project"]["optional-dependencies"][group]
        found += [Requirement(line) for line in listed]
    return found


@pytest.mark.parametrize(
    ("lock", "pyproject", "groups"),
    [
        (APP_LOCK, PYPROJECT, ("dependencies", "build-system")),
        (DEV_LOCK, PYPROJECT, ("dependencies", "test", "build-system")),
        (CLIENT_LOCK, CLIENT_PYPROJECT, ("dependencies", "scrapy", "build-system")),
    ],
    ids=["app", "dev", "client"],
)
def test_the_lock_pins_every_requirement_within_its_range(
    lock: Path, pyproject: dict[str, Any], groups: tuple[str, ...]
) -> None:
    pinned = pins(lock)
    stale = []
    for requirement in requirements(pyproject, *groups):
        locked = pinned.get(canonicalize_name(requirement.name))
        if locked is None or not requirement.specifier.contains(locked, prereleases=True):
            stale.append(f"{requirement} (locked: {locked or 'none'})")

    assert not stale, f"{lock.name} is behind pyproject.toml, run `make lock`: {stale}"


def test_the_tests_run_on_the_versions_the_image_ships() -> None:
    app, dev = pins(APP_LOCK), pins(DEV_LOCK)

    assert {name: dev.get(name) for name in app} == app


def test_the_client_is_installed_on_the_versions_the_suite_uses() -> None:
    client, dev = pins(CLIENT_LOCK), pins(DEV_LOCK)

    assert {name: dev.get(name) for name in client} == client


def test_the_client_has_the_operators_version() -> None:
    # A crawl team installs the client of the release its gateway runs.
    assert CLIENT_PYPROJECT["project"]["version"] == PYPROJECT["project"]["version"]


def test_make_installs_the_lock_with_hashes_and_the_project_without_resolving() -> None:
    installs = [
        line
        for line in make_dry_run("-B", ".venv/.installed")
        if " -m pip " in line or "/uv pip " in line
    ]

    assert installs == [
        # uv, from its own lock, installs the rest.
        ".venv/bin/python -m pip install -q --require-hashes -r requirements/installer.txt",
        ".venv/bin/uv pip install --python .venv/bin/python -q --require-hashes"
        " --compile-bytecode -r requirements/dev.txt",
        ".venv/bin/uv pip install --python .venv/bin/python -q --no-deps --no-build-isolation"
        " -e ./clients/python -e .",
        # The client's install test installs from these wheels, offline.
        ".venv/bin/python -m pip download -q --require-hashes --only-binary :all:"
        " -r requirements/client.txt -d .venv/wheelhouse",
    ]


def test_the_image_installs_the_application_lock_with_hashes() -> None:
    steps = (ROOT / "Dockerfile").read_text().split("\nRUN ")
    installs = [
        step.splitlines()[0].removesuffix(" \\") for step in steps if step.startswith("pip install")
    ]

    assert installs == [
        "pip install --require-hashes -r requirements/app.txt",
        # Editable: the image runs its checkout in /app, not a wheel in site-packages.
        "pip install --no-deps --no-build-isolation -e ./clients/python -e .",
    ]
