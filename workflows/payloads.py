"""The worker's payload converter: arguments no workflow can decode fail it, not its task.

The SDK decodes a workflow's start arguments before any workflow code runs. A
payload it cannot decode (JSON nested deeper than Python's recursion limit, an
integer of more than 4300 digits, an encoding nobody knows) fails the workflow
task instead, and Temporal retries a failed task forever: a wedged workflow
that only `temporal workflow terminate` ends. Both run methods take untyped
arguments and validate them themselves (workflows/inputs.py), so an untyped
decode is where hostile input arrives; this converter turns its failure into
an InvalidInput error, which fails the workflow at once with the reason.
Typed decodes (activity results, our own data) keep the SDK's behaviour, so a
real bug still holds the task for a fix instead of failing the workflow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.converter import DefaultPayloadConverter
from temporalio.exceptions import ApplicationError

from contract import ErrorType


class InputPayloadConverter(DefaultPayloadConverter):
    """The default converter, except that an untyped payload it cannot decode is bad input."""

    def from_payloads(
        self, payloads: Sequence[Payload], type_hints: list[type] | None = None
    ) -> list[Any]:
        if type_hints is not None:
            return super().from_payloads(payloads, type_hints)
        values: list[Any] = []
        for index, payload in enumerate(payloads, start=1):
            try:
                values += super().from_payloads([payload])
            except Exception as err:
                encoding = payload.metadata.get("encoding", b"").decode(errors="replace")
                cause = err.__cause__ or err
                raise ApplicationError(
                    f"invalid input: argument {index}: cannot be decoded "
                    f"({encoding or 'no encoding'}): {type(cause).__name__}: {str(cause)[:200]}",
                    type=ErrorType.INVALID_INPUT,
                    non_retryable=True,
                ) from None
        return values


def with_input_payload_converter(client: Client) -> Client:
    """The same connection and namespace, decoding payloads with InputPayloadConverter."""
    config = client.config()
    config["data_converter"] = dataclasses.replace(
        config["data_converter"], payload_converter_class=InputPayloadConverter
    )
    return Client(**config)
