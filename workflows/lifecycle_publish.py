"""Publishing a lifecycle's status: search attributes, Web UI details, the parent pool.

`StatusPublisher.publish` is the one step by which anything outside the
workflow learns of a change: `temporal workflow list` (search attributes),
the Web UI (current details) and, for a pool member, the pool (a
`member_changed` signal). Each issues a command only when what it shows
changed, so publishing again is free.

Each upsert of search attributes is a Temporal Cloud action, and one
workflow task often publishes twice in a row: a proxy's first task
(Provisioning, then the first instance's name just before its create), its
last (the last instance gone, then Terminated), a rotation that begins as
the previous one's old instance is deleted. The publisher upserts what it
last published once the workflow waits (every coroutine blocked), so such a
task upserts once. A state the task passes through (Unhealthy, on its way
to Replacing) still gets an upsert of its own: every state a proxy was in
stays in its history.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate
from temporalio.exceptions import FailureError

from contract import (
    ENDPOINT,
    INSTANCES,
    KEYWORDS,
    MEMBER_CHANGED_SIGNAL,
    PROVIDER,
    STATE,
    ProxyState,
)
from workflows import lifecycle_view
from workflows.lifecycle_carried import ProxyStatus
from workflows.membership import SUMMARY_KEY, MemberReport, signal_input

_SearchAttributes = tuple[dict[str, str], list[str]]


def _state(attributes: _SearchAttributes) -> str | None:
    return attributes[0].get(STATE.name)


class StatusPublisher:
    """What one run has published, so it publishes only what changed."""

    def __init__(self) -> None:
        self._search_attributes: _SearchAttributes = ({}, [])
        # What the next upsert sets, while one is owed (`upsert_as_tasks_wait`).
        self._owed: _SearchAttributes | None = None
        self._upserter: asyncio.Task[None] | None = None
        # What the pool (if this is a pool member) was last told, and the
        # signals telling it that are still in flight.
        self._reported: tuple[str, str, int, str | None] | None = None
        self._reports: list[asyncio.Task[None]] = []
        self._report_seq = 0
        # Report only what the pool sees change: an endpoint is part of a
        # report only while Ready, so an instance getting its address while
        # Provisioning or Replacing is no news to the pool. Set for members a
        # pool started with `monitor: "pool"` (0.3.0 on), whose recorded runs
        # never sent that report; members started before still send it, so
        # their histories replay.
        self.only_news = False

    def started_by_pool(self) -> None:
        """The pool that started this member knows it is Provisioning: report only what follows."""
        self._reported = (ProxyState.PROVISIONING, "", 0, None)

    def upsert_as_tasks_wait(self) -> None:
        """Upsert the search attributes as the workflow waits, once for what a task published.

        The upserter's condition is checked only once every coroutine of the
        workflow is blocked, and it then lets the coroutines woken by the same
        check run on first: its upsert sets what the task published last. A
        task whose coroutines wake one another through several checks may
        still upsert twice, never more often than upserting at each change.
        Everything a run publishes is deterministic, so a replay upserts at
        the same points.
        """
        self._upserter = asyncio.create_task(self._upsert_when_owed())

    def publish(self, status: ProxyStatus, instances: set[str]) -> None:
        """Search attributes, then current details, then the pool: in that order, always."""
        self._set_search_attributes(status, instances)
        self._set_current_details(status)
        self._tell_pool(status)

    async def delivered(self) -> None:
        """Before the workflow closes: the owed upsert, then the pool's signals.

        A closed workflow's pending signals are never sent, and an upsert
        owed as it closes would be lost.
        """
        self.upsert_owed()
        await asyncio.gather(*self._reports)

    def upsert_owed(self) -> None:
        """The owed upsert, if any, now: the upserter's, or before a command that ends the run."""
        wanted, self._owed = self._owed, None
        if wanted is None:
            return
        keywords, instances = wanted
        updates: list[SearchAttributeUpdate[Any]] = [
            key.value_set(keywords[key.name]) if keywords[key.name] else key.value_unset()
            for key in KEYWORDS
        ]
        updates.append(INSTANCES.value_set(instances) if instances else INSTANCES.value_unset())
        workflow.upsert_search_attributes(updates)
        self._search_attributes = wanted

    def _set_search_attributes(self, status: ProxyStatus, instances: set[str]) -> None:
        """ProxyState, ProxyProvider, ProxyEndpoint (only while Ready) and ProxyInstances."""
        keywords = {
            STATE.name: status.state,
            PROVIDER.name: status.provider,
            ENDPOINT.name: status.endpoint if status.state == ProxyState.READY else "",
        }
        wanted = (keywords, sorted(instances))
        if self._owed is not None and _state(self._owed) not in (
            _state(self._search_attributes),
            status.state,
        ):
            # The owed upsert shows a state no upsert has shown, and this one
            # leaves it: upserted now, so that every state a proxy passes
            # through is in its history (Unhealthy, then Replacing, in one task).
            self.upsert_owed()
        self._owed = None if wanted == self._search_attributes else wanted
        if self._upserter is None:
            self.upsert_owed()

    async def _upsert_when_owed(self) -> None:
        while True:
            await workflow.wait_condition(lambda: self._owed is not None)
            # A coroutine woken by the same check (a rotation that waited for
            # the old instance's deletion) may go on through a wait that is
            # over already: to the back of the queue, behind its next
            # condition, then one more check, so it publishes before the upsert.
            await asyncio.sleep(0)
            await workflow.wait_condition(lambda: True)
            self.upsert_owed()

    @staticmethod
    def _set_current_details(status: ProxyStatus) -> None:
        """The Web UI's account of the proxy (no command: read with the workflow's metadata)."""
        workflow.set_current_details(lifecycle_view.current_details(status))

    def _tell_pool(self, status: ProxyStatus) -> None:
        """Signal the parent pool when state, endpoint or generation changed.

        Only a child workflow has a parent; a standalone proxy issues no command
        here. The signal goes by workflow id alone, so it reaches the pool's
        current run after the pool continued as new.
        """
        parent = workflow.info().parent
        endpoint = status.endpoint if status.state == ProxyState.READY else ""
        now = (
            status.state,
            endpoint if self.only_news else status.endpoint,
            status.generation,
            status.ready_since,
        )
        if parent is None or now == self._reported:
            return
        self._reported = now
        report = MemberReport(
            member=workflow.info().workflow_id,
            state=status.state,
            endpoint=endpoint,
            provider=status.provider,
            generation=status.generation,
            ready_since=status.ready_since,
            at=workflow.now().isoformat(),
            seq=self._report_seq,
            last_error=status.last_error,
        )
        self._report_seq += 1
        pool = workflow.get_external_workflow_handle(parent.workflow_id)
        self._reports = [task for task in self._reports if not task.done()]
        self._reports.append(asyncio.create_task(_send_report(pool, report)))


async def _send_report(pool: workflow.ExternalWorkflowHandle[Any], report: MemberReport) -> None:
    # A pool that is gone (hard-terminated) cannot be told; OrphanGC ends its members.
    with contextlib.suppress(FailureError):
        payload = signal_input(report)
        # The label names the member and its state in this member's history.
        label = payload[SUMMARY_KEY]
        group = workflow.create_event_group(report.member, label=label)
        await pool.signal(MEMBER_CHANGED_SIGNAL, payload, event_groups=[group])
