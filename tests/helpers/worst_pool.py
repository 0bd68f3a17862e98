"""The largest pool there can be, every string at its cap: for the tests and benchmarks
that bound what a pool carries and answers (continue-as-new, `status`).

Each text is unique to its member and made of characters that take 12
bytes apiece as JSON, so no sharing or compression makes it smaller than
the worst a pool can meet. A payload's size is what the SDK's default
converter makes of it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.converter import default

from contract import PoolState, ProxyState
from workflows.inputs import MAX_REASON
from workflows.membership import MAX_COUNTER, MAX_ENDPOINT_LENGTH, MAX_ERROR_LENGTH
from workflows.pool_autoscale import (
    MAX_GATEWAYS,
    MAX_TUNNELS,
    Books,
    Demand,
    ScalingStatus,
    Usage,
)
from workflows.pool_carried import AppliedUpdate, Lifetimes, PoolCarried
from workflows.pool_input import MAX_REPLICAS, StatusRequest
from workflows.pool_plan import Member, MemberPhase
from workflows.pool_requests import REMEMBERED_LIST, REMEMBERED_UPDATES
from workflows.pool_status import PoolStatus, member_page

WARNING_SIZE = 512 * 1024  # Temporal's payload size warning
LIMIT_SIZE = 2 * 1024 * 1024  # the server refuses a larger payload
POOL = "p" * 200  # the longest pool id
T0 = datetime(2026, 1, 1, tzinfo=UTC)
LIFETIMES = Lifetimes(3600, 0.2)
ENDPOINT_ALPHABET = "0123456789abcdef:[]."


def payload_size(value: Any) -> int:
    [payload] = default().payload_converter.to_payloads([value])
    return len(payload.data)


def longest(n: int, length: int) -> str:
    """A text unique to `n`, of `length` characters that each take 12 bytes as JSON."""
    return (f"{n}:" + "\U0001f525" * length)[:length]


def endpoint(n: int) -> str:
    digits = "".join(ENDPOINT_ALPHABET[int(d)] for d in str(n))
    return (digits + "[" * MAX_ENDPOINT_LENGTH)[:MAX_ENDPOINT_LENGTH]


def worst_member(index: int) -> Member:
    """Member `index` with every field at its largest, every text its own."""
    ban = longest(index, MAX_REASON)
    return Member(
        member=f"{POOL}/{index}",
        index=index,
        provider="p" * 63,
        placement={"zone": "europe-west12-a", "namespace": "n" * 63},
        started_at=T0.isoformat(),
        spread=99,
        lifetime_seconds=LIFETIMES.of(index),
        state=ProxyState.PROVISIONING,
        endpoint=endpoint(index),
        verified=endpoint(index + MAX_REPLICAS),
        generation=MAX_COUNTER - 1,
        ready_since=(T0 + timedelta(microseconds=123456)).isoformat(),
        last_error=longest(index, MAX_ERROR_LENGTH),
        report_at=(T0 + timedelta(microseconds=654321)).isoformat(),
        report_seq=MAX_COUNTER - 1,
        phase=MemberPhase.ROTATING,
        reason=f"ban: {ban}",
        rotating_from=MAX_COUNTER - 1,
        banned=ban,
        served=True,
        last_rotation=f"ban: {longest(-index, MAX_REASON)} (generation 1 to 2, {T0})",
        exit_address=f"2001:db8:ffff:ffff:ffff:ffff:ffff:{index:04x}",  # an IPv6 at its longest
        rotation_started=(T0 + timedelta(microseconds=111111)).isoformat(),
        retry_at=(T0 + timedelta(microseconds=222222)).isoformat(),
    )


def worst_state() -> PoolCarried:
    members = [worst_member(n) for n in range(MAX_REPLICAS)]
    rotated = {"queued": [m.member for m in members[:REMEMBERED_LIST]]}
    return PoolCarried(
        replicas=MAX_REPLICAS,
        members=members,
        next_index=MAX_COUNTER - 1,
        failures_in_a_row=MAX_COUNTER - 1,
        last_error=longest(1, MAX_ERROR_LENGTH),
        stopped_replacing=longest(2, MAX_ERROR_LENGTH),
        start_after=T0.isoformat(),
        bans=[(T0 + timedelta(microseconds=n)).isoformat() for n in range(MAX_REPLICAS)],
        last_reconcile=T0.isoformat(),
        terminate_reason=longest(3, MAX_REASON),
        rejected_reports=MAX_COUNTER - 1,
        last_rejected=longest(4, MAX_ERROR_LENGTH),
        vacancies=[f"replaces x, ended Failed: {longest(n, 500)}" for n in range(MAX_REPLICAS)],
        applied_updates=[AppliedUpdate("k" * 32, rotated) for _ in range(REMEMBERED_UPDATES)],
        autoscale=Books(
            0,
            MAX_REPLICAS,
            reports=[
                Demand(f"{n:02d}" + "g" * 98, T0.isoformat(), MAX_TUNNELS, MAX_TUNNELS)
                for n in range(MAX_GATEWAYS)
            ],
            above_since=T0.isoformat(),
            last_decision=longest(5, MAX_ERROR_LENGTH),
            decided_at=T0.isoformat(),
        ),
        usage=Usage(1e12, T0.isoformat(), MAX_REPLICAS),
    )


def status_answer(members: list[Member], request: StatusRequest) -> tuple[PoolStatus, Any]:
    """The whole `status` answer for one page, every pool-wide text at its cap too."""
    page, next_page = member_page(members, request)
    status = PoolStatus(
        state=PoolState.DEGRADED,
        as_of="2026-01-01T00:00:00+00:00",
        replicas=MAX_REPLICAS,
        ready=0,
        members=page,
        waiting_for=longest(1, MAX_ERROR_LENGTH),
        failures_in_a_row=2**62,
        last_error=longest(2, MAX_ERROR_LENGTH),
        stopped_replacing=longest(3, MAX_ERROR_LENGTH),
        terminate_reason=longest(4, MAX_REASON),
        rejected_reports=2**62,
        last_rejected=longest(5, MAX_ERROR_LENGTH),
        scaling=worst_scaling(),
        last_exit_problem=longest(6, MAX_ERROR_LENGTH),
        members_total=len(members),
        next_page=next_page,
    )
    return status, next_page


def worst_scaling() -> ScalingStatus:
    return ScalingStatus(
        mode="autoscaled",
        why=longest(7, MAX_ERROR_LENGTH),
        member_hours=1e12,
        min_replicas=0,
        max_replicas=MAX_REPLICAS,
        target_tunnels_per_member=MAX_TUNNELS,
        open_tunnels=MAX_TUNNELS * MAX_GATEWAYS,
        new_tunnels=MAX_TUNNELS * MAX_GATEWAYS,
        gateways=MAX_GATEWAYS,
        last_decision=longest(8, MAX_ERROR_LENGTH),
        decided_at="2026-01-01T00:00:00+00:00",
    )


def pages(members: list[Member], limit: int) -> list[PoolStatus]:
    found, request = [], StatusRequest(limit=limit)
    while True:
        status, next_page = status_answer(members, request)
        found.append(status)
        if next_page is None:
            return found
        request = StatusRequest(**next_page)
