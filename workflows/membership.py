"""What a pool member tells its pool: the one message between ProxyLifecycle and ProxyPool.

A member started by a ProxyPool signals it (`MEMBER_CHANGED`) whenever its
state, endpoint or generation changes, so the pool never polls its members.
A lifecycle without a parent sends nothing, so a standalone proxy's history
holds nothing of pools.

Anyone who may signal workflows in the namespace can send this signal too,
so a report is untrusted input: `parse_report` checks every field and caps
every string before the pool keeps anything of it, and the endpoint it names
reaches the pool's `endpoints` only once the provider has confirmed that the
member's own instance serves there (workflows/pool.py, "verified").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from contract import ProxyState

# Caps on what a report may carry into the pool's state (and so into every
# continue-as-new payload and `status` answer): longer strings are cut.
MAX_ID_LENGTH = 300
# A provider's endpoint is `ip:port` or `[ipv6]:port` (providers/base.py,
# `endpoint`): 47 characters at most, of these. Anything else is no
# provider's, and bounded it keeps the pool's carried state small
# (workflows/pool_carried.py).
MAX_ENDPOINT_LENGTH = 64
ENDPOINT_CHARACTERS = re.compile(r"^[A-Za-z0-9.:%\[\]-]*$")
MAX_PROVIDER_LENGTH = 63
MAX_ERROR_LENGTH = 500
MAX_TIMESTAMP_LENGTH = 64
MAX_COUNTER = 2**62
# No member reports a time before this. The pool adds lifetimes to reported
# times, so a report may not reach the ends of what a datetime holds: with
# `ready_since` no later than `at`, which the pool refuses far in its future,
# a forged "9999-12-31" cannot overflow the pool's arithmetic (which would
# fail every workflow task of the pool from then on).
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class MemberReport:
    """One member's state as of `at`; `seq` orders reports made in the same instant."""

    member: str
    state: str
    endpoint: str
    provider: str
    generation: int
    ready_since: str | None
    at: str
    seq: int
    last_error: str | None = None

    def newer_than(self, at: str | None, seq: int) -> bool:
        """Whether this comes after the report made at `at` (`seq`); signals arrive out of order.

        The pool keeps only the latest. `at` is what it kept of the last one:
        a stamp it cannot read (carried from before reports were checked)
        counts as older.
        """
        if at is None:
            return True
        try:
            return (datetime.fromisoformat(self.at), self.seq) > (datetime.fromisoformat(at), seq)
        except (ValueError, TypeError):  # unreadable, or without a time zone
            return True


# The key of the report's one-line summary in the signal's input: Temporal's
# JSON sorts keys, and "_" sorts before every lower-case letter, so the Web
# UI's cut-off view of the input begins with it instead of the timestamp.
SUMMARY_KEY = "_summary"


def signal_input(report: MemberReport) -> dict[str, Any]:
    """The `member_changed` input: the report, led by a summary a person can read.

    `parse_report` ignores the summary (it is not a field), so a report with
    or without one parses the same.
    """
    endpoint = report.endpoint or "no endpoint"
    summary = f"{report.member} {report.state}, {endpoint}, generation {report.generation}"
    return {SUMMARY_KEY: summary, **dataclasses.asdict(report)}


def parse_report(raw: Any) -> tuple[MemberReport | None, str | None]:
    """A report from a signal's raw input, or None and why it is not one.

    Never raises, whatever `raw` is: a handler that raised would fail every
    workflow task of the pool from then on.
    """
    if not isinstance(raw, dict):
        return None, f"not an object but {type(raw).__name__}"
    problems: list[str] = []

    def text(key: str, cap: int, *, optional: bool = False) -> str | None:
        value = raw.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            problems.append(f"{key}: not a string")
            return None
        return value[:cap]

    def count(key: str) -> int:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNTER:
            problems.append(f"{key}: not a whole number from 0")
            return 0
        return value

    def timestamp(key: str, *, optional: bool = False) -> str | None:
        value = text(key, MAX_TIMESTAMP_LENGTH, optional=optional)
        if value is None:
            return None
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            problems.append(f"{key}: not an ISO 8601 timestamp")
            return None
        if parsed.tzinfo is None:
            problems.append(f"{key}: has no time zone")
            return None
        if parsed < EARLIEST:
            problems.append(f"{key}: before {EARLIEST.year}")
            return None
        return value

    endpoint = text("endpoint", MAX_ENDPOINT_LENGTH) or ""
    if not ENDPOINT_CHARACTERS.match(endpoint):
        problems.append("endpoint: not an address and port")
    member = text("member", MAX_ID_LENGTH)
    state = text("state", MAX_ID_LENGTH)
    if state is not None and state not in set(ProxyState):
        problems.append(f"state: {state!r} is not a proxy state")
    report = MemberReport(
        member=member or "",
        state=state or "",
        endpoint=endpoint,
        provider=text("provider", MAX_PROVIDER_LENGTH) or "",
        generation=count("generation"),
        ready_since=timestamp("ready_since", optional=True),
        at=timestamp("at") or "",
        seq=count("seq"),
        last_error=text("last_error", MAX_ERROR_LENGTH, optional=True),
    )
    since, at = report.ready_since, report.at
    if since and at and datetime.fromisoformat(since) > datetime.fromisoformat(at):
        problems.append("ready_since: later than at")
    if problems:
        return None, "; ".join(problems)
    return report, None
