"""A failing test is reported as a failure, never as a pytest INTERNALERROR.

On CPython 3.11 before 3.11.8, two threads inside ast.parse at once can make
one of them raise `SystemError: AST constructor recursion depth mismatch`
(python/cpython#106905). pytest's default traceback rendering parses the
failing test's module, while this suite's workers format tracebacks on
Temporal's workflow threads; when the two met, pytest crashed with exit 3 and
the rest of the suite never ran. pyproject.toml therefore renders tracebacks
natively. This test recreates the race (threads parsing while a hundred
failures are rendered) under the project's pytest configuration: with
`--tb=short` instead, that run ended in INTERNALERROR every time it was tried
(and 1 run in 3 with the default `auto`), with `--tb=native` never. The
tracebacks start at the test, trimmed by tests/conftest.py's report hook.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAILURES = 100

FAILING_MODULE = f'''
import ast
import gc
import sys
import threading

import pytest


class Cycle:
    """Garbage whose finalizer runs Python code, so a GC can switch threads."""

    def __init__(self):
        self.me = self

    def __del__(self):
        sum(range(50))


def parse_forever():
    while True:
        for _ in range(100):
            Cycle()
        try:
            ast.parse("a = b + c * d\\n" * 50)
        except SystemError:
            pass  # this thread losing the race is not what is tested


def start_racing_threads():
    sys.setswitchinterval(1e-6)
    gc.set_threshold(10, 1, 1)
    for _ in range(2):
        threading.Thread(target=parse_forever, daemon=True).start()


def check_state(state):
    assert state == "Ready", f"state is {{state}}"


@pytest.mark.parametrize("n", range({FAILURES}))
def test_deliberately_fails(n):
    if n == 0:
        start_racing_threads()
    check_state("Provisioning")
'''

# A module the size of a real test module, so rendering has a big tree to parse.
PADDING = "".join(f"\n\ndef padding_{i}(a, b):\n    return [a, b, {i}]\n" for i in range(1000))

pytestmark = pytest.mark.slow


def test_failures_under_a_concurrent_ast_parse_are_reported_as_failures(tmp_path: Path) -> None:
    module = tmp_path / "test_deliberately_failing.py"
    module.write_text(FAILING_MODULE + PADDING)
    command = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
    # tests/conftest.py as a plugin: its hook trims the native tracebacks.
    command += ["-p", "tests.conftest", "--rootdir", str(tmp_path), "-p", "no:cacheprovider"]
    command += ["-q", str(module)]
    run = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = run.stdout + run.stderr
    assert "INTERNALERROR" not in output, output[-3000:]
    assert run.returncode == 1, output[-3000:]
    assert f"{FAILURES} failed" in run.stdout
    assert "AssertionError: state is Provisioning" in run.stdout
    # Each traceback starts at the test, not in pytest's own machinery.
    assert "Traceback (most recent call last)" in run.stdout
    assert "/pluggy/" not in run.stdout and "/_pytest/" not in run.stdout
