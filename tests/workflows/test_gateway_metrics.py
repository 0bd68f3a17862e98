"""The gateway's metrics listener as anyone who reaches it sees it, and as a token holder does.

The gateway runs as users run it (its own process, real Squids, a pool of
the local provider whose members' exits are checked through the stack's
echo service): the listener that takes no token names no member and no
exit address, the control API's /metrics does; idle sockets cost it no
thread and are cut while /healthz still answers; a second gateway on its
address stops with a message naming the flag, not a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from cli import METRICS_HEAD_SECONDS, METRICS_MAX_PER_ADDRESS, METRICS_RENDER_THREADS
from tests.helpers.gateway import GatewayProcess, pool_gateway, through
from tests.helpers.network import closed_by_peer, free_port
from tests.helpers.stacks import Stack
from tests.helpers.tls_origin import ECHO_PATH
from tests.helpers.waiting import wait_for
from tests.workflows.test_gateway import USERNAME, running_pool

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MEMBER_EXIT = "proxy_operator_gateway_member_exit_info"
REQUESTS = "proxy_operator_gateway_requests_total"
# Idle clients from loopback addresses of their own (Linux routes all of
# 127.0.0.0/8 to lo): more sockets from each than the listener keeps from
# one address, fewer addresses than would fill its global bound.
IDLE_ADDRESSES = [f"127.0.0.{n}" for n in range(2, 32)]
IDLE_PER_ADDRESS = METRICS_MAX_PER_ADDRESS + 4
# A thread per connection would add one per held socket (240 here).
THREAD_SLACK = METRICS_RENDER_THREADS + 10


@pytest.fixture
async def gateway(temporal_env: WorkflowEnvironment, stack: Stack) -> AsyncIterator[GatewayProcess]:
    echo = f"{stack.origin.url.rstrip('/')}{ECHO_PATH}"
    async with (
        running_pool(stack, exit_echo_url=echo) as pool,
        pool_gateway(temporal_env, stack, pool.handle.id, api=True) as process,
    ):
        yield process


async def test_the_listener_without_a_token_names_no_member_and_no_exit(
    stack: Stack, gateway: GatewayProcess
) -> None:
    assert (await asyncio.to_thread(through, gateway, stack, USERNAME)).ok

    def carried(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
        return sum(v for (name, labels), v in samples.items() if name == REQUESTS)

    async def known() -> bool:
        samples = await asyncio.to_thread(gateway.member_metrics)
        return carried(samples) == 1 and any(name == MEMBER_EXIT for name, _ in samples)

    await wait_for(known, "the tunnel's member and the members' exits behind the token")
    private = await asyncio.to_thread(gateway.member_metrics)
    members = {dict(labels)["member"] for name, labels in private if name == MEMBER_EXIT}
    exits = {dict(labels)["exit_address"] for name, labels in private if name == MEMBER_EXIT}
    assert members and exits == {"127.0.0.1"}, private

    text = await asyncio.to_thread(gateway.metrics_text)
    public = await asyncio.to_thread(gateway.metrics)
    for secret in members | exits:
        assert secret not in text, secret
    assert not [name for name, labels in public if {"member", "exit_address"} & dict(labels).keys()]
    # The aggregates the alerts and the dashboard read are all there.
    assert carried(public) == 1
    assert public[("proxy_operator_gateway_members", ())] == len(members)
    assert public[("proxy_operator_gateway_distinct_exits", ())] == 1


def threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


@contextlib.contextmanager
def idle_sockets(port: int) -> Iterator[list[socket.socket]]:
    """Connections to 127.0.0.1:`port` that send nothing, from IDLE_ADDRESSES."""
    opened: list[socket.socket] = []
    try:
        for address in IDLE_ADDRESSES:
            for _ in range(IDLE_PER_ADDRESS):
                sock = socket.socket()
                opened.append(sock)
                sock.bind((address, 0))
                sock.connect(("127.0.0.1", port))
        yield opened
    finally:
        for sock in opened:
            sock.close()


def healthz(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
        return int(response.status)


async def test_idle_sockets_cost_no_thread_are_cut_and_leave_healthz_answering(
    gateway: GatewayProcess,
) -> None:
    assert gateway.process is not None
    pid, port = gateway.process.pid, gateway.metrics_port
    before = threads(pid)

    with idle_sockets(port) as sockets:
        held = threads(pid)
        assert await asyncio.to_thread(healthz, port) == 200
        assert held <= before + THREAD_SLACK, (before, held)
        await wait_for(
            lambda: all(closed_by_peer(s) for s in sockets),
            "every idle socket cut by the listener",
            deadline=METRICS_HEAD_SECONDS + 30,
        )
    assert await asyncio.to_thread(healthz, port) == 200


async def test_a_second_gateway_on_the_same_metrics_address_exits_2_naming_the_flag(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    args = list(gateway.args)
    args[args.index("--listen") + 1] = f"127.0.0.1:{free_port()}"
    args[args.index("--state-dir") + 1] = str(tmp_path / "state")
    second = await asyncio.to_thread(
        subprocess.run,
        args,
        cwd=ROOT,
        env=gateway.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert second.returncode == 2, second.stderr
    assert "--metrics-address (or PROXY_OPERATOR_GATEWAY_METRICS_ADDRESS)" in second.stderr
    assert f"127.0.0.1:{gateway.metrics_port} is in use" in second.stderr
    assert "Traceback" not in second.stderr
    assert await asyncio.to_thread(gateway.healthy)
