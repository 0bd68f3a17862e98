"""The pool's `endpoints`, made visible to a describe: their digest in the pool's memo.

A gateway follows a pool by describing it (DescribeWorkflowExecution, which
Temporal Cloud does not bill) and querying `endpoints` (a billed action)
only when the answer may have changed. Without more to go on it can only
tell that the pool's history moved, and a busy pool's history moves at every
member report, timer and signal: several queries per rotation. A pool that
takes the patch `PUBLISH_ENDPOINTS_DIGEST` (workflows/patches.py) keeps a
short digest of its `endpoints` answer in its memo
(contract.ENDPOINTS_DIGEST_MEMO), which a describe returns: a gateway
queries when the digest moved, once per change.

The memo, not a search attribute: an upsert of either is one action
(`command_ModifyWorkflowProperties` on the dev server's action counter, as
`command_UpsertWorkflowSearchAttributes`), but a memo needs no registration
in the namespace (a search attribute missing on Temporal Cloud stops the
worker) and nothing lists pools by it.

The digest is upserted as a workflow task waits, when the steps of that
task changed it: once per task that changes `endpoints`, whatever else the
task did. A continued run starts with its predecessor's digest in its memo
(continue-as-new does not carry a memo by itself), so a handover costs no
upsert and shows a gateway no change.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from temporalio import workflow

from contract import ENDPOINTS_DIGEST_MEMO

# Hex digits of the digest: 64 bits, for telling one answer from the next.
DIGEST_LENGTH = 16


class Endpoint(Protocol):
    """What of an `endpoints` entry the digest covers: every field a gateway reads."""

    @property
    def member(self) -> str: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def provider(self) -> str: ...
    @property
    def placement(self) -> Mapping[str, str]: ...
    @property
    def exit_address(self) -> str | None: ...


def digest(endpoints: Sequence[Endpoint]) -> str:
    """A short digest of an `endpoints` answer: equal answers, equal digests."""
    hashed = hashlib.sha256()
    for entry in endpoints:
        fields = (
            entry.member,
            entry.endpoint,
            entry.provider,
            sorted(entry.placement.items()),
            entry.exit_address,
        )
        hashed.update(repr(fields).encode())
    return hashed.hexdigest()[:DIGEST_LENGTH]


class EndpointsFeed:
    """One run's digest of its `endpoints` in its memo, when the run took the patch."""

    def __init__(self) -> None:
        self._endpoints: Callable[[], Sequence[Endpoint]] | None = None
        self._touched = False
        self._upserter: asyncio.Task[None] | None = None

    def start(self, taken: bool, endpoints: Callable[[], Sequence[Endpoint]]) -> None:
        """Keep the memo's digest of `endpoints()` current from now on, if `taken`.

        Called once the run has its members (after the takeover), from the
        run method: the upserter is a coroutine of the workflow.
        """
        if taken:
            self._endpoints = endpoints
            self._upserter = asyncio.create_task(self._upsert_when_touched())

    def touch(self) -> None:
        """The members may have changed: the digest is looked at as this task waits."""
        self._touched = self._endpoints is not None

    def carried(self) -> dict[str, str] | None:
        """The memo a continued run starts with: the digest as it stands now (None: no feed)."""
        if self._endpoints is None:
            return None
        return {ENDPOINTS_DIGEST_MEMO: digest(self._endpoints())}

    async def _upsert_when_touched(self) -> None:
        assert self._endpoints is not None
        while True:
            await workflow.wait_condition(lambda: self._touched)
            # The coroutines woken by the same check run first (a step, its
            # handlers' follow-ups), so the digest is the task's last word.
            await asyncio.sleep(0)
            await workflow.wait_condition(lambda: True)
            self._touched = False
            now = digest(self._endpoints())
            if workflow.memo_value(ENDPOINTS_DIGEST_MEMO, None) != now:
                workflow.upsert_memo({ENDPOINTS_DIGEST_MEMO: now})
