"""Time to RUNNING per cloud provider on its fake: a create and its readiness, in API calls.

    python -m bench.provider_ready [--runs 20]

For each of `aws` (moto's EC2 behind tests/fakes/ec2.py) and `gcp`
(tests/fakes/compute.py): create an instance, then `get` until RUNNING, the
guest reporting Squid ready at once; then delete it. The real clients
(boto3, google-cloud-compute) talk HTTP to the fakes on loopback, so this is
the provider's own path (requests built, sent, parsed; the calls it needs),
not a cloud's boot, which takes minutes and is the opt-in tests' business.
The first create of each provider also makes its security group or firewall
rule; the median leaves that out. `bench.lifecycle` measures the workflow on
top of a provider. Prints a table, asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from providers.aws import AwsConfig, AwsProvider
from providers.base import CreateRequest, InstanceState, Provider
from providers.gcp import STARTUP_READY, STARTUP_STATE_ATTRIBUTE, GcpConfig, GcpProvider
from providers.naming import instance_name, owner_tags
from squid.conf import ProxySettings
from tests.fakes.compute import DEFAULT_PROJECT, DEFAULT_ZONES, FakeCompute
from tests.fakes.ec2 import REGION, FakeEc2

INSTALLATION = "bench"
PROXY = ProxySettings(3128, "proxy", "bench-password-4b9e1c07", ("192.0.2.0/24",), (443,))


@dataclass(frozen=True)
class Timing:
    provider: str
    seconds: list[float]
    calls: list[int]


def request(i: int) -> CreateRequest:
    owner = f"bench-{i}"
    return CreateRequest(
        name=instance_name(owner, 0, installation=INSTALLATION, namespace="default"),
        proxy=PROXY,
        tags=owner_tags(INSTALLATION, owner, 0, namespace="default"),
    )


def time_to_running(
    provider: Provider, runs: int, report_ready: Callable[[str], None], calls: Callable[[], int]
) -> tuple[list[float], list[int]]:
    seconds, counts = [], []
    for i in range(runs):
        before = calls()
        start = time.perf_counter()
        instance = provider.create(request(i))
        report_ready(instance.provider_id)
        while instance.state is not InstanceState.RUNNING:
            instance = provider.get(instance.provider_id)
        seconds.append(time.perf_counter() - start)
        counts.append(calls() - before)
        provider.delete(instance.provider_id)
    return seconds, counts


def bench_aws(runs: int) -> Timing:
    with FakeEc2(auto_start_ip="127.0.0.1") as fake:
        settings = AwsConfig(region=REGION, subnets=[fake.subnets()[0][0]])
        provider = AwsProvider(settings, INSTALLATION, ec2=fake.client(), console_interval=0)
        seconds, calls = time_to_running(
            provider, runs, lambda instance_id: fake.report(instance_id, "ready"),
            lambda: len(fake.calls()),
        )  # fmt: skip
    return Timing("aws", seconds, calls)


def bench_gcp(runs: int) -> Timing:
    zone = DEFAULT_ZONES[0]
    with FakeCompute(auto_start_ip="127.0.0.1") as fake:
        settings = GcpConfig(project=DEFAULT_PROJECT, zone=zone)
        provider = GcpProvider(settings, INSTALLATION, guest_attribute_interval=0, **fake.clients())

        def ready(provider_id: str) -> None:
            name = provider_id.partition("/")[2]
            fake.guest_write(zone, name, STARTUP_STATE_ATTRIBUTE, STARTUP_READY)

        seconds, calls = time_to_running(provider, runs, ready, lambda: len(fake.calls()))
    return Timing("gcp", seconds, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    timings = [bench_aws(args.runs), bench_gcp(args.runs)]
    print("| provider (fake) | first ms | p50 ms | min ms | max ms | API calls (first / then) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for t in timings:
        rest = [s * 1000 for s in t.seconds[1:]]
        calls = f"{t.calls[0]} / {statistics.median(t.calls[1:]):g}"
        print(
            f"| {t.provider} | {t.seconds[0] * 1000:.0f} | {statistics.median(rest):.0f} | "
            f"{min(rest):.0f} | {max(rest):.0f} | {calls} |"
        )


if __name__ == "__main__":
    main()
