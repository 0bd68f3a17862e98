"""Markdown as the Temporal Web UI (2.54) renders current and static details: pure text.

The UI renders details as GitHub-flavoured Markdown in a sandboxed frame
(its `/render` page), raw HTML included, under a policy that allows no
style: every element's padding and border are reset to zero, so a table's
columns touch ("Ready127.0.0.1:200073"), and no inline `style` may space
them. What the workflows write there follows from that:

- `text` escapes what someone else wrote (a ban reason, a signal's reason,
  a provider's error) so it shows as written, never as markup: a `|` does
  not end a table cell, `<b>` does not become bold, `[x](y)` does not
  become a link (a bare URL does: the UI links those itself);
- `table` ends every cell with an em space, a character the renderer's
  whitespace handling keeps, so the columns stand apart.
"""

from __future__ import annotations

from collections.abc import Sequence

# Characters that start markup anywhere in a line: HTML, links, emphasis,
# code, a table cell's end, and the escape itself.
_MARKUP = "\\|<>[]*_`"
# Ends each table cell: the renderer keeps it, unlike a space, and the
# column beside it starts one em further.
CELL_GAP = "\u2003"


def text(raw: str) -> str:
    """`raw` on one line, each character that would start markup escaped."""
    flat = " ".join(raw.split())
    return "".join(f"\\{c}" if c in _MARKUP else c for c in flat)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table the UI renders as one: a header row, its separator, a row per entry.

    Cells are taken as Markdown already (escape what others wrote with `text`).
    """
    lines = [_row(header), "| " + " | ".join("---" for _ in header) + " |"]
    lines += [_row(row) for row in rows]
    return "\n".join(lines)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(f"{cell}{CELL_GAP}" for cell in cells) + " |"
