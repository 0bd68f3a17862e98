"""The commands in our Markdown, extracted so tests/docs/test_commands.py can run them.

What counts as a command, and the few comments that steer the test:

- A fenced block whose info string is `sh` or `console` and which runs the
  `temporal` CLI (`temporal ...` or `.venv/bin/temporal ...`) is an example.
  An `sh` block runs as one bash script (`set -eo pipefail`), exactly as it
  would pasted into a terminal. A `console` block is a transcript: lines that
  start with `$ ` (continued by a trailing backslash) are run, the other lines
  are output that must appear, in that order, in what they print.
- `<!-- docs-test: wait <workflow-id> <state> -->` before a block: a reader
  watches the proxy get there before going on, so the test waits too.
- `<!-- docs-test: each-on-fresh <workflow-id> -->` before a table: every
  `temporal` command in the table's cells runs on its own freshly started,
  Ready `<workflow-id>` (where `...` stands for `--workflow-id <workflow-id>`).
- `<!-- docs-test: skip <reason> -->` before a block: not run, for commands
  that cannot apply to a dev server and the local provider; the reason is
  for the next reader of the Markdown.

Blocks in other languages, and commands in prose, are not run here.
docs/scrapers.md's `python` blocks are run by tests/workflows/test_gateway_scrapy.py
(they need a gateway over a pool), each as its directive says: `python`
(a script), `scrapy-runspider` (a spider file) or `syntax-only <reason>`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# `temporal <subcommand>` where a shell command starts: a line (or a `$ ` prompt), `$(`, a pipe.
TEMPORAL_COMMAND = re.compile(
    r"(?:^(?:\$ )?\s*|\$\(|[|;&]\s*)(?:\.venv/bin/)?temporal\s+[a-z]", re.MULTILINE
)
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(.+?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)")
INLINE_CODE = re.compile(r"`([^`]+)`")
RUNNABLE = ("sh", "console")


@dataclass(frozen=True)
class Example:
    """One runnable piece of a document."""

    source: str  # "docs/operations.md:123", the line its block or table starts on
    kind: str  # "sh", "console" or "each-on-fresh"
    text: str
    directives: tuple[str, ...] = field(default=())

    def directive(self, name: str) -> list[str] | None:
        """The words after `name` in this example's directive of that name, if any."""
        for directive in self.directives:
            words = directive.split()
            if words[0] == name:
                return words[1:]
        return None


def examples(
    path: Path,
    root: Path,
    runs: re.Pattern[str] = TEMPORAL_COMMAND,
    language: str | None = None,
) -> list[Example]:
    """Every example in the Markdown file at `path`, in document order.

    An example is a block that `runs` a command of interest: the `temporal`
    CLI's by default (docs/gateway-api.md's tests look for curl). With
    `language`, every block of that language instead (tables aside), e.g.
    docs/scrapers.md's `python` blocks, whose directives say how each runs.
    """
    name = path.relative_to(root).as_posix()
    lines = path.read_text().splitlines()
    found: list[Example] = []
    pending: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if directive := DIRECTIVE.match(line):
            pending.append(directive.group(1))
            i += 1
            continue
        if fence := FENCE.match(line):
            start = i + 1
            indent, info = fence.group(1), fence.group(2)
            body, i = _fenced_body(lines, i + 1, indent)
            wanted = info == language if language else info in RUNNABLE and runs.search(body)
            if wanted:
                found.append(Example(f"{name}:{start}", info, body, tuple(pending)))
            pending = []
            continue
        each_on_fresh = any(d.startswith("each-on-fresh") for d in pending)
        if not language and line.lstrip().startswith("|") and each_on_fresh:
            start = i + 1
            commands = []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                commands += [c for c in INLINE_CODE.findall(lines[i]) if c.startswith("temporal ")]
                i += 1
            table = "\n".join(commands)
            found.append(Example(f"{name}:{start}", "each-on-fresh", table, tuple(pending)))
            pending = []
            continue
        if line.strip():
            pending = []
        i += 1
    return found


def _fenced_body(lines: list[str], i: int, indent: str) -> tuple[str, int]:
    """The block's lines, de-indented by its fence's indent, and the line after its end."""
    body = []
    while i < len(lines) and not lines[i].strip().startswith("```"):
        line = lines[i]
        body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
        i += 1
    return "\n".join(body) + "\n", i + 1


def console_commands(transcript: str) -> list[tuple[str, list[str]]]:
    """A `console` block as (command, the output lines shown after it) pairs."""
    pairs: list[tuple[str, list[str]]] = []
    lines = transcript.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        command = lines[i][2:]
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command[:-1] + lines[i]
        i += 1
        output = []
        while i < len(lines) and not lines[i].startswith("$ "):
            if lines[i].strip():
                output.append(lines[i])
            i += 1
        pairs.append((command, output))
    return pairs
