"""A forged endpoint in a pool's answer never reaches a gateway's parents.

The pool only lists endpoints from sources a namespace user cannot write;
this is the gateway's own wall behind that (gateway/member_networks.py).
Since a real pool must never answer with a forged endpoint, the pool here is
a workflow that answers `endpoints` with what the test gives it: two real
members (local Squids on 127.0.0.1) and two forged ones, one on 127.0.0.2
(outside the default member networks of the local provider, 127.0.0.1/32)
and one named `localhost` (which resolves inside them, but is a hostname).
Each forged endpoint has a listener that counts connections: the fleet's
credentials would arrive there with the first request routed to it.
"""

from __future__ import annotations

import asyncio
import collections
import socketserver
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import pytest
from temporalio import workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from providers.base import CreateRequest, Instance
from providers.naming import owner_tags
from tests.helpers.config import PASSWORD, USERNAME, local_entry, raw_config
from tests.helpers.gateway import GatewayProcess, through
from tests.helpers.stacks import Stack
from tests.helpers.state_dir import local_state_dir
from tests.helpers.tunnel import Answer
from tests.helpers.workers import running

pytestmark = pytest.mark.slow

REQUESTS = 60
FORGED_ADDRESS = "127.0.0.2"


@workflow.defn(name="ForgedEndpoints", sandboxed=False)
class ForgedEndpoints:
    """Answers `endpoints` with its input, as a pool whose answer was forged would."""

    @workflow.init
    def __init__(self, endpoints: list[dict[str, str]]) -> None:
        self._endpoints = endpoints

    @workflow.run
    async def run(self, endpoints: list[dict[str, str]]) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.query
    def endpoints(self) -> list[dict[str, str]]:
        return self._endpoints


class _Counting(socketserver.BaseRequestHandler):
    server: _Listener

    def handle(self) -> None:
        self.server.connections += 1


class _Listener(socketserver.ThreadingTCPServer):
    daemon_threads = True
    connections = 0


@contextmanager
def listener(host: str) -> Iterator[_Listener]:
    """A TCP listener on `host` that counts the connections it accepts."""
    with _Listener((host, 0), _Counting) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server
        finally:
            server.shutdown()


@pytest.fixture
async def members(stack: Stack) -> AsyncIterator[list[Instance]]:
    """Two real local Squids with the fleet's credentials, made by the provider directly."""
    made = []
    for generation in range(2):
        req = CreateRequest(
            name=f"member-{uuid.uuid4().hex[:8]}",
            proxy=stack.config.proxy_settings(),
            tags=owner_tags(stack.config.installation, "forged-pool", generation),
        )
        made.append(await asyncio.to_thread(stack.provider.create, req))
    yield made
    for instance in made:
        await asyncio.to_thread(stack.provider.delete, instance.provider_id)


async def test_a_gateway_never_sends_to_an_endpoint_outside_the_member_networks(
    temporal_env: WorkflowEnvironment, stack: Stack, members: list[Instance]
) -> None:
    real = [
        {"member": f"forged-pool/{i}", "endpoint": f"{m.ip}:{m.port}"}
        for i, m in enumerate(members)
    ]
    task_queue = f"forged-{uuid.uuid4().hex[:8]}"
    with (
        listener(FORGED_ADDRESS) as outside,
        listener("127.0.0.1") as named,
        local_state_dir("proxy-operator-gateway-test-") as directory,
    ):
        forged = [
            {
                "member": "forged-pool/2",
                "endpoint": f"{FORGED_ADDRESS}:{outside.server_address[1]}",
            },
            {"member": "forged-pool/3", "endpoint": f"localhost:{named.server_address[1]}"},
        ]
        async with running(
            Worker(temporal_env.client, task_queue=task_queue, workflows=[ForgedEndpoints])
        ):
            pool = await temporal_env.client.start_workflow(
                ForgedEndpoints.run,
                [*real, *forged],
                id=f"forged-pool-{uuid.uuid4().hex[:8]}",
                task_queue=task_queue,
            )
            gateway = GatewayProcess(
                pool=pool.id,
                raw_config=raw_config(
                    local_entry(stack.state_dir), connect_ports=[443, stack.origin.port]
                ),
                temporal_address=temporal_env.client.service_client.config.target_host,
                namespace=temporal_env.client.namespace,
                directory=directory,
            )
            try:
                await asyncio.to_thread(gateway.start)
                answers = await asyncio.to_thread(rotate_and_pin, gateway, stack)
                metrics = await asyncio.to_thread(gateway.metrics)
            finally:
                code = await asyncio.to_thread(gateway.stop)
                await pool.terminate()
            log = gateway.output.read_text(errors="replace")
            assert code == 0, log[-3000:]

        rotated, pinned = answers
        assert all(a.ok for a in rotated), collections.Counter(rotated)
        assert not any(a.ok for a in pinned), pinned
        assert (outside.connections, named.connections) == (0, 0)

    assert metrics[("proxy_operator_gateway_members", ())] == len(real)
    refused = "proxy_operator_gateway_refused_endpoints_total"
    assert metrics[(refused, (("reason", "network"),))] == 1
    assert metrics[(refused, (("reason", "hostname"),))] == 1
    assert f"refusing member 'forged-pool/2' at {forged[0]['endpoint']}" in log
    assert "refusing member 'forged-pool/3' at localhost" in log
    assert PASSWORD not in log


def rotate_and_pin(gateway: GatewayProcess, stack: Stack) -> tuple[list[Answer], list[Answer]]:
    """REQUESTS rotating requests, then one pinned to each forged member."""

    def answer(username: str) -> Answer:
        try:
            return through(gateway, stack, username)
        except OSError:  # reset, closed: what a forged parent that hangs up gives
            return Answer(0)

    rotated = [answer(USERNAME) for _ in range(REQUESTS)]
    pinned = [answer(f"{USERNAME}-proxy-forged-pool/{n}") for n in (2, 3)]
    return rotated, pinned
