"""A wake holder's loopback port, reached directly: nothing wakes without the fleet's credentials.

A gateway over an autoscaled pool at zero listens on loopback for its
router's CONNECTs to the pool's stand-in (gateway/wake.py). Any process on
the gateway's host can find that port and connect to it; what it sends
there must cost the fleet nothing (docs/security.md), as at the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.helpers.config import PASSWORD, USERNAME
from tests.helpers.gateway import GatewayProcess
from tests.helpers.network import closed_by_peer, read_head
from tests.helpers.procfs import listening_ports
from tests.helpers.stacks import Stack
from tests.helpers.tunnel import connect_request
from tests.helpers.waiting import wait_for
from tests.workflows.test_pool_autoscale_e2e import (
    DEADLINE,
    gateway_for,
    request_through,
    start_pool,
)

pytestmark = pytest.mark.slow

# Far below the wake timeout the gateway runs with: a holder that held the
# CONNECT (and woke the pool) would not have answered by then.
PROMPT = 15.0
WAKE_TIMEOUT = 180
REFUSED = ("proxy_operator_gateway_held_connects_total", (("outcome", "refused"),))
SERVED = ("proxy_operator_gateway_held_connects_total", (("outcome", "served"),))


def holder_ports(gateway: GatewayProcess) -> set[int]:
    """The gateway process's listening ports but its front and metrics: as an attacker on
    the host finds them, with /proc."""
    assert gateway.process is not None
    return listening_ports(gateway.process.pid) - {gateway.port, gateway.metrics_port}


def answer(port: int, request: bytes) -> tuple[bytes, bool]:
    """(the answer head to `request` sent to `port`, whether the port then closed the socket),
    each waited for up to PROMPT seconds: past that, no head, or not closed."""
    head, closed = b"", False
    with socket.create_connection(("127.0.0.1", port), timeout=PROMPT) as sock:
        sock.sendall(request)
        with contextlib.suppress(TimeoutError):
            head = read_head(sock)
            closed = sock.recv(1) == b""
    return head, closed


async def test_a_connect_to_a_holder_without_the_fleet_credentials_gets_407_and_wakes_nothing(
    temporal_env: WorkflowEnvironment, stack: Stack
) -> None:
    handle = await start_pool(stack, 0, max_replicas=1, scale_down_after_seconds=3600)
    flags = ["--wake-timeout", str(WAKE_TIMEOUT)]
    async with gateway_for(temporal_env, stack, handle.id, flags) as gateway:
        ports = holder_ports(gateway)
        assert len(ports) == 1, ports  # one autoscaled pool: one holder
        origin = (stack.origin.host, stack.origin.port)
        target = f"{origin[0]}:{origin[1]}"
        sent = [
            f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode(),
            connect_request(USERNAME, "not-the-password", origin),
            # The router takes every username form of the fleet's user; a holder,
            # only the fleet's credentials as the router sends them on.
            connect_request(f"{USERNAME}-session-cart42", PASSWORD, origin),
        ]
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for port in ports]
        try:
            answers = [
                await asyncio.to_thread(answer, port, request) for port in ports for request in sent
            ]
            status = await handle.query("status")
            assert "woken by" not in (status["scaling"]["last_decision"] or ""), status["scaling"]
            assert status["replicas"] == 0, status["scaling"]
            assert not stack.instances()
            for request, (head, closed) in zip(sent * len(ports), answers, strict=True):
                assert head.startswith(b"HTTP/1.1 407 "), (request, head)
                assert b'Proxy-Authenticate: Basic realm="proxy-operator"' in head, head
                assert closed, "the holder keeps a refused socket open"
            assert gateway.metrics()[REFUSED] == len(answers)
            # A socket that sends nothing is cut too, within seconds.
            await wait_for(
                lambda: all(closed_by_peer(sock) for sock in silent),
                "the holder cutting a silent socket",
                deadline=PROMPT + 10,
            )
        finally:
            for sock in silent:
                sock.close()
        assert (await handle.query("status"))["replicas"] == 0
        # A client with credentials, at the front, still wakes the pool and is tunnelled.
        head, served = await asyncio.to_thread(request_through, gateway, stack, WAKE_TIMEOUT + 30)
        assert head.startswith(b"HTTP/1.1 200") and served, head
        status = await handle.query("status")
        assert status["scaling"]["last_decision"].startswith("woken by gateway gw-test")
        assert gateway.metrics()[SERVED] == 1
    await handle.signal("terminate")
    await wait_for(lambda: not stack.instances(), "every member's Squid gone", deadline=DEADLINE)
