"""What one membership change costs the gateway, per side, at fleet sizes (issue 45).

    python -m bench.router_change [--members 1000 10000] [--changes 200]

The router applies each change on the event loop that also serves every
request, so its time per change is taken from the request path. In this
process, over the real code:

- the router: `gateway.router.answer` on a change of one member in and
  one out (the line parsed, the members built, the index changed), and on
  the members whole (the line at start and at a resync);
- a session key the router remembers, at its first request after a change
  (brought up to date), against one scored anew over every member;
- the router's memory per member: what its index of N holds (tracemalloc);
- the gateway: `GatewaySquid.apply` of one member in and one out, to the
  real router's answer, on a gateway (its Squid and router) started on N
  members at addresses nothing answers on (no request is sent);
- the gateway: the `endpoints` answer of the pool that changed (one of up
  to 1,000 members: a change is one pool's), one member in and one out,
  decoded from its payload, read into members (`membership.Endpoints`,
  which reads again only the entries that changed) and admitted to the
  member networks, as the gateway's pool follower takes it in; and the
  same with every entry read and every address admitted anew.

Prints the median and p99 of each. Asserts nothing: the figures feed
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from temporalio.converter import DataConverter

from bench.stats import percentile
from gateway.member_networks import Gatekeeper, MemberNetworks, parse_networks
from gateway.membership import Endpoints, parse_endpoints
from gateway.router import Router, answer
from gateway.routing import Members
from gateway.squid import GatewaySquid
from proxy_operator.username import parse_gateway_username
from squid.gateway import GatewayMember
from tests.helpers.config import PASSWORD, USERNAME, local_entry, proxy_config
from tests.helpers.network import free_port
from workflows.pool_input import MAX_REPLICAS

ZONES = ("europe-west1-b", "europe-west1-c", "us-east1-c")
SESSION_KEYS = 200


def member(n: int) -> GatewayMember:
    """Member `n` of a pool of 1,000 (a thousand each, as bench.gateway starts them)."""
    zone = ZONES[n % len(ZONES)]
    host = f"127.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
    return GatewayMember(f"pool-{n // 1000}/{n}", host, 3128, zone, zone[:-2], "gcp")


def listed(m: GatewayMember) -> dict[str, object]:
    return {
        "member": m.member,
        "host": m.host,
        "port": m.port,
        "zone": m.zone,
        "region": m.region,
        "provider": m.provider,
        "pool": m.member.partition("/")[0],
    }


def timed_ms(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return (time.perf_counter() - start) * 1000


def summary(times: list[float]) -> str:
    return f"{percentile(times, 50):8.3f} {percentile(times, 99):8.3f}"


def router_side(n: int, changes: int) -> None:
    router = Router(USERNAME, PASSWORD, None, io.StringIO())
    whole = [listed(member(k)) for k in range(n)]
    line = json.dumps({"members": whole, "generation": 1}).encode()
    whole_ms = [timed_ms(lambda: answer(router, line)) for _ in range(5)]
    usernames = [f"{USERNAME}-session-k{key}" for key in range(SESSION_KEYS)]
    parsed = [parse_gateway_username(u, USERNAME) for u in usernames]
    generation, newest = 1, n - 1
    change_ms, remembered_ms, scored_ms = [], [], []
    for _ in range(changes):
        for username, form in zip(usernames, parsed, strict=True):
            assert form is not None
            next(router.members.order(username, form))  # remembered before the change
        gone = router.members.members[0].member  # the oldest member out, a new one in
        newest += 1
        change = {
            "after": generation,
            "generation": generation + 1,
            "in": [listed(member(newest))],
            "out": [gone],
        }
        text = json.dumps({"change": change}).encode()
        change_ms.append(timed_ms(lambda: answer(router, text)))  # noqa: B023
        generation += 1
        username, form = usernames[0], parsed[0]
        assert form is not None
        remembered_ms.append(timed_ms(lambda: next(router.members.order(username, form))))  # noqa: B023
        username = f"{USERNAME}-session-new{generation}"
        form = parse_gateway_username(username, USERNAME)
        assert form is not None
        scored_ms.append(timed_ms(lambda: next(router.members.order(username, form))))  # noqa: B023
    print(f"{'router, members whole':<44} {summary(whole_ms)}")
    print(f"{'router, one member in and one out':<44} {summary(change_ms)}")
    print(f"{'a remembered session key after a change':<44} {summary(remembered_ms)}")
    print(f"{'a session key scored anew':<44} {summary(scored_ms)}")
    router.members = Members(())
    gc.collect()
    tracemalloc.start()
    fresh = Router(USERNAME, PASSWORD, None, io.StringIO())
    answer(fresh, line)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"{'the router index, bytes per member':<44} {held / n:8.0f}")


def gateway_side(n: int, changes: int) -> None:
    members = [member(k) for k in range(n)]
    with tempfile.TemporaryDirectory() as directory:
        config = proxy_config(443, local_entry(directory))
        squid = GatewaySquid(
            config.proxy_settings(), Path(directory) / "gateway", ("127.0.0.1", free_port())
        )
        try:
            squid.start(members)
            times = []
            for newest in range(n, n + changes):
                members = [*members[1:], member(newest)]
                times.append(timed_ms(lambda: squid.apply(members)))  # noqa: B023
        finally:
            squid.stop()
    print(f"{'gateway, one in and one out, to its answer':<44} {summary(times)}")


def entry(m: GatewayMember) -> dict[str, object]:
    """`m` as its pool's `endpoints` query lists it."""
    return {
        "member": m.member,
        "endpoint": f"{m.host}:{m.port}",
        "provider": m.provider,
        "placement": {"zone": m.zone},
    }


def answer_side(n: int, changes: int) -> None:
    pool = min(n, MAX_REPLICAS)
    entries = [entry(member(k)) for k in range(pool)]
    networks = MemberNetworks(parse_networks("127.0.0.0/8", "--member-networks"))
    endpoints, gatekeeper = Endpoints(), Gatekeeper(networks)
    gatekeeper.admit(endpoints.parse(entries))
    # The client's decode, without its codec (none here) and its event loop.
    converter = DataConverter.default.payload_converter
    taken_ms, anew_ms = [], []
    for newest in range(pool, pool + changes):
        entries = [*entries[1:], entry(member(newest))]
        payloads = converter.to_payloads([entries])

        def take_in() -> None:
            raw = converter.from_payloads(payloads)[0]  # noqa: B023
            gatekeeper.admit(endpoints.parse(raw))

        def take_in_anew() -> None:
            raw = converter.from_payloads(payloads)[0]  # noqa: B023
            Gatekeeper(networks).admit(parse_endpoints(raw))

        taken_ms.append(timed_ms(take_in))
        anew_ms.append(timed_ms(take_in_anew))
    print(f"{'gateway, a pool answer taken in':<44} {summary(taken_ms)}")
    print(f"{'gateway, the same, every entry read anew':<44} {summary(anew_ms)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--changes", type=int, default=200)
    args = parser.parse_args()
    for n in args.members:
        if not 1 <= n <= 100_000:
            parser.error(f"--members: {n} is not from 1 to 100000")
        print(f"\n{n} members, {args.changes} changes{'':<14} {'p50 ms':>8} {'p99 ms':>8}")
        router_side(n, args.changes)
        gateway_side(n, args.changes)
        answer_side(n, args.changes)


if __name__ == "__main__":
    main()
