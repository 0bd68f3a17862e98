"""What the Web UI shows of a pool (workflows/pool_view.py), without a server.

The same text on a real pool's page is checked end to end in
test_pool_web_ui.py.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from contract import PoolState, ProxyState
from workflows.markdown import CELL_GAP
from workflows.pool_plan import Member, MemberPhase
from workflows.pool_view import (
    DETAIL_ROWS,
    MAX_CELL,
    MAX_SUMMARY,
    current_details,
    signal_label,
    start_details,
    start_summary,
)

POOL = "pool-a"


def member(index: int, **fields: Any) -> Member:
    ready = Member(
        member=f"{POOL}/{index}",
        index=index,
        provider="local",
        placement={},
        started_at="2026-01-01T00:00:00+00:00",
        state=ProxyState.READY,
        endpoint=f"127.0.0.1:{4000 + index}",
        verified=f"127.0.0.1:{4000 + index}",
        generation=1,
    )
    return dataclasses.replace(ready, **fields)


def table_rows(details: str) -> list[list[str]]:
    """Each table line's cells as the UI shows them: split at unescaped pipes, unescaped."""
    rows = [line for line in details.splitlines() if line.startswith("| ")]
    return [[unescaped(cell) for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def unescaped(cell: str) -> str:
    return re.sub(r"\\(.)", r"\1", cell).strip()


def test_each_member_is_a_row_with_its_state_endpoint_generation_and_last_change() -> None:
    banned = member(1, banned="403 | from the shop", phase=MemberPhase.QUEUED, reason="ban: 403")
    rotated = member(2, last_rotation="rotate all (generation 0 to 1, 2026-01-01T00:10:00Z)")
    leaving = member(3, phase=MemberPhase.REMOVING, reason="scaled down, draining 15s")

    details = current_details(
        PoolState.SCALING, 3, 2, [member(0), banned, rotated, leaving], "1 members to end", None
    )

    assert details.startswith(
        "**Scaling**: 3 replicas, 2 Ready, 4 members\n\nwaiting for 1 members"
    )
    assert table_rows(details)[2:] == [
        [f"{POOL}/0", "Ready", "127.0.0.1:4000", "1", ""],
        [f"{POOL}/1", "Ready, queued", "127.0.0.1:4001", "1", "banned: 403 | from the shop"],
        [
            f"{POOL}/2",
            "Ready",
            "127.0.0.1:4002",
            "1",
            "rotated: rotate all (generation 0 to 1, 2026-01-01T00:10:00Z)",
        ],
        [
            f"{POOL}/3",
            "Ready, removing",
            "127.0.0.1:4003",
            "1",
            "removing: scaled down, draining 15s",
        ],
    ]


def test_a_large_pool_shows_its_first_rows_and_counts_the_rest() -> None:
    members = [member(n) for n in range(DETAIL_ROWS + 30)]

    details = current_details(PoolState.READY, len(members), len(members), members, None, None)

    assert len(table_rows(details)) == 2 + DETAIL_ROWS
    assert details.endswith("and 30 more members: the `status` query")
    assert len(details) < 3000  # read by every metadata query, and shown whole in the UI


def test_a_start_names_the_member_and_its_cause_in_one_bounded_line() -> None:
    new = member(7, lifetime_seconds=3600.0, placement={"zone": "europe-west1-b"})
    cause = "replaces pool-a/2, ended Failed: " + "crash loop " * 40

    summary = start_summary(new, cause)
    details = start_details(POOL, new, cause)

    assert summary.startswith(f"start {POOL}/7: replaces pool-a/2, ended Failed: crash loop")
    assert len(summary) == MAX_SUMMARY and "\n" not in summary
    assert f"member of pool `{POOL}`" in details
    assert cause.strip() in details  # the details keep it whole
    assert "local, zone=europe-west1-b" in details
    assert "after 3600s Ready" in details


def test_the_table_shows_only_an_endpoint_the_provider_confirmed() -> None:
    """A reported endpoint is a signal's word: a forged one never shows as the member's."""
    forged = member(0, endpoint="[evil](http://attacker.example)")
    checking = member(1, verified="")
    details = current_details(PoolState.READY, 2, 1, [forged, checking], None, None)
    assert "attacker" not in details
    assert [row[2] for row in table_rows(details)[2:]] == [
        "127.0.0.1:4000 (checking a new one)",
        "(checking)",
    ]


def test_a_signal_label_names_the_signal_member_and_cause_in_one_bounded_line() -> None:
    label = signal_label("rotate", f"{POOL}/3", "pool: ban: captcha\non /search " + "x" * 300)

    assert label.startswith(f"rotate {POOL}/3: pool: ban: captcha on /search x")
    assert len(label) == MAX_SUMMARY and "\n" not in label


def test_the_table_is_a_header_a_separator_and_a_row_per_member_with_spaced_cells() -> None:
    """As the Web UI 2.54 renders GFM: its reset CSS gives cells no padding, so each cell
    ends with an em space, which its renderer keeps; a pipe in a reason ends no cell."""
    members = [member(0), member(1, banned="a | b"), member(2)]

    details = current_details(PoolState.READY, 3, 2, members, None, None)

    lines = [line for line in details.splitlines() if line.startswith("|")]
    assert (
        lines[0]
        == "| "
        + " | ".join(
            f"{h}{CELL_GAP}"
            for h in ("member", "state", "endpoint", "generation", "last rotation or ban")
        )
        + " |"
    )
    assert lines[1] == "| --- | --- | --- | --- | --- |"
    assert len(lines) == 2 + len(members)
    assert all(len(row) == 5 for row in table_rows(details))
    assert all(f"{CELL_GAP} |" in line for line in lines[2:])
    assert "a \\| b" in lines[3]


def test_a_reason_too_long_for_its_cell_follows_the_table_whole() -> None:
    reason = "403 from the shop: captcha page on /search?q=shoes " + "and more " * 40
    members = [member(0), member(1, last_rotation=f"ban: {reason}(generation 0 to 1, now)")]

    details = current_details(PoolState.READY, 2, 2, members, None, None)

    cell = table_rows(details)[3][4]
    assert len(cell) == MAX_CELL and cell.endswith("…")
    _, after = details.rsplit("\n\nin full:\n\n", 1)
    assert after == f"- {POOL}/1: rotated: ban: {reason.strip()} (generation 0 to 1, now)"
    assert "in full" not in current_details(PoolState.READY, 1, 1, [member(0)], None, None)
