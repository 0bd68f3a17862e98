"""What a pool member tells its pool: the one message between ProxyLifecycle and ProxyPool.

A member started by a ProxyPool signals it (`MEMBER_CHANGED`) whenever its
state, endpoint or generation changes, so the pool never polls its members.
A lifecycle without a parent sends nothing, so a standalone proxy's history
is the same as before pools existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


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

    def newer_than(self, other: MemberReport | None) -> bool:
        """Signals can arrive out of order; the pool keeps only the latest report."""
        if other is None:
            return True
        mine, theirs = datetime.fromisoformat(self.at), datetime.fromisoformat(other.at)
        return (mine, self.seq) > (theirs, other.seq)
