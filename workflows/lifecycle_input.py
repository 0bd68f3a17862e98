"""A lifecycle's input checked twice: against the schema, then by the worker.

The schema (workflows/inputs.py) says what a well-formed input is; only the
worker knows its providers, what placement fits each and which ports its
proxies may CONNECT to, so it is asked too, in a local activity that also
says which installation this is (the scope instance names are hashed in).
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from workflows.inputs import ProxyInput, parse_input
from workflows.target_check import check_target, target_input


async def checked_input(
    raw: Any, argument_problems: list[str], *, against_worker: bool
) -> tuple[ProxyInput | None, list[str], str | None]:
    """The input, every problem with it, and the worker's installation if it was asked."""
    inp, problems = parse_input(raw)
    problems = argument_problems + problems
    if inp is not None and inp.monitor == "pool" and workflow.info().parent is None:
        # Nothing would probe it: a pool starts its members as its children.
        problems.append(
            "monitor: 'pool' is for the members a pool starts; a proxy of its own takes 'own'"
        )
    if not (
        against_worker
        and not argument_problems
        and isinstance(raw, dict)
        and isinstance(raw.get("provider"), str)
    ):
        return inp, problems, None
    target = target_input(
        raw["provider"],
        inp.port if inp else None,
        raw.get("placement"),
        inp.health.target if inp else "",
    )
    check = await check_target(target)
    return inp, problems + check.problems, check.installation
