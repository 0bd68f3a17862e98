"""What a pool is asked, checked: its input, its queries' and updates' requests, and
updates applied once across runs.

Handlers take any arguments, untyped, so that none fails in the SDK before
these checks: a missing or extra argument and undecodable JSON are refused
as InvalidInput naming the argument, a bad field naming the field. Temporal
refuses a repeated update id within a run, not across continue-as-new, so
the pool keeps the results of the updates it applied lately (carried) and
answers a client's retry with the first result, never applying it twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.errors import invalid_input
    from workflows import pool_autoscale
    from workflows.inputs import DEFAULT_HEALTH_TARGET, parse_model
    from workflows.pool_autoscale import Books
    from workflows.pool_carried import AppliedUpdate
    from workflows.pool_input import PoolInput, ScaleRequest, StatusRequest, pool_id_problems
    from workflows.target_check import check_target, target_input

# Updates applied lately, by id, with their results: Temporal refuses a
# repeated update id within a run, not across continue-as-new, so a client
# retrying one after it would apply it twice (a second full `rotate`).
REMEMBERED_UPDATES = 64
# A remembered result keeps this many entries of a list (`rotate`'s queued).
REMEMBERED_LIST = 50


class AppliedUpdates:
    """The results of the updates the pool applied lately, by update id, oldest first."""

    def __init__(self, carried: Iterable[AppliedUpdate] = ()) -> None:
        self._results = {a.key: a.result for a in list(carried)[-REMEMBERED_UPDATES:]}

    def result(self) -> dict[str, Any] | None:
        """The result of the current update if its id was applied already (in an earlier run)."""
        return self._results.get(_update_key())

    def remember(self, result: dict[str, Any]) -> dict[str, Any]:
        """Keep the current update's result under its id, the oldest going past the bound."""
        kept = {k: v[:REMEMBERED_LIST] if isinstance(v, list) else v for k, v in result.items()}
        self._results[_update_key()] = kept
        while len(self._results) > REMEMBERED_UPDATES:
            del self._results[next(iter(self._results))]
        return result

    def carried(self) -> list[AppliedUpdate]:
        """What the next run remembers."""
        return [AppliedUpdate(k, r) for k, r in self._results.items()]


def _update_key() -> str:
    """A fixed-size key for the current update's id (a client's string, of any length)."""
    info = workflow.current_update_info()
    assert info is not None, "called from an update's handler or validator only"
    return hashlib.sha256(info.id.encode()).hexdigest()[:32]


def parsed(model: Any, raw: Any, what: str, extra: tuple[Any, ...]) -> Any:
    """`raw` as `model`, or InvalidInput naming every bad field and extra argument."""
    req, problems = parse_model(model, raw, f"(the {what} request)")
    problems += [f"argument {i}: unexpected extra argument" for i, _ in enumerate(extra, 2)]
    if problems or req is None:
        raise invalid_input(f"invalid {what} request: " + "; ".join(problems))
    return req


def status_request(request: Any, extra: tuple[Any, ...]) -> StatusRequest:
    """The page `status` is asked for (none: the first), or a refusal naming every bad field.

    A query that raises fails that query alone, never the pool.
    """
    if request is None and not extra:
        return StatusRequest()
    page: StatusRequest = parsed(StatusRequest, request, "status", extra)
    return page


def check_scale(req: ScaleRequest, autoscale: Books | None) -> None:
    """Refuse a `scale` request that does not fit the pool's mode, naming the field:
    `replicas` for a fixed pool, bounds an autoscaled pool (`autoscale`) can take."""
    if autoscale is None:
        if req.replicas is None:
            raise invalid_input(
                "invalid scale request: replicas: field required (this pool is not "
                "autoscaled: min_replicas/max_replicas are for autoscaled pools)"
            )
        return
    if req.replicas is not None or req.min_replicas is req.max_replicas is None:
        raise invalid_input(
            "invalid scale request: this pool is autoscaled: give min_replicas "
            "and/or max_replicas (its bounds), not replicas"
        )
    _, problem = pool_autoscale.rebound(autoscale, req.min_replicas, req.max_replicas)
    if problem is not None:
        raise invalid_input(f"invalid scale request: {problem}")


def autoscaled(autoscale: Books | None, what: str) -> Books:
    """An autoscaled pool's demand and decisions, or the refusal of `what` for a fixed pool."""
    if autoscale is None:
        raise ApplicationError(
            f"{what}: this pool is not autoscaled (no `autoscale` in its input)",
            type=pool_autoscale.NOT_AUTOSCALED,
            non_retryable=True,
        )
    return autoscale


async def checked_input(
    raw: Any, argument_problems: list[str], *, continued: bool
) -> PoolInput | str:
    """The pool's input, or why it is refused, naming every bad field.

    A continued run's input was checked when the pool first started; the
    first run's also by the worker (`worker_problems`).
    """
    inp, problems = parse_model(
        PoolInput, raw, "with at least 'template' and 'replicas' (or 'autoscale')"
    )
    if continued and inp is not None and not argument_problems:
        return inp
    problems = argument_problems + problems + pool_id_problems(workflow.info().workflow_id)
    if not argument_problems and isinstance(raw, dict):
        problems += await worker_problems(raw)
    if problems or inp is None:
        return "invalid input: " + "; ".join(problems)
    return inp


async def worker_problems(raw: dict[str, Any]) -> list[str]:
    """What only the worker can check, for the template and every spread entry.

    Read from the raw input, so these are named even when other fields
    are wrong too.
    """
    template = raw.get("template")
    template = template if isinstance(template, dict) else {}
    spread = raw.get("spread")
    targets = [("template.", template)] + [
        (f"spread.{i}.", entry)
        for i, entry in enumerate(spread if isinstance(spread, list) else [])
        if isinstance(entry, dict)
    ]
    port = template.get("port")
    health = template.get("health")
    target = health.get("target") if isinstance(health, dict) else None
    problems: list[str] = []
    for prefix, entry in targets:
        provider, placement = entry.get("provider"), entry.get("placement")
        if not isinstance(provider, str):
            continue
        found = await check_target(
            target_input(
                provider,
                port if isinstance(port, int) and 0 < port < 65536 else None,
                placement,
                target if isinstance(target, str) else DEFAULT_HEALTH_TARGET,
            )
        )
        problems += [
            prefix + problem for problem in found.problems if prefix + problem not in problems
        ]
    return problems
