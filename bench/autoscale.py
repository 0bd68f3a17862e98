"""Autoscaling on the local provider: waking a pool at zero, and a load step's scaling trace.

    python -m bench.autoscale [--wakes 3] [--tunnels 12] [--target 4] [--hold 60] [--after 120]

An autoscaled ProxyPool of local members (real Squids) on a Temporal dev
server, `proxy-operator-gateway` in front reporting every 5 s.

1. Wake: with the pool at zero, one HTTPS request through the gateway
   (CONNECT, TLS, GET). Prints the time from sending the CONNECT to the
   CONNECT's 200 and to the first byte of the origin's answer, `--wakes`
   times (the pool goes back to zero between them, `scale_down_after_seconds`
   5).
2. Load step: `--tunnels` tunnels opened at once and held `--hold` seconds,
   `target_tunnels_per_member` `--target`, `scale_up_after_seconds` 5,
   `scale_down_after_seconds` 10. Prints the pool's size, serving members
   and reported demand, sampled every second, as a text table of the
   moments anything changed (the trace docs/benchmarks.md shows).

Asserts nothing: the figures feed docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
import uuid
from typing import Any

from temporalio.client import WorkflowHandle

from bench.local_pool import local_stack
from bench.stats import percentile
from tests.helpers.config import PASSWORD, USERNAME
from tests.helpers.network import read_head
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin
from tests.helpers.tunnel import HeldTunnels, connect_request

WAKE_TIMEOUT = 120
SAMPLE_SECONDS = 1.0


def first_byte(port: int, origin: TlsOrigin) -> tuple[float, float]:
    """Seconds from sending a CONNECT to its 200, and to the origin's first byte through it."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=WAKE_TIMEOUT + 30) as sock:
        sock.sendall(connect_request(USERNAME, PASSWORD, (origin.host, origin.port)))
        head = read_head(sock)
        connected = time.monotonic() - start
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"CONNECT answered {head[:80]!r}")
        with origin.client_ssl_context.wrap_socket(sock, server_hostname=origin.host) as tls:
            tls.sendall(f"GET / HTTP/1.1\r\nHost: {origin.host}\r\n\r\n".encode())
            tls.recv(1)
            return connected, time.monotonic() - start


async def status(pool: WorkflowHandle[Any, Any]) -> dict[str, Any]:
    result: dict[str, Any] = await pool.query("status")
    return result


async def until_zero(pool: WorkflowHandle[Any, Any]) -> None:
    while True:
        found = await status(pool)
        if found["replicas"] == 0 and not found["members"]:
            return
        await asyncio.sleep(SAMPLE_SECONDS)


async def wakes(
    args: argparse.Namespace, pool: WorkflowHandle[Any, Any], port: int, origin: TlsOrigin
) -> None:
    connects, bytes_ = [], []
    for _ in range(args.wakes):
        await until_zero(pool)
        connected, first = await asyncio.to_thread(first_byte, port, origin)
        connects.append(connected)
        bytes_.append(first)
    print(f"\nWake from zero, {args.wakes} times (local provider, one member started per wake)")
    print(f"{'':<28} {'p50 s':>8} {'max s':>8}")
    for name, values in (("CONNECT to 200", connects), ("CONNECT to first byte", bytes_)):
        print(f"{name:<28} {percentile(values, 50):>8.2f} {max(values):>8.2f}")


async def load_step(
    args: argparse.Namespace, pool: WorkflowHandle[Any, Any], port: int, origin: TlsOrigin
) -> None:
    await until_zero(pool)
    start = time.monotonic()
    trace: list[tuple[float, int, int, int, str]] = []

    async def sample(until: float) -> None:
        while time.monotonic() < until:
            found = await status(pool)
            scaling = found["scaling"]
            row = (found["replicas"], found["ready"], scaling["open_tunnels"])
            if not trace or trace[-1][1:4] != row:
                trace.append((time.monotonic() - start, *row, scaling["why"][:100]))
            await asyncio.sleep(SAMPLE_SECONDS)

    held = HeldTunnels(
        ("127.0.0.1", port),
        (origin.host, origin.port),
        origin.client_ssl_context,
        (USERNAME, PASSWORD),
        timeout=WAKE_TIMEOUT + 30,
    )
    await asyncio.to_thread(held.open, args.tunnels)
    opened = time.monotonic() - start
    await sample(time.monotonic() + args.hold)
    await asyncio.to_thread(held.close)
    closed = time.monotonic() - start
    await sample(time.monotonic() + args.after)
    print(
        f"\nLoad step: {args.tunnels} tunnels (target {args.target} per member) opened at 0 s "
        f"(all open at {opened:.1f} s), closed at {closed:.1f} s"
    )
    print(f"{'t s':>6} {'size':>5} {'serving':>8} {'demand':>7}  why")
    for at, replicas, ready, demand, why in trace:
        print(f"{at:>6.1f} {replicas:>5} {ready:>8} {demand:>7}  {why}")


async def run(args: argparse.Namespace, origin: TlsOrigin) -> None:
    async with local_stack(origin) as stack:
        template = {
            "provider": "local",
            "health": {"target": origin.url, "interval_seconds": 10, "failure_threshold": 3},
            "drain_seconds": 2,
        }
        pool = await stack.client.start_workflow(
            "ProxyPool",
            {
                "replicas": 0,
                "template": template,
                "autoscale": {
                    "max_replicas": args.tunnels,
                    "target_tunnels_per_member": args.target,
                    "scale_up_after_seconds": 5,
                    "scale_down_after_seconds": 10,
                },
            },
            id=f"bench-autoscale-{uuid.uuid4().hex[:6]}",
            task_queue=stack.task_queue,
        )
        gateway = stack.gateway(
            pool.id, ["--report-interval", "5", "--wake-timeout", str(WAKE_TIMEOUT)]
        )
        try:
            await asyncio.to_thread(gateway.start)
            if args.wakes:
                await wakes(args, pool, gateway.port, origin)
            if args.tunnels:
                await load_step(args, pool, gateway.port, origin)
        finally:
            gateway.stop()
            await pool.signal("terminate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wakes", type=int, default=3)
    parser.add_argument("--tunnels", type=int, default=12)
    parser.add_argument("--target", type=int, default=4)
    parser.add_argument("--hold", type=float, default=60.0)
    parser.add_argument("--after", type=float, default=120.0)
    args = parser.parse_args()
    with serve_tls_origin() as origin:
        asyncio.run(run(args, origin))


if __name__ == "__main__":
    main()
