"""Publishing a lifecycle's status: search attributes, Web UI details, the parent pool.

`StatusPublisher.publish` is the one step by which anything outside the
workflow learns of a change: `temporal workflow list` (search attributes),
the Web UI (current details) and, for a pool member, the pool (a
`member_changed` signal). Each issues a command only when what it shows
changed, so publishing again is free.
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
from workflows.lifecycle_carried import ProxyStatus
from workflows.membership import SUMMARY_KEY, MemberReport, signal_input


class StatusPublisher:
    """What one run has published, so it publishes only what changed."""

    def __init__(self) -> None:
        self._search_attributes: tuple[dict[str, str], list[str]] = ({}, [])
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

    def publish(self, status: ProxyStatus, instances: set[str]) -> None:
        """Search attributes, then current details, then the pool: in that order, always."""
        self._set_search_attributes(status, instances)
        self._set_current_details(status)
        self._tell_pool(status)

    async def delivered(self) -> None:
        """Before the workflow closes: a closed workflow's pending signals are never sent."""
        await asyncio.gather(*self._reports)

    def _set_search_attributes(self, status: ProxyStatus, instances: set[str]) -> None:
        """ProxyState, ProxyProvider, ProxyEndpoint (only while Ready) and ProxyInstances."""
        keywords = {
            STATE.name: status.state,
            PROVIDER.name: status.provider,
            ENDPOINT.name: status.endpoint if status.state == ProxyState.READY else "",
        }
        wanted = (keywords, sorted(instances))
        if wanted == self._search_attributes:
            return
        updates: list[SearchAttributeUpdate[Any]] = [
            key.value_set(keywords[key.name]) if keywords[key.name] else key.value_unset()
            for key in KEYWORDS
        ]
        updates.append(INSTANCES.value_set(wanted[1]) if wanted[1] else INSTANCES.value_unset())
        workflow.upsert_search_attributes(updates)
        self._search_attributes = wanted

    @staticmethod
    def _set_current_details(status: ProxyStatus) -> None:
        """The Web UI's summary of the proxy (no command: read with the workflow's metadata)."""
        lines = [f"**{status.state}** on `{status.provider or '?'}`"]
        if status.endpoint:
            lines.append(
                f"endpoint `{status.endpoint}` ({status.instance}, generation {status.generation})"
            )
        if status.waiting_for:
            lines.append(status.waiting_for)
        if status.last_error:
            lines.append(f"last error ({status.last_error_at or '?'}): {status.last_error}")
        workflow.set_current_details("\n\n".join(lines))

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
