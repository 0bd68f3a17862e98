"""Registering the search attributes our workflows upsert, at worker start.

Workflows upsert ProxyState, ProxyProvider, ProxyEndpoint and ProxyInstances; if the namespace
does not know them, every workflow task would fail. So the worker checks at
start, registers them where it may (dev server, self-hosted), and otherwise
says exactly what an operator has to run.
"""

from __future__ import annotations

import logging

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client
from temporalio.common import SearchAttributeIndexedValueType
from temporalio.service import RPCError, RPCStatusCode

from contract import SEARCH_ATTRIBUTES

log = logging.getLogger(__name__)


# What `temporal operator search-attribute create --type` calls each type.
CLI_TYPES = {
    SearchAttributeIndexedValueType.KEYWORD: "Keyword",
    SearchAttributeIndexedValueType.KEYWORD_LIST: "KeywordList",
}


class SearchAttributesMissing(RuntimeError):
    pass


async def ensure_search_attributes(client: Client) -> None:
    """Register the search attributes our workflows upsert, if missing."""
    namespace = client.namespace
    try:
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace)
        )
        known = set(listed.custom_attributes) | set(listed.system_attributes)
    except RPCError as err:
        # Some servers (the time-skipping test server) cannot list; try to add.
        if err.status != RPCStatusCode.UNIMPLEMENTED:
            raise
        known = set()
    missing = [key.name for key in SEARCH_ATTRIBUTES if key.name not in known]
    if not missing:
        return
    try:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=namespace,
                search_attributes={
                    key.name: IndexedValueType.ValueType(key.indexed_value_type)
                    for key in SEARCH_ATTRIBUTES
                    if key.name in missing
                },
            )
        )
    except RPCError as err:
        if err.status == RPCStatusCode.ALREADY_EXISTS:
            return
        commands = "\n".join(
            f"  temporal operator search-attribute create --namespace {namespace} "
            f"--name {key.name} --type {CLI_TYPES[key.indexed_value_type]}"
            for key in SEARCH_ATTRIBUTES
            if key.name in missing
        )
        raise SearchAttributesMissing(
            f"search attributes {', '.join(missing)} are not registered in namespace "
            f"{namespace!r} and this worker may not register them ({err.message}). "
            f"Register them once:\n{commands}"
        ) from err
    log.info("registered search attributes %s in namespace %s", ", ".join(missing), namespace)
