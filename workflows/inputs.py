"""ProxyLifecycle's input, validated inside the workflow.

The run method takes raw JSON and validates it here: a typed argument that
failed to decode would make the SDK retry the workflow task forever, while a
validation error fails the workflow at once, naming every bad field.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_HEALTH_TARGET = "https://example.com"
LABEL_KEY = r"^[a-z][a-z0-9_-]{0,62}$"
LABEL_VALUE = r"^[a-z0-9_-]{0,63}$"


class StrictInput(BaseModel):
    """Workflow input: no coercion, no unknown keys, immutable."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class HealthInput(StrictInput):
    target: str = DEFAULT_HEALTH_TARGET
    interval_seconds: Annotated[float, Field(ge=1, le=3600)] = 10
    failure_threshold: Annotated[int, Field(ge=1, le=100)] = 3
    timeout_seconds: Annotated[float, Field(ge=0.5, le=60)] = 5

    @field_validator("target")
    @classmethod
    def _https_url(cls, target: str) -> str:
        parts = urlsplit(target)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError("must be an https:// URL with a host")
        try:
            _ = parts.port
        except ValueError:
            raise ValueError("has an invalid port") from None
        return target


class PlacementInput(StrictInput):
    zone: Annotated[str, Field(pattern=r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")] | None = None
    namespace: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")] | None = None

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ProxyInput(StrictInput):
    """What a user passes to `temporal workflow start --input`."""

    provider: Annotated[str, Field(min_length=1, max_length=63)]
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    labels: dict[
        Annotated[str, Field(pattern=LABEL_KEY)], Annotated[str, Field(pattern=LABEL_VALUE)]
    ] = {}
    health: HealthInput = HealthInput()
    max_lifetime_seconds: Annotated[int, Field(ge=10)] | None = None
    placement: PlacementInput = PlacementInput()


def parse_input(raw: Any) -> tuple[ProxyInput | None, list[str]]:
    """The validated input, or every problem as `field: message`."""
    if not isinstance(raw, dict):
        got = "nothing" if raw is None else type(raw).__name__
        return None, [f"input: expected a JSON object with at least 'provider', got {got}"]
    try:
        return ProxyInput.model_validate(raw), []
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
