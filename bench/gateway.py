"""The gateway: CONNECT throughput and latency against one member, and requests lost in reloads.

    python -m bench.gateway [--clients 4] [--seconds 10] [--rounds 2] [--rate 100]
                            [--reloads 30] [--replicas 10] [--skip-throughput] [--skip-rotation]

1. Throughput: the same closed-loop load (`--clients` threads, each making
   one HTTPS request after another: CONNECT, TLS handshake, GET) sent
   through the gateway's Squid over three local members, and straight to
   one member, alternating `--rounds` times in one run so both see the same
   machine; then the same at an offered `--rate` below saturation. Prints
   requests/s and p50/p99 latency of each and their ratios, and the CPU
   each request cost each process (the gateway's workers, the members, and
   this process: the clients and the TLS origin), which is what a saturated
   ratio comes to on a machine whose cores the load itself fills.
2. Reloads: the same closed loop through the gateway while its membership
   flips between 3 and 4 local members `--reloads` times, a second apart
   (each change reloads both back workers). Prints requests made and lost.
3. Rotation: a ProxyPool of `--replicas` local members on a Temporal dev
   server, `proxy-operator-gateway` in front, the same clients running while
   `rotate {"all": true}` replaces every member. Prints requests made, lost
   (any answer but 200 from origin through the tunnel, or a socket error),
   and how long the rotation took.

Asserts nothing: the figures feed docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from temporalio.client import Client

from bench.local_worker import local_worker
from bench.stats import percentile
from gateway.squid import GatewaySquid
from providers.base import CreateRequest
from providers.config import Config
from providers.local import METADATA_FILE, LocalProvider
from providers.naming import owner_tags
from providers.squid import GatewayMember
from tests.helpers.config import PASSWORD, USERNAME, local_entry, proxy_config, raw_config
from tests.helpers.gateway import GatewayProcess
from tests.helpers.network import free_port
from tests.helpers.procfs import cpu_seconds
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin
from tests.helpers.tunnel import request

Target = tuple[str, int]
RELOAD_GAP = 1.0


class Load:
    """`clients` threads sending requests through `proxy` until stopped."""

    def __init__(
        self,
        proxy: Callable[[], Target],
        origin: TlsOrigin,
        clients: int,
        rate: float | None = None,
    ) -> None:
        # With `rate` (requests/s in all), each client paces itself: an open
        # load below saturation; without, each sends as fast as it can.
        self._interval = clients / rate if rate else 0.0
        self.latencies: list[float] = []
        self.outcomes: collections.Counter[str] = collections.Counter()
        self._proxy, self._origin = proxy, origin
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def _run(self) -> None:
        target = (self._origin.host, self._origin.port)
        due = time.monotonic()
        while not self._stop.is_set():
            if self._interval:
                due += self._interval
                if (wait := due - time.monotonic()) > 0:
                    self._stop.wait(wait)
            start = time.monotonic()
            try:
                answer = request(
                    self._proxy(), USERNAME, PASSWORD, target, self._origin.client_ssl_context
                )
                outcome = "ok" if answer.ok else f"status {answer.connect_status}"
            except OSError as err:
                outcome = type(err).__name__
            with self._lock:
                self.outcomes[outcome] += 1
                if outcome == "ok":
                    self.latencies.append(time.monotonic() - start)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def throughput(args: argparse.Namespace, origin: TlsOrigin) -> None:
    """Closed loop (as fast as the clients go), then an open load at `--rate`."""
    for rate in (None, args.rate):
        _throughput(args, origin, rate)


def local_members(config: Config, count: int) -> list[GatewayMember]:
    """`count` local Squids standing in for a pool's members, `bench/<n>`."""
    provider = LocalProvider.from_config(config.providers[0], config)
    members = []
    for n in range(count):
        instance = provider.create(
            CreateRequest(
                name=f"bench-member-{n}",
                proxy=config.proxy_settings(),
                tags=owner_tags(config.installation, f"bench/{n}", 0),
            )
        )
        members.append(GatewayMember(f"bench/{n}", instance.ip, instance.port))
    return members


def reloads(args: argparse.Namespace, origin: TlsOrigin) -> None:
    """The closed-loop clients through the gateway while its membership flips 3 <-> 4."""
    with local_state_dir("proxy-operator-bench-") as state_dir:
        config = proxy_config(origin.port, local_entry(state_dir))
        members = local_members(config, 4)
        gateway = GatewaySquid(
            config.proxy_settings(), state_dir / ".gateway", ("127.0.0.1", free_port())
        )
        gateway.start(members[:3])
        try:
            took = []
            with Load(lambda: ("127.0.0.1", gateway.front.port), origin, args.clients) as load:
                for flip in range(args.reloads):
                    time.sleep(RELOAD_GAP)
                    start = time.monotonic()
                    gateway.apply(members if flip % 2 == 0 else members[:3])
                    took.append(time.monotonic() - start)
                time.sleep(RELOAD_GAP)
        finally:
            gateway.stop()
        # What the members answered other than a tunnel: a 400 is a client's
        # TLS handshake a reloading back sent a member as if it were the
        # origin (docs/architecture.md, "What a reload can still lose").
        answered = collections.Counter(
            line.split()[3]
            for n in range(len(members))
            for line in (state_dir / f"bench-member-{n}" / "access.log").read_text().splitlines()
            if "TCP_TUNNEL/200" not in line
        )
    made = sum(load.outcomes.values())
    print(f"\n{args.reloads} membership changes (3 <-> 4 members, each back worker reloaded)")
    print(f"requests made {made}, lost {made - load.outcomes['ok']} ({dict(load.outcomes)})")
    print(f"members' answers other than a tunnel: {dict(answered) or 'none'}")
    print(
        f"a change took p50 {percentile(took, 50):.2f} s, max {max(took):.2f} s; "
        f"latency p50 {percentile(load.latencies, 50) * 1000:.1f} ms, "
        f"p99 {percentile(load.latencies, 99) * 1000:.1f} ms, "
        f"max {max(load.latencies) * 1000:.0f} ms"
    )


def _throughput(args: argparse.Namespace, origin: TlsOrigin, rate: float | None) -> None:
    with local_state_dir("proxy-operator-bench-") as state_dir:
        config = proxy_config(origin.port, local_entry(state_dir))
        members = local_members(config, 3)
        gateway = GatewaySquid(
            config.proxy_settings(), state_dir / ".gateway", ("127.0.0.1", free_port())
        )
        gateway.start(members)
        workers = {w.role: gateway.worker_pid(w) for w in gateway.workers}
        processes = {
            **{role: pid for role, pid in workers.items() if pid is not None},
            **{
                f"member {n}": json.loads(
                    (state_dir / f"bench-member-{n}" / METADATA_FILE).read_text()
                )["pid"]
                for n in range(3)
            },
            "clients + origin": os.getpid(),
        }
        cpu: dict[str, collections.Counter[str]] = {}
        try:
            paths: dict[str, Target] = {
                "straight to one member": (members[0].host, members[0].port),
                "through the gateway": ("127.0.0.1", gateway.front.port),
            }
            results: dict[str, tuple[int, list[float], float]] = {p: (0, [], 0.0) for p in paths}
            cpu = {p: collections.Counter() for p in paths}
            for _ in range(args.rounds):
                for name, target in paths.items():
                    start = time.monotonic()
                    used = {name: cpu_seconds(pid) for name, pid in processes.items()}
                    with Load(lambda t=target: t, origin, args.clients, rate) as load:
                        time.sleep(args.seconds)
                    elapsed = time.monotonic() - start
                    for process, pid in processes.items():
                        cpu[name][process] += cpu_seconds(pid) - used[process]
                    done, latencies, seconds = results[name]
                    results[name] = (
                        done + load.outcomes["ok"],
                        latencies + load.latencies,
                        seconds + elapsed,
                    )
                    failed = sum(load.outcomes.values()) - load.outcomes["ok"]
                    if failed:
                        print(f"  {name}: {failed} failed: {dict(load.outcomes)}")
        finally:
            gateway.stop()
    rounds = f"{args.rounds} x {args.seconds:.0f} s each"
    offered = f"offered {rate:.0f} requests/s" if rate else "closed loop"
    print(f"\nCONNECT + TLS + GET, {args.clients} clients, {offered}, {rounds}")
    print(f"{'path':<24} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    figures = {}
    for name, (done, latencies, seconds) in results.items():
        rate = done / seconds
        p50, p99 = percentile(latencies, 50) * 1000, percentile(latencies, 99) * 1000
        figures[name] = (rate, p50, p99)
        print(f"{name:<24} {rate:>8.1f} {p50:>8.1f} {p99:>8.1f}")
    (direct, _, _), (gateway, _, _) = figures.values()
    p50_ratio = figures["through the gateway"][1] / figures["straight to one member"][1]
    p99_ratio = figures["through the gateway"][2] / figures["straight to one member"][2]
    print(f"throughput ratio gateway/direct: {gateway / direct:.2f}")
    print(f"latency ratio gateway/direct: p50 {p50_ratio:.2f}, p99 {p99_ratio:.2f}")
    print("CPU ms per request, by process:")
    for name, (done, _, _) in results.items():
        spent = {p: 1000 * s / max(done, 1) for p, s in cpu[name].items()}
        spent = {p: ms for p, ms in spent.items() if ms >= 0.02}  # not a stray tick
        total = sum(spent.values())
        parts = ", ".join(f"{p} {ms:.2f}" for p, ms in spent.items())
        print(f"  {name:<24} {total:.2f} ({parts})")


async def rotation(args: argparse.Namespace, origin: TlsOrigin) -> None:
    env = await start_dev_server()
    try:
        with (
            local_state_dir("proxy-operator-bench-") as state_dir,
            local_state_dir("proxy-operator-bench-gateway-") as gateway_dir,
        ):
            config = proxy_config(origin.port, local_entry(state_dir))
            await _rotate(args, env.client, config, state_dir, gateway_dir, origin)
    finally:
        await env.shutdown()


async def _rotate(
    args: argparse.Namespace,
    client: Client,
    config: Config,
    state_dir: Path,
    gateway_dir: Path,
    origin: TlsOrigin,
) -> None:
    async with local_worker(client, config, origin) as task_queue:
        rotated, reloads, load = await _rotate_pool(
            args, client, task_queue, state_dir, gateway_dir, origin
        )
    made = sum(load.outcomes.values())
    print(f"\nFull rotation of a {args.replicas}-member pool through the gateway")
    print(f"requests made {made}, lost {made - load.outcomes['ok']} ({dict(load.outcomes)})")
    print(f"every member on a new instance after {rotated:.1f} s; gateway reloads {reloads:.0f}")


async def _rotate_pool(
    args: argparse.Namespace,
    client: Client,
    task_queue: str,
    state_dir: Path,
    gateway_dir: Path,
    origin: TlsOrigin,
) -> tuple[float, float, Load]:
    template = {
        "provider": "local",
        "health": {"target": origin.url, "interval_seconds": 10, "failure_threshold": 3},
        "drain_seconds": args.drain,
    }
    pool = await client.start_workflow(
        "ProxyPool",
        {"replicas": args.replicas, "template": template},
        id=f"bench-pool-{uuid.uuid4().hex[:6]}",
        task_queue=task_queue,
    )

    async def endpoints() -> set[str]:
        return {e["endpoint"] for e in await pool.query("endpoints")}

    gateway = GatewayProcess(
        pool=pool.id,
        raw_config=raw_config(local_entry(state_dir), connect_ports=[443, origin.port]),
        temporal_address=client.service_client.config.target_host,
        namespace=client.namespace,
        directory=gateway_dir,
    )
    try:
        while len(await endpoints()) < args.replicas:
            await asyncio.sleep(0.5)
        await asyncio.to_thread(gateway.start)
        old = await endpoints()
        with Load(lambda: ("127.0.0.1", gateway.port), origin, args.clients) as load:
            await asyncio.sleep(2)
            start = time.monotonic()
            await pool.execute_update("rotate", {"all": True})
            while True:
                now = await endpoints()
                if len(now) == args.replicas and not now & old:
                    break
                await asyncio.sleep(0.5)
            rotated = time.monotonic() - start
            await asyncio.sleep(args.drain + 3)  # the last old instances drained and gone
        reloads = sum(
            v for (name, _), v in gateway.metrics().items() if name.endswith("reloads_total")
        )
    finally:
        gateway.stop()
        await pool.signal("terminate")
    return rotated, reloads, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=10)
    parser.add_argument("--drain", type=int, default=6)
    parser.add_argument("--rate", type=float, default=100.0, help="the open load, requests/s")
    parser.add_argument("--reloads", type=int, default=30, help="membership changes; 0 skips")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-rotation", action="store_true")
    args = parser.parse_args()
    with serve_tls_origin() as origin:
        if not args.skip_throughput:
            throughput(args, origin)
        if args.reloads:
            reloads(args, origin)
        if not args.skip_rotation:
            asyncio.run(rotation(args, origin))


if __name__ == "__main__":
    main()
