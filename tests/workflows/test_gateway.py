"""The gateway over a real ProxyPool: `proxy-operator-gateway` in its own process.

A worker serves ProxyPool and ProxyLifecycle with the local provider (real
Squids on loopback); the gateway follows the pool's `endpoints` query. Which
member carried a request is read from the members' own access logs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from gateway.users import hash_password
from tests.helpers.config import CALLER_SECRETS, PASSWORD, PASSWORD_ENV, USERNAME
from tests.helpers.gateway import GatewayProcess, pool_gateway, through
from tests.helpers.loopback_peer import loopback_peer
from tests.helpers.procfs import environment, processes_below, secrets_held
from tests.helpers.stacks import Stack
from tests.helpers.tunnel import request
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

REPLICAS = 3
QUIET_HEALTH = {"interval_seconds": 3600, "failure_threshold": 2}
# Longer than the test gateway's poll (0.5 s) and its query and change (no
# debounce), with room for a loaded machine; the default is 15 s.
DRAIN_SECONDS = 6


class Pool:
    """A ProxyPool of the test's worker, and what its members' Squids logged."""

    def __init__(self, stack: Stack, handle: WorkflowHandle[Any, Any]) -> None:
        self.stack = stack
        self.handle = handle

    async def endpoints(self) -> dict[str, str]:
        """member id -> endpoint, for the members the pool lists."""
        entries = await self.handle.query("endpoints")
        return {e["member"]: e["endpoint"] for e in entries}

    def instance_by_endpoint(self) -> dict[str, str]:
        """endpoint -> instance directory name, for the instances that exist now."""
        found = {}
        for path in self.stack.state_dir.iterdir():
            with contextlib.suppress(OSError, ValueError, KeyError):
                port = json.loads((path / "instance.json").read_text())["port"]
                found[f"127.0.0.1:{port}"] = path.name
        return found

    def tunnels(self) -> collections.Counter[str]:
        """Tunnels carried, per instance directory, from each Squid's own access log."""
        counts: collections.Counter[str] = collections.Counter()
        for path in self.stack.state_dir.iterdir():
            log = path / "access.log"
            with contextlib.suppress(OSError, ValueError, KeyError):
                counts[path.name] = log.read_text().count("TCP_TUNNEL/200")
        return +counts

    def pid_of(self, instance: str) -> int:
        return int(
            json.loads((self.stack.state_dir / instance / "instance.json").read_text())["pid"]
        )


@contextlib.asynccontextmanager
async def running_pool(stack: Stack, **settings: Any) -> AsyncIterator[Pool]:
    """A pool of REPLICAS quiet members (`settings` added to its input), all in endpoints.

    Terminated afterwards, once every member's Squid is gone.
    """
    target = {"target": stack.origin.url}
    handle = await stack.client.start_workflow(
        "ProxyPool",
        # Probes tunnel through the members too: one an hour keeps them out
        # of the members' logs while the test counts.
        {
            "replicas": REPLICAS,
            "template": stack.proxy_input(
                health=QUIET_HEALTH | target, drain_seconds=DRAIN_SECONDS
            ),
            **settings,
        },
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )
    found = Pool(stack, handle)

    async def all_ready() -> bool:
        return len(await found.endpoints()) == REPLICAS

    await wait_for(all_ready, f"{REPLICAS} members in endpoints", deadline=120)
    yield found
    await handle.signal("terminate")
    await wait_for(lambda: not stack.instances(), "every member's Squid gone", deadline=120)


@pytest.fixture
async def pool(temporal_env: WorkflowEnvironment, stack: Stack) -> AsyncIterator[Pool]:
    async with running_pool(stack) as found:
        yield found


@pytest.fixture
async def gateway(
    temporal_env: WorkflowEnvironment, stack: Stack, pool: Pool
) -> AsyncIterator[GatewayProcess]:
    # The API on: which member carried what is behind its token.
    async with pool_gateway(temporal_env, stack, pool.handle.id, api=True) as process:
        yield process


async def test_one_endpoint_rotates_sticks_and_pins_over_a_pool_of_three(
    stack: Stack, pool: Pool, gateway: GatewayProcess
) -> None:
    endpoints = await pool.endpoints()
    instance_of = pool.instance_by_endpoint()
    member_of = {instance_of[endpoint]: member for member, endpoint in endpoints.items()}
    # The members' first probes are in their logs already.
    probes = pool.tunnels()

    answers = await asyncio.to_thread(
        lambda: [through(gateway, stack, USERNAME) for _ in range(100)]
    )
    assert all(a.ok for a in answers), collections.Counter(answers)
    per_member = {member_of[i]: n for i, n in (pool.tunnels() - probes).items()}
    assert set(per_member) == set(endpoints), per_member
    assert sum(per_member.values()) == 100
    assert max(per_member.values()) - min(per_member.values()) <= 4, per_member

    before = pool.tunnels()
    for _ in range(50):
        assert (await asyncio.to_thread(through, gateway, stack, f"{USERNAME}-session-k1")).ok
    (sticky,) = (pool.tunnels() - before).items()
    assert sticky[1] == 50

    for member, endpoint in endpoints.items():
        before = pool.tunnels()
        answer = await asyncio.to_thread(through, gateway, stack, f"{USERNAME}-proxy-{member}")
        assert answer.ok
        assert pool.tunnels() - before == collections.Counter({instance_of[endpoint]: 1})

    wrong = await asyncio.to_thread(through, gateway, stack, USERNAME, "wrong-password")
    assert wrong.connect_status == 407
    port_22 = await asyncio.to_thread(
        request,
        ("127.0.0.1", gateway.port),
        USERNAME,
        PASSWORD,
        ("127.0.0.1", 22),
        stack.origin.client_ssl_context,
    )
    assert port_22.connect_status == 403

    # The gateway's own account agrees with the members' logs (it reads its
    # Squids' logs as they are written: wait for it to catch up).
    expected = collections.Counter({member_of[i]: n for i, n in (pool.tunnels() - probes).items()})

    def carried() -> collections.Counter[str]:
        counts = collections.Counter[str]()
        for (name, labels), value in gateway.member_metrics().items():
            if name == "proxy_operator_gateway_requests_total" and ("status", "200") in labels:
                counts[dict(labels)["member"]] += int(value)
        return counts

    def refused() -> list[float | None]:
        samples = gateway.metrics()
        name = "proxy_operator_gateway_responses_total"
        return [samples.get((name, (("status", status),))) for status in ("407", "403")]

    await wait_for(lambda: carried() == expected, f"the gateway's counts to be {expected}")
    # The front's lines (the 407 and the 403) are read from another file.
    await wait_for(lambda: refused() == [1, 1], "one 407 and one 403 in the gateway's counts")
    assert gateway.metrics()[("proxy_operator_gateway_members", ())] == REPLICAS


class ClientLoop:
    """A scraper's loop through the gateway, bounded, counting every outcome.

    `kill_after` SIGKILLs a member's Squid between two requests of the loop:
    a tunnel open through a member at the instant it dies is cut whatever the
    proxy in front does; what the gateway promises is that no request after
    that fails.
    """

    def __init__(self, gateway: GatewayProcess, stack: Stack, limit: int) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.kill: Callable[[], None] | None = None
        self._gateway, self._stack, self._limit = gateway, stack, limit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        for _ in range(self._limit):
            if self._stop.is_set():
                return
            if self.kill is not None:
                kill, self.kill = self.kill, None
                kill()
            try:
                answer = through(self._gateway, self._stack, USERNAME)
                self.outcomes["ok" if answer.ok else str(answer)] += 1
            except OSError as err:
                self.outcomes[repr(err)] += 1

    def start(self) -> ClientLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def test_a_full_rotation_and_a_killed_member_fail_no_request(
    stack: Stack, pool: Pool, gateway: GatewayProcess
) -> None:
    old_endpoints = set((await pool.endpoints()).values())
    old_instances = set(pool.instance_by_endpoint().values())
    loop = ClientLoop(gateway, stack, limit=20_000).start()
    try:
        await wait_for(lambda: loop.outcomes["ok"] >= 20, "the loop under way")
        victim = pool.instance_by_endpoint()[sorted(old_endpoints)[0]]
        loop.kill = lambda: os.kill(pool.pid_of(victim), signal.SIGKILL)
        await pool.handle.execute_update("rotate", {"all": True})

        async def rotated() -> bool:
            now = set((await pool.endpoints()).values())
            return (
                len(now) == REPLICAS
                and not now & old_endpoints
                and not old_instances & set(pool.instance_by_endpoint().values())
            )

        await wait_for(rotated, "every member on a new instance, the old ones gone", 180)
        # The gateway has dropped the old endpoints once its members gauge
        # settles; give it its poll and debounce.
        await wait_for(
            lambda: gateway.metrics()[("proxy_operator_gateway_members", ())] == REPLICAS,
            "the gateway back to three members",
        )
    finally:
        loop.stop()

    assert loop.kill is None, "the member was killed"
    samples = gateway.metrics()
    assert samples[("proxy_operator_gateway_reloads_total", (("outcome", "ok"),))] >= 1
    assert samples[("proxy_operator_gateway_change_seconds_count", ())] >= 1
    assert not [k for k in samples if k[0] == "proxy_operator_gateway_failures_total"]
    assert set(loop.outcomes) == {"ok"}, (loop.outcomes, _tail(gateway))
    assert loop.outcomes["ok"] > 100

    # The gateway's log tells an operator each change: every old endpoint out, every new in.
    log = gateway.output.read_text(errors="replace")
    changes = [line for line in log.splitlines() if "members now" in line]
    new_endpoints = set((await pool.endpoints()).values())
    for direction, endpoints in (("out", old_endpoints), ("in", new_endpoints)):
        for endpoint in endpoints:
            said = re.compile(rf"{direction}: [^;]* at {re.escape(endpoint)}\b")
            assert any(said.search(line) for line in changes), (direction, endpoint, changes)

    new_instances = set(pool.instance_by_endpoint().values())
    before = pool.tunnels()
    answers = await asyncio.to_thread(
        lambda: [through(gateway, stack, USERNAME) for _ in range(30)]
    )
    assert all(a.ok for a in answers)
    carried = pool.tunnels() - before
    assert sum(carried.values()) == 30 and set(carried) <= new_instances, carried


def _tail(gateway: GatewayProcess) -> str:
    """What the gateway's workers answered other than 200, and what Squid said of its peers."""
    directory = gateway.state_dir / "squid"
    out = []
    for log in sorted(directory.glob("*.log")):
        if log.name == "cache.log":
            continue
        lines = log.read_text().splitlines()
        bad = [line for line in lines if " 200 " not in line]
        out.append(f"{log.name}: {len(lines)} lines, not 200: {bad[:5]} ... {bad[-5:]}")
    with contextlib.suppress(FileNotFoundError):
        cache = (directory / "cache.log").read_text().splitlines()
        out += [line for line in cache if "DEAD" in line or "REVIVED" in line or "failed" in line]
    return "\n".join(out)


async def test_a_forged_member_report_never_reaches_the_gateway(
    stack: Stack, pool: Pool, gateway: GatewayProcess
) -> None:
    """`member_changed` is a signal anyone in the namespace may send; the fleet's password stays.

    A report naming a listener's address as a member's endpoint would, taken
    as it came, make every gateway send that listener each client's CONNECT
    with the fleet's Proxy-Authorization. The pool lists an endpoint only once
    the member's provider confirms its instance serves there, refuses reports
    stamped in the future or malformed (without failing a workflow task), and
    counts each.
    """
    member = sorted(await pool.endpoints())[0]
    with loopback_peer() as listener:
        now = datetime.now(UTC)
        forged = {
            "member": member,
            "state": "Ready",
            "endpoint": f"127.0.0.1:{listener.port}",
            "provider": "local",
            "generation": 99,
            "ready_since": now.isoformat(),
            "at": (now + timedelta(seconds=1)).isoformat(),
            "seq": 0,
        }
        for report in (
            forged,
            forged | {"at": "2099-01-01T00:00:00+00:00"},
            forged | {"at": "not-a-date"},
            "not even an object",
        ):
            await pool.handle.signal("member_changed", report)

        async def all_refused() -> bool:
            status = await pool.handle.query("status")
            return bool(status["rejected_reports"] >= 4)

        await wait_for(all_refused, "the four forged reports refused", deadline=60)
        assert f"127.0.0.1:{listener.port}" not in (await pool.endpoints()).values()
        answers = await asyncio.to_thread(
            lambda: [through(gateway, stack, USERNAME) for _ in range(3 * REPLICAS)]
        )
        assert all(a.ok for a in answers), collections.Counter(answers)
        assert listener.requests == []
    # The pool still works: the bad reports failed no workflow task.
    assert await pool.handle.execute_update("scale", {"replicas": REPLICAS}) == {
        "replicas": REPLICAS,
        "previous": REPLICAS,
    }


async def test_squid_the_router_and_the_watchdog_get_no_secret_of_the_gateway(
    temporal_env: WorkflowEnvironment, stack: Stack, pool: Pool
) -> None:
    """What the gateway holds (Temporal key, fleet password, cloud keys) stays out of Squid.

    Squid's user may read the environment of each process it runs as
    (/proc/<pid>/environ): a client that took over a Squid worker or the
    router would hold the namespace. The router reads the fleet's password
    from its standard input, never its environment.
    """
    alice = ("alice", "alice-password-1")
    secrets = {**CALLER_SECRETS, PASSWORD_ENV: PASSWORD}

    def users_file(directory: Path) -> tuple[str, ...]:
        users = directory / "users"
        users.write_text(f"{alice[0]}:{hash_password(alice[1])} tunnels=2\n")
        return ("--users-file", str(users))

    # A key alone would turn TLS on, which the dev server does not speak.
    extra_env = {**CALLER_SECRETS, "TEMPORAL_TLS": "false"}
    async with pool_gateway(temporal_env, stack, pool.handle.id, users_file, extra_env) as gateway:
        assert gateway.process is not None
        # Both kinds of users authenticate: the router works in what it is given.
        assert (await asyncio.to_thread(through, gateway, stack, USERNAME)).ok
        assert (await asyncio.to_thread(through, gateway, stack, *alice)).ok
        processes: dict[int, str] = {}
        wanted = ("squid-1", "router.py", "gateway.watchdog")

        def all_found() -> bool:
            processes.update(processes_below(gateway.process.pid))  # type: ignore[union-attr]
            return all(any(w in args for args in processes.values()) for w in wanted)

        await wait_for(all_found, f"the gateway's processes: {wanted}")
        del processes[gateway.process.pid]  # the gateway's own holds what it was given
        assert all(environment(pid) for pid in processes), "an environment this test cannot read"
        assert secrets_held(processes, secrets) == {}, processes
