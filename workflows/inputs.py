"""Workflow inputs and continue-as-new arguments, validated inside the workflow.

Run methods take raw JSON and validate it here: a typed argument that failed
to decode would make the SDK retry the workflow task forever, while a
validation error fails the workflow at once, naming every bad field. Every
number is bounded, so no input can overflow a timer or a timedelta later,
after an instance exists (docs/security.md, "No input wedges a workflow").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from temporalio import workflow
from temporalio.converter import value_to_type

DEFAULT_HEALTH_TARGET = "https://example.com"
LABEL_KEY = r"^[a-z][a-z0-9_-]{0,62}$"
LABEL_VALUE = r"^[a-z0-9_-]{0,63}$"
# A year: rotating less often than that is not rotating; any longer and a
# timer would come close to what timedelta and Temporal can hold.
MAX_LIFETIME_SECONDS = 366 * 24 * 3600
# GCP allows 64 labels per instance, and the operator's own tags take some.
MAX_LABELS = 32
MAX_URL_LENGTH = 2048

T = TypeVar("T")

# Floats: finite only (JSON from the Python SDK may carry NaN and Infinity).
Seconds = Annotated[float, Field(allow_inf_nan=False)]


class StrictInput(BaseModel):
    """Workflow input: no coercion, no unknown keys, immutable."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def _https_url(target: str) -> str:
    parts = urlsplit(target)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError("must be an https:// URL with a host")
    try:
        _ = parts.port
    except ValueError:
        raise ValueError("has an invalid port") from None
    return target


# Where a probe or an exit check goes through a proxy: always a CONNECT tunnel.
HttpsUrl = Annotated[str, Field(max_length=MAX_URL_LENGTH), AfterValidator(_https_url)]


# The shortest monitor heartbeat timeout a proxy may choose: a heartbeat is
# sent well within it (activities/provider.py), and each is a billed action.
MIN_HEARTBEAT_TIMEOUT_SECONDS = 30


class HealthInput(StrictInput):
    target: HttpsUrl = DEFAULT_HEALTH_TARGET
    interval_seconds: Annotated[Seconds, Field(ge=1, le=3600)] = 10
    failure_threshold: Annotated[int, Field(ge=1, le=100)] = 3
    timeout_seconds: Annotated[Seconds, Field(ge=0.5, le=60)] = 5
    # How long a lost worker can leave the proxy unmonitored: the server
    # hands the monitor to another worker only when a heartbeat is this
    # late, and every heartbeat is a billed action (docs/cost.md). None: the
    # defaults in workflows/policies.py (a proxy's own monitor, a pool's).
    heartbeat_timeout_seconds: (
        Annotated[int, Field(ge=MIN_HEARTBEAT_TIMEOUT_SECONDS, le=600)] | None
    ) = None


class PlacementInput(StrictInput):
    """Where an instance goes; the worker checks which keys its provider takes."""

    zone: Annotated[str, Field(pattern=r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")] | None = None
    namespace: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")] | None = None
    # An EC2 subnet id (the format providers/aws/settings.py checks the config's by).
    subnet: Annotated[str, Field(pattern=r"^subnet-[0-9a-f]{8}([0-9a-f]{9})?$")] | None = None

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


MAX_DRAIN_SECONDS = 3600


class ProxyInput(StrictInput):
    """What a user passes to `temporal workflow start --input`."""

    provider: Annotated[str, Field(min_length=1, max_length=63)]
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    labels: Annotated[
        dict[Annotated[str, Field(pattern=LABEL_KEY)], Annotated[str, Field(pattern=LABEL_VALUE)]],
        Field(max_length=MAX_LABELS),
    ] = {}
    health: HealthInput = HealthInput()
    max_lifetime_seconds: Annotated[int, Field(ge=10, le=MAX_LIFETIME_SECONDS)] | None = None
    placement: PlacementInput = PlacementInput()
    # After a rotation, the old instance keeps serving this long before it is
    # deleted, so gateways (which follow a pool's endpoints) stop using it
    # first. None: 0 for a proxy of its own, DEFAULT_MEMBER_DRAIN_SECONDS
    # for a pool member (workflows/pool.py).
    drain_seconds: Annotated[int, Field(ge=0, le=MAX_DRAIN_SECONDS)] | None = None
    # Who probes the instance while it is Ready: "own", a monitor activity of
    # this proxy's; "pool", the monitor its pool runs over all its members,
    # which signals `instance_failing` and which this proxy confirms with a
    # probe of its own. Only a child workflow may take "pool".
    monitor: Literal["own", "pool"] = "own"


def parse_input(raw: Any) -> tuple[ProxyInput | None, list[str]]:
    """The validated input, or every problem as `field: message`."""
    return parse_model(ProxyInput, raw, "with at least 'provider'")


Model = TypeVar("Model", bound=StrictInput)


def parse_model(model: type[Model], raw: Any, what: str) -> tuple[Model | None, list[str]]:
    """`raw` validated as `model`, or every problem as `field: message`.

    `what` completes "expected a JSON object ..." for input that is no object.
    """
    if not isinstance(raw, dict):
        got = "nothing" if raw is None else type(raw).__name__
        return None, [f"input: expected a JSON object {what}, got {got}"]
    try:
        return model.model_validate(raw), []
    except ValidationError as exc:
        return None, [describe_error(err) for err in exc.errors()]


def describe_error(err: Any) -> str:
    """One pydantic error as `field.path: message`, the way every input error reads."""
    path = ".".join(str(part) for part in err["loc"]) or "input"
    if err["type"] == "missing":
        return f"{path}: field required"
    if err["type"] == "extra_forbidden":
        return f"{path}: unknown field"
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"{path}: {message[:1].lower()}{message[1:]}"


def continued_state(
    state_type: type[T],
    carried: Any,
    extra: tuple[Any, ...],
    decode: Callable[[Any], T] | None = None,
) -> tuple[T | None, list[str]]:
    """The state a previous run of this workflow handed over, or why it is refused.

    Only a run this workflow's own continue-as-new started may carry state:
    anyone who can start a workflow could otherwise hand it instances to
    probe with the fleet's credentials or to delete. Cron runs and retries
    start again from the first run's arguments, which a starter chose, so
    they are refused too. Any argument after the second is refused as well.
    `decode` reads a state of its own encoding (default: `state_type` as JSON).
    """
    problems = [f"argument {i}: unexpected extra argument" for i, _ in enumerate(extra, start=3)]
    if carried is None:
        return None, problems
    info = workflow.info()
    if info.continued_run_id is None or info.attempt > 1 or info.cron_schedule:
        refused = (
            "argument 2: carried state is accepted only from this workflow's own "
            "continue-as-new; start it with one argument, the input object"
        )
        return None, [refused, *problems]
    try:
        state: T = (decode or (lambda raw: value_to_type(state_type, raw)))(carried)
    except Exception as err:  # any shape the converter cannot take is bad input
        return None, [f"argument 2: not a {state_type.__name__}: {err}", *problems]
    return state, problems


# The longest reason a `terminate` or `rotate` signal may leave in a
# workflow's state (it is carried across continue-as-new and shown in status).
MAX_REASON = 500


def signal_reason(request: Any, default: str) -> str:
    """A signal's reason, sent as `{"reason": "..."}` or as a bare string; capped.

    Signals take any input (a namespace user's `temporal workflow signal
    --input` included): whatever it is, this returns a bounded string.
    """
    reason = request.get("reason") if isinstance(request, dict) else request
    return str(reason)[:MAX_REASON] if reason else default
