"""The crawler's ban loop: from a ban reported through the gateway's API to a new exit.

    python -m bench.ban_loop [--replicas 3] [--rounds 3]

A ProxyPool of `--replicas` local members on a Temporal dev server, and
`proxy-operator-gateway` in front with its control API on (the test
settings: endpoints polled every 0.5 s, 0.5 s debounce). Each round opens a
session through the gateway, asks the API which member carried it, reports
that member banned by session key (`POST /v1/bans`), then sends the
session's requests back to back until one lands on another instance than
the banned one (an exit of another member, read from the members' own
access logs), and waits until the banned member serves again on a new
instance (its replacement in the pool's `endpoints`). Prints both times per
round, from the moment the API answered 202.

Asserts nothing: the figures feed docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import secrets
import time
import uuid
from pathlib import Path

from temporalio.client import Client

from bench.local_worker import local_worker
from bench.stats import percentile
from tests.helpers.api import call
from tests.helpers.config import PASSWORD, USERNAME, build_config, local_entry, raw_config
from tests.helpers.gateway import GatewayProcess
from tests.helpers.network import free_port
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin
from tests.helpers.tunnel import request

DEADLINE = 180.0


def tunnels(state_dir: Path, origin: TlsOrigin) -> collections.Counter[str]:
    """Tunnels to `origin` each instance carried, from its own access log."""
    counts: collections.Counter[str] = collections.Counter()
    target = f" {origin.host}:{origin.port} "
    for log in state_dir.glob("*/access.log"):
        lines = log.read_text(errors="replace").splitlines()
        counts[log.parent.name] = sum(1 for x in lines if "TCP_TUNNEL/200" in x and target in x)
    return counts


def carrier(gateway: GatewayProcess, origin: TlsOrigin, username: str, state_dir: Path) -> str:
    """One request of `username` through the gateway: the instance that carried it.

    `origin` is the crawl's own, not the one the members' health probes use,
    so a replacement's first probe is not taken for the session's tunnel.
    """
    before = tunnels(state_dir, origin)
    target = (origin.host, origin.port)
    reply = request(
        ("127.0.0.1", gateway.port), username, PASSWORD, target, origin.client_ssl_context
    )
    if not reply.ok:
        raise RuntimeError(f"{username}: {reply}")
    grew = [i for i, n in tunnels(state_dir, origin).items() if n > before.get(i, 0)]
    if len(grew) != 1:
        raise RuntimeError(f"{username}: carried by {grew}")
    return grew[0]


async def run(args: argparse.Namespace, origin: TlsOrigin, crawled: TlsOrigin) -> None:
    env = await start_dev_server()
    try:
        with (
            local_state_dir("proxy-operator-bench-") as state_dir,
            local_state_dir("proxy-operator-bench-gateway-") as gateway_dir,
        ):
            await _rounds(args, env.client, state_dir, gateway_dir, origin, crawled)
    finally:
        await env.shutdown()


async def _rounds(
    args: argparse.Namespace,
    client: Client,
    state_dir: Path,
    gateway_dir: Path,
    origin: TlsOrigin,
    crawled: TlsOrigin,
) -> None:
    ports = [443, origin.port, crawled.port]
    config = build_config(local_entry(state_dir), connect_ports=ports, password=PASSWORD)
    async with local_worker(client, config, origin) as task_queue:
        moved, replaced = await _ban_rounds(
            args, client, task_queue, ports, state_dir, gateway_dir, origin, crawled
        )
    print(f"\nBan through the API -> the session on another exit ({args.rounds} rounds)")
    print(f"median {percentile(moved, 50):.2f} s, max {max(moved):.2f} s")
    print("Ban through the API -> the banned member serving on a new instance")
    print(f"median {percentile(replaced, 50):.2f} s, max {max(replaced):.2f} s")


async def _ban_rounds(
    args: argparse.Namespace,
    client: Client,
    task_queue: str,
    ports: list[int],
    state_dir: Path,
    gateway_dir: Path,
    origin: TlsOrigin,
    crawled: TlsOrigin,
) -> tuple[list[float], list[float]]:
    template = {
        "provider": "local",
        "health": {"target": origin.url, "interval_seconds": 3600, "failure_threshold": 3},
        "drain_seconds": 5,
    }
    pool = await client.start_workflow(
        "ProxyPool",
        {
            "replicas": args.replicas,
            "template": template,
            "bans": {"max": args.rounds, "window_seconds": 3600},
        },
        id=f"bench-pool-{uuid.uuid4().hex[:6]}",
        task_queue=task_queue,
    )

    async def endpoints() -> dict[str, str]:
        return {e["member"]: e["endpoint"] for e in await pool.query("endpoints")}

    token = secrets.token_urlsafe(24)
    (gateway_dir / "tokens").write_text(f"{token}\n")
    api_port = free_port()
    gateway = GatewayProcess(
        pool=pool.id,
        raw_config=raw_config(local_entry(state_dir), connect_ports=ports),
        temporal_address=client.service_client.config.target_host,
        namespace=client.namespace,
        directory=gateway_dir,
        extra_args=(
            *("--api-listen", f"127.0.0.1:{api_port}"),
            *("--api-tokens-file", str(gateway_dir / "tokens")),
        ),
    )
    moved: list[float] = []
    replaced: list[float] = []
    try:
        while len(await endpoints()) < args.replicas:
            await asyncio.sleep(0.5)
        await asyncio.to_thread(gateway.start)
        for n in range(args.rounds):
            key = f"round-{n}"
            username = f"{USERNAME}-session-{key}"
            old = await asyncio.to_thread(carrier, gateway, crawled, username, state_dir)
            before = await endpoints()
            reply = await asyncio.to_thread(
                call, api_port, "POST", "/v1/bans", token=token, body={"session": key}
            )
            banned_at = time.monotonic()
            if reply.status != 202:
                raise RuntimeError(f"ban: {reply.status} {reply.body!r}")
            member = reply.json()["member"]
            while await asyncio.to_thread(carrier, gateway, crawled, username, state_dir) == old:
                if time.monotonic() - banned_at > DEADLINE:
                    raise RuntimeError("the session never left the banned exit")
            moved.append(time.monotonic() - banned_at)
            while True:
                now = await endpoints()
                if now.get(member) not in (None, before[member]) and len(now) == args.replicas:
                    break
                if time.monotonic() - banned_at > DEADLINE:
                    raise RuntimeError(f"{member} never came back on a new instance")
                await asyncio.sleep(0.1)
            replaced.append(time.monotonic() - banned_at)
            print(
                f"round {n}: {member} banned; the session on another exit after "
                f"{moved[-1]:.2f} s, the member on a new instance after {replaced[-1]:.2f} s"
            )
    finally:
        gateway.stop()
        await pool.signal("terminate")
    return moved, replaced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with serve_tls_origin() as origin, serve_tls_origin() as crawled:
        asyncio.run(run(args, origin, crawled))


if __name__ == "__main__":
    main()
