"""Local Squid: time to accept connections, memory per proxy, probe latency split.

    python -m bench.local_squid [--proxies 10] [--probes 100]

Starts real Squids through LocalProvider and probes a local trustme HTTPS
origin through one of them. Prints a table and asserts nothing: the figures
feed docs/benchmarks.md and depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from activities.probe import ProbeResult, probe_connect
from bench.stats import percentile
from providers.base import CreateRequest, InstanceState
from providers.local import METADATA_FILE, LocalConfig, LocalProvider
from providers.naming import owner_tags
from squid.conf import ProxySettings
from tests.helpers.config import LOOPBACK_ORIGIN_DENIED
from tests.helpers.procfs import children_by_parent
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin

USERNAME = "bench"
INSTALLATION = "bench"
FIRST_PORT = 25000
LAST_PORT = 25999


def start_to_running(provider: LocalProvider, request: CreateRequest) -> float:
    """Seconds from create() to the first get() that reports RUNNING."""
    start = time.monotonic()
    instance = provider.create(request)
    while instance.state is not InstanceState.RUNNING:
        if time.monotonic() - start > 30:
            raise RuntimeError(f"{request.name} not RUNNING after 30 s: {instance.state}")
        time.sleep(0.005)
        instance = provider.get(instance.provider_id)
    return time.monotonic() - start


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB of a process and its children (Squid's helpers).

    RSS counts shared pages (libraries, Squid's binary) in full for every
    process; PSS splits them among their users, so PSS sums to what N proxies
    really cost.
    """
    rss = pss = 0
    for member in [pid, *children_by_parent().get(pid, [])]:
        for line in Path(f"/proc/{member}/smaps_rollup").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "Rss":
                rss += int(value.split()[0])
            elif key == "Pss":
                pss += int(value.split()[0])
    return rss, pss


async def probe_many(port: int, password: str, origin: TlsOrigin, count: int) -> list[ProbeResult]:
    results = []
    for _ in range(count):
        results.append(
            await probe_connect(
                "127.0.0.1",
                port,
                USERNAME,
                password,
                origin.url,
                ssl_context=origin.client_ssl_context,
            )
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxies", type=int, default=10)
    parser.add_argument("--probes", type=int, default=100)
    args = parser.parse_args()

    password = secrets.token_urlsafe(16)
    state_dir = Path(tempfile.mkdtemp(prefix="bench-local-squid-"))
    state_dir.chmod(0o755)  # Squid drops to `proxy`, which must traverse it
    provider = LocalProvider(
        LocalConfig(state_dir=str(state_dir), first_port=FIRST_PORT, last_port=LAST_PORT),
        INSTALLATION,
    )
    names: list[str] = []
    try:
        with serve_tls_origin() as origin:
            settings = ProxySettings(
                3128,
                USERNAME,
                password,
                ("127.0.0.1/32",),
                (origin.port,),
                denied_destinations=LOOPBACK_ORIGIN_DENIED,
            )
            starts = []
            for i in range(args.proxies):
                name = f"bench-{i}"
                names.append(name)
                request = CreateRequest(name, settings, owner_tags(INSTALLATION, name, 0))
                starts.append(start_to_running(provider, request))

            memory = [
                memory_kib(json.loads((state_dir / n / METADATA_FILE).read_text())["pid"])
                for n in names
            ]
            port = provider.get(f"local/{names[0]}").port
            probes = asyncio.run(probe_many(port, password, origin, args.probes))
    finally:
        with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
            list(pool.map(lambda n: provider.delete(f"local/{n}"), names))
        shutil.rmtree(state_dir, ignore_errors=True)

    ok = [p for p in probes if p.ok]
    rows: list[tuple[str, str]] = [
        (
            f"create -> RUNNING, {len(starts)} proxies",
            f"median {statistics.median(starts) * 1000:.0f} ms, "
            f"p95 {percentile(starts, 95) * 1000:.0f} ms, max {max(starts) * 1000:.0f} ms",
        ),
        (
            "memory per proxy (Squid + helpers)",
            f"RSS median {statistics.median(m[0] for m in memory) / 1024:.1f} MiB, "
            f"PSS median {statistics.median(m[1] for m in memory) / 1024:.1f} MiB",
        ),
        ("probes ok", f"{len(ok)}/{len(probes)}"),
    ]
    for label, attribute in (
        ("TCP connect to proxy", "connect_ms"),
        ("CONNECT -> 200", "connect_reply_ms"),
        ("TLS handshake via tunnel", "tls_ms"),
        ("whole probe (to HEAD status)", "total_ms"),
    ):
        values = [getattr(p, attribute) for p in ok]
        rows.append(
            (
                f"probe: {label}",
                f"median {statistics.median(values):.2f} ms, p95 {percentile(values, 95):.2f} ms",
            )
        )
    width = max(len(label) for label, _ in rows)
    print(f"{'local Squid'.ljust(width)} | result")
    print(f"{'-' * width}-|-{'-' * 50}")
    for label, value in rows:
        print(f"{label.ljust(width)} | {value}")


if __name__ == "__main__":
    main()
