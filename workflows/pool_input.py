"""ProxyPool's input and its updates' requests, validated inside the workflow.

As with ProxyLifecycle (workflows/inputs.py), the pool takes raw JSON and
validates it here, so bad input fails the pool within seconds naming every
bad field instead of a workflow task retried forever. `template` is a
ProxyLifecycle input, validated as one: its errors read `template.<field>`.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from workflows.inputs import HttpsUrl, PlacementInput, ProxyInput, StrictInput

MAX_REPLICAS = 1000
# Members one `status` answer lists unless asked for fewer or more, and at
# most: a page of the largest members stays under 1 MiB (workflows/pool_status.py).
DEFAULT_PAGE = 200
MAX_PAGE = 500
# Pool ids end up in member ids (`<pool id>/<n>`) and in visibility queries:
# a conservative alphabet needs no quoting anywhere.
POOL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")

Replicas = Annotated[int, Field(ge=0, le=MAX_REPLICAS)]
# A share of the replicas, as Kubernetes' rolling updates take one: "10%".
PERCENTAGE = re.compile(r"^(100|[1-9]?[0-9])%$")
# A rotation whose new instance is not Ready by then is abandoned.
DEFAULT_ROTATION_DEADLINE = 900
Text = Annotated[str, Field(max_length=500)]


class SpreadEntry(StrictInput):
    """Members placed here get this provider and placement, in proportion to `weight`."""

    provider: Annotated[str, Field(min_length=1, max_length=63)]
    placement: PlacementInput = PlacementInput()
    weight: Annotated[int, Field(ge=1, le=1000)] = 1


class BanLimit(StrictInput):
    """At most `max` accepted ban reports per `window_seconds`, per pool."""

    # None: a quarter of the pool's replicas, at least 1.
    max: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] | None = None
    window_seconds: Annotated[int, Field(ge=1, le=86400)] = 600

    def limit(self, replicas: int) -> int:
        return self.max if self.max is not None else max(1, replicas // 4)


class Autoscale(StrictInput):
    """Size the pool by its gateways' demand (workflows/pool_autoscale.py), within bounds."""

    # 0: scale to zero while idle; a gateway's `wake` starts one member.
    min_replicas: Replicas = 0
    max_replicas: Replicas
    # Open tunnels one member should carry: demand / target is the wanted size.
    target_tunnels_per_member: Annotated[int, Field(ge=1, le=100_000)] = 10
    scale_up_after_seconds: Annotated[int, Field(ge=1, le=86400)] = 30
    scale_down_after_seconds: Annotated[int, Field(ge=1, le=7 * 86400)] = 300

    @model_validator(mode="after")
    def _ordered_bounds(self) -> Autoscale:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must not exceed "
                f"max_replicas ({self.max_replicas})"
            )
        return self


class PoolInput(StrictInput):
    """What a user passes to `temporal workflow start --type ProxyPool --input`."""

    # With `autoscale`: the size the pool starts at, within its bounds;
    # `autoscale.min_replicas` when absent (`_autoscaled_starts_at_min`).
    replicas: Replicas
    template: ProxyInput
    spread: Annotated[list[SpreadEntry], Field(min_length=1, max_length=100)] | None = None
    # Rotations (each an extra instance while it lasts) under way at once: a
    # count, or a percentage of `replicas` rounded up (`surge`).
    max_surge: int | str = 1
    # Members that may be short of serving (starting, failing, banned) while
    # the pool still starts lifetime rotations: a count, or a percentage of
    # `replicas` rounded down (`unavailable`). Bans rotate regardless.
    max_unavailable: int | str = "10%"
    # A rotation whose new instance is not Ready this long after its `rotate`
    # is abandoned (counted in `status`), and retried that long later.
    rotation_deadline_seconds: Annotated[int, Field(ge=60, le=86400)] = DEFAULT_ROTATION_DEADLINE
    # Member n's lifetime is max_lifetime * (1 - lifetime_jitter * u(n)),
    # u(n) in [0, 1) spread evenly (workflows/pool_plan.py, `jittered_lifetime`).
    lifetime_jitter: Annotated[float, Field(ge=0, le=0.9)] = 0.2
    # Members in a row that end Failed before the pool stops replacing them.
    failure_budget: Annotated[int, Field(ge=1, le=100)] = 3
    bans: BanLimit = BanLimit()
    autoscale: Autoscale | None = None
    # An https service that answers with the caller's address: asked through
    # each member once its endpoint is confirmed (activities/exit_echo.py).
    exit_echo_url: HttpsUrl | None = None
    # A member whose exit address another member already uses is replaced
    # (once in a row: a NAT shared by every instance would replace for ever).
    distinct_exits: bool = False

    @model_validator(mode="before")
    @classmethod
    def _autoscaled_starts_at_min(cls, data: Any) -> Any:
        """An autoscaled pool without `replicas` starts at `autoscale.min_replicas`.

        Its size is the autoscaler's to choose, so a first size is optional.
        Both together stay allowed (`replicas` is then the first size, within
        the bounds): pools have run with both since autoscaling came, and a
        continued run validates its first run's input again.
        """
        if not isinstance(data, dict) or "replicas" in data:
            return data
        bounds = data.get("autoscale")
        if not isinstance(bounds, dict):
            return data  # a fixed pool: `replicas: field required`
        least = bounds.get("min_replicas", Autoscale.model_fields["min_replicas"].default)
        valid = type(least) is int and 0 <= least <= MAX_REPLICAS
        # A bad min_replicas is named under `autoscale` alone, not twice.
        return {**data, "replicas": least if valid else 0}

    @model_validator(mode="after")
    def _replicas_within_bounds(self) -> PoolInput:
        bounds = self.autoscale
        if bounds is not None and not bounds.min_replicas <= self.replicas <= bounds.max_replicas:
            raise ValueError(
                f"replicas ({self.replicas}) is the autoscaled pool's first size and must be "
                f"within autoscale.min_replicas ({bounds.min_replicas}) and "
                f"autoscale.max_replicas ({bounds.max_replicas})"
            )
        return self

    @field_validator("max_surge", "max_unavailable", mode="before")
    @classmethod
    def _count_or_percentage(cls, value: Any, info: ValidationInfo) -> Any:
        # No surge would rotate nothing; no unavailability is allowed.
        least = 1 if info.field_name == "max_surge" else 0
        if isinstance(value, bool) or not (
            (isinstance(value, int) and least <= value <= MAX_REPLICAS)
            or (isinstance(value, str) and PERCENTAGE.match(value) and int(value[:-1]) >= least)
        ):
            raise ValueError(
                f'must be a count from {least} to {MAX_REPLICAS} or a percentage from "{least}%" '
                f'to "100%", got {str(value)[:40]!r}'
            )
        return value

    def surge(self, replicas: int) -> int:
        """Rotations under way at once: `max_surge` of `replicas`, rounded up, at least 1."""
        return max(1, _share(self.max_surge, replicas, math.ceil))

    def unavailable(self, replicas: int) -> int:
        """Members that may be short of serving while lifetime rotations start (rounded down)."""
        return _share(self.max_unavailable, replicas, math.floor)


def _share(budget: int | str, replicas: int, rounding: Any) -> int:
    if isinstance(budget, int):
        return budget
    return int(rounding(replicas * int(budget.removesuffix("%")) / 100))


class ScaleRequest(StrictInput):
    """A fixed pool's new size (`replicas`), or an autoscaled pool's new bounds."""

    replicas: Replicas | None = None
    min_replicas: Replicas | None = None
    max_replicas: Replicas | None = None

    @model_validator(mode="after")
    def _size_or_bounds(self) -> ScaleRequest:
        bounds = self.min_replicas is not None or self.max_replicas is not None
        if self.replicas is not None and bounds:
            raise ValueError(
                'give either "replicas" (a fixed pool) or "min_replicas"/"max_replicas" '
                "(an autoscaled pool), not both"
            )
        return self


class StatusRequest(StrictInput):
    """Which members a `status` answer lists: those after member index `after`, `limit` at most.

    The answer's `next_page` is this request for the page after it.
    """

    after: Annotated[int, Field(ge=-1)] = -1
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE


class RotateRequest(StrictInput):
    member: Annotated[str, Field(min_length=1, max_length=300)] | None = None
    all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> RotateRequest:
        if (self.member is None) == (not self.all):
            raise ValueError('give either "member": "<id>" or "all": true')
        return self


class BanRequest(StrictInput):
    member: Annotated[str, Field(min_length=1, max_length=300)]
    reason: Text = ""
    # The endpoint the ban was seen on: a member that has rotated since is
    # not banned again for its old instance's sins.
    endpoint: Annotated[str, Field(max_length=300)] | None = None


def pool_id_problems(pool_id: str) -> list[str]:
    if POOL_ID.match(pool_id):
        return []
    return [
        "workflow id: a pool's id must be 1-200 letters, digits, '.', '_', ':' or '-' "
        f"(starting with a letter or digit), got {pool_id!r}"
    ]
