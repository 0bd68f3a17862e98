"""The gateway's control API over a real ProxyPool: tokens, members, sessions, bans.

The gateway runs as users run it (`proxy-operator-gateway --api-listen ...`,
its own process, real Squids, the local provider); requests go through
http.client, hostile ones as raw bytes. Which member carried a session is
checked against the members' own access logs, not the gateway's word.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme
from temporalio.testing import WorkflowEnvironment

from gateway.api import DEFAULT_PER_CLIENT, MAX_CONNECTIONS
from gateway.routing import userhash_member
from gateway.users import hash_password
from tests.docs.markdown import examples
from tests.helpers.api import TIMEOUT, call, connect_from, raw
from tests.helpers.config import PASSWORD, PASSWORD_ENV, USERNAME
from tests.helpers.gateway import GatewayProcess, pool_gateway, through
from tests.helpers.network import closed_by_peer, free_port
from tests.helpers.stacks import Stack
from tests.helpers.tunnel import hold_tunnel
from tests.helpers.waiting import wait_for
from tests.workflows.test_gateway import Pool, pool  # noqa: F401  (the pool fixture)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
API_DOC = "docs/gateway-api.md"
CURL = re.compile(r"^\s*curl\s", re.MULTILINE)
ALICE = ("alice", "alice-password-1")
BOB = ("bob", "bob-password-2")
# Enough for the test's own requests with one token; the other is drained.
RATE = "0.2"
BURST = 80
# The API cuts a connection 3 s after the connect without a first byte, 5 s
# without a whole head (docs/gateway-api.md); the rest is a loaded machine's margin.
CUT_WITHIN = 8.0


@dataclass(frozen=True)
class ApiGateway:
    """A gateway with the control API on, the tokens file it reads, and two of its tokens."""

    process: GatewayProcess
    port: int
    tokens_file: Path
    tokens: tuple[str, str]
    users_file: Path


@contextlib.asynccontextmanager
async def started(
    temporal_env: WorkflowEnvironment, stack: Stack, pool_id: str, *extra: str
) -> AsyncIterator[ApiGateway]:
    """A gateway over pool `pool_id` with the API on 127.0.0.1, two tokens, alice in its users
    file; `extra` flags on top."""
    tokens = (secrets.token_urlsafe(24), secrets.token_urlsafe(24))
    port = free_port()
    files: list[Path] = []

    def flags(directory: Path) -> tuple[str, ...]:
        tokens_file, users_file = directory / "tokens", directory / "users"
        tokens_file.write_text(f"# the crawlers\n{tokens[0]}\n\n  {tokens[1]}  \n")
        users_file.write_text(f"{ALICE[0]}:{hash_password(ALICE[1])}\n")
        files.extend([tokens_file, users_file])
        return (
            *("--api-listen", f"127.0.0.1:{port}", "--api-tokens-file", str(tokens_file)),
            *("--api-rate", RATE, "--api-burst", str(BURST), "--users-file", str(users_file)),
            *extra,
        )

    async with pool_gateway(temporal_env, stack, pool_id, flags) as process:
        yield ApiGateway(process, port, files[0], tokens, files[1])


@pytest.fixture
async def api_gateway(
    temporal_env: WorkflowEnvironment,
    stack: Stack,
    pool: Pool,  # noqa: F811
) -> AsyncIterator[ApiGateway]:
    async with started(temporal_env, stack, pool.handle.id) as gateway:
        yield gateway


async def api(port: int, method: str, path: str, **kwargs: object) -> tuple[int, object]:
    reply = await asyncio.to_thread(call, port, method, path, **kwargs)  # type: ignore[arg-type]
    return reply.status, reply.json()


async def open_session(
    stack: Stack, members: Pool, api_gateway: ApiGateway, key: str
) -> tuple[str, dict[str, str]]:
    """One tunnel with session `key`: the member that carried it, by its own access log,
    which the API names at once; and the pool's endpoints then."""
    endpoints = await members.endpoints()
    before = members.tunnels()
    username = f"{USERNAME}-session-{key}"
    assert (await asyncio.to_thread(through, api_gateway.process, stack, username)).ok
    instance_of = members.instance_by_endpoint()
    member_of = {instance_of[endpoint]: member for member, endpoint in endpoints.items()}
    grew = [member_of.get(i, i) for i in members.tunnels() - before]
    assert len(grew) == 1, grew
    looked_up = await api(
        api_gateway.port, "GET", f"/v1/sessions/{key}", token=api_gateway.tokens[0]
    )
    assert looked_up == (200, {"session": key, "member": grew[0]})
    return grew[0], endpoints


async def test_tokens_are_checked_and_nothing_is_revealed_without_one(
    api_gateway: ApiGateway,
) -> None:
    gateway, port, (token, other) = api_gateway.process, api_gateway.port, api_gateway.tokens
    assert await api(port, "GET", "/healthz") == (200, {"status": "ok"})
    # The last character changed: to "x", unless it is one already (1 in 64).
    wrong = token[:-1] + ("y" if token.endswith("x") else "x")

    hostile = {
        "none": {},
        "empty": {"Authorization": ""},
        "empty token": {"Authorization": "Bearer "},
        "wrong token": {"Authorization": f"Bearer {wrong}"},
        "token and more": {"Authorization": f"Bearer {token} {token}"},
        "two spaces": {"Authorization": f"Bearer  {token}"},
        "basic scheme": {"Authorization": f"Basic {token}"},
        "no scheme": {"Authorization": token},
        "long": {"Authorization": "Bearer " + "a" * 4000},
    }
    for path in ("/v1/members", "/metrics", "/v1/sessions/k", "/no/such/path"):
        for what, headers in hostile.items():
            reply = await asyncio.to_thread(call, port, "GET", path, headers=headers)
            assert reply.status == 401, (path, what, reply)
            assert reply.headers["www-authenticate"] == "Bearer"
            assert reply.json() == {"error": "a valid bearer token is required"}
    post = await asyncio.to_thread(call, port, "POST", "/v1/bans", body={"member": "x"})
    assert post.status == 401

    # A head over the bound is refused without waiting for the rest (or cut).
    answer = await asyncio.to_thread(
        raw, port, b"GET /v1/members HTTP/1.1\r\nX-Pad: " + b"x" * 70_000 + b"\r\n\r\n"
    )
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:80]
    # A client that never finishes its head is cut after the head deadline, answered
    # nothing, while others are served.
    slow = asyncio.create_task(
        asyncio.to_thread(raw, port, b"GET /v1/members HTTP/1.1\r\nAuthorization: Bearer ")
    )
    assert (await asyncio.to_thread(call, port, "GET", "/healthz")).status == 200
    assert await slow == b""
    # The token's scheme is case-insensitive (RFC 7235), surrounding spaces are not the token's.
    lower = await asyncio.to_thread(
        call, port, "GET", "/v1/members", headers={"Authorization": f"bearer {other}"}
    )
    assert lower.status == 200

    # Each token has its own bucket: one drained, the other still served.
    statuses = [
        (await asyncio.to_thread(call, port, "GET", "/v1/members", token=other)).status
        for _ in range(BURST + 10)
    ]
    assert 429 in statuses and statuses[0] == 200, statuses
    limited = await asyncio.to_thread(call, port, "GET", "/v1/members", token=other)
    assert limited.status == 429 and "rate limit" in limited.json()["error"]
    assert (await asyncio.to_thread(call, port, "GET", "/v1/members", token=token)).status == 200

    # The file is followed: a token taken out is refused, a new one accepted.
    fresh = secrets.token_urlsafe(24)
    api_gateway.tokens_file.write_text(f"{fresh}\n")

    async def swapped() -> bool:
        new = await asyncio.to_thread(call, port, "GET", "/v1/members", token=fresh)
        gone = await asyncio.to_thread(call, port, "GET", "/v1/members", token=token)
        return new.status == 200 and gone.status == 401

    await wait_for(swapped, "the new token accepted and the removed one refused")
    # And on SIGHUP, for a file whose change the gateway could not see.
    api_gateway.tokens_file.write_text(f"{token}\n")
    assert gateway.process is not None
    gateway.process.send_signal(signal.SIGHUP)

    async def restored() -> bool:
        return (
            await asyncio.to_thread(call, port, "GET", "/v1/members", token=token)
        ).status == 200

    await wait_for(restored, "the token back after SIGHUP")


async def test_members_sessions_and_bad_bans_are_answered_as_documented(
    stack: Stack,
    pool: Pool,  # noqa: F811
    api_gateway: ApiGateway,
) -> None:
    port, token = api_gateway.port, api_gateway.tokens[0]
    carrier, endpoints = await open_session(stack, pool, api_gateway, "cart-7")
    listing: Any = None

    async def listed() -> bool:
        nonlocal listing
        status, listing = await api(port, "GET", "/v1/members", token=token)
        assert status == 200 and isinstance(listing, dict)
        return any("cart-7" in m["sessions"] for m in listing["members"])

    # The listing's sessions are read from the gateway's access logs, as Squid writes them.
    await wait_for(listed, "cart-7 among the sessions of a member")
    assert (listing["pool"], listing["pools"]) == (pool.handle.id, [pool.handle.id])
    by_member = {m["member"]: m for m in listing["members"]}
    assert set(endpoints) <= set(by_member)
    for member in endpoints:
        entry = by_member[member]
        assert set(entry) == {
            "member",
            "pool",
            "state",
            "zone",
            "region",
            "provider",
            "exit_address",
            "age_seconds",
            "sessions",
        }
        assert entry["state"] == "Ready" and entry["provider"] == "local"
        assert entry["pool"] == pool.handle.id
        assert isinstance(entry["age_seconds"], int) and entry["age_seconds"] >= 0
        assert entry["sessions"] == (["cart-7"] if member == carrier else [])
    text = (await asyncio.to_thread(call, port, "GET", "/v1/members", token=token)).body.decode()
    assert PASSWORD not in text and "password" not in text.lower()
    metrics = await asyncio.to_thread(call, port, "GET", "/metrics", token=token)
    assert metrics.status == 200 and b"proxy_operator_gateway_members" in metrics.body

    # A key no tunnel carried yet: the member it would go to.
    status, unseen = await api(port, "GET", "/v1/sessions/never-seen", token=token)
    assert status == 200 and isinstance(unseen, dict) and unseen["member"] in endpoints
    assert (await api(port, "GET", "/v1/sessions/bad%20key", token=token))[0] == 400
    assert (await api(port, "GET", "/v1/nothing", token=token))[0] == 404
    assert (await api(port, "GET", "/v1/bans", token=token))[0] == 405

    bad_bans: list[tuple[object, int, str]] = [
        (b"{not json", 400, "body"),
        (b"[]", 400, "body"),
        ({"reason": "403"}, 400, "member, session"),
        ({"member": carrier, "session": "cart-7"}, 400, "member, session"),
        ({"member": 7}, 400, "member"),
        ({"member": ""}, 400, "member"),
        ({"session": "a b"}, 400, "session"),
        ({"member": carrier, "reason": "x" * 201}, 400, "reason"),
        ({"member": carrier, "reason": 403}, 400, "reason"),
        ({"member": carrier, "why": "403"}, 400, "why"),
        (b"{" + b'"a":1,' * 4000 + b"}", 413, "body"),
        ({"member": f"{pool.handle.id}/99"}, 404, "member"),
    ]
    for body, expected, field in bad_bans:
        status, answer = await api(port, "POST", "/v1/bans", token=token, body=body)
        assert status == expected, (body, answer)
        assert isinstance(answer, dict) and answer["error"].startswith(field), (body, answer)
    assert await pool.endpoints() == endpoints, "no bad request banned anything"


async def test_a_ban_through_the_api_moves_the_session_to_a_new_exit(
    stack: Stack,
    pool: Pool,  # noqa: F811
    api_gateway: ApiGateway,
) -> None:
    gateway, port, (token, _) = api_gateway.process, api_gateway.port, api_gateway.tokens
    banned, endpoints = await open_session(stack, pool, api_gateway, "shop-1")
    session = f"{USERNAME}-session-shop-1"
    answer = await api(
        port, "POST", "/v1/bans", token=token, body={"session": "shop-1", "reason": "403 from shop"}
    )
    assert answer == (202, {"member": banned, "accepted": True})

    # The pool's own limit (a quarter of three members: one ban per window) judges the next.
    other = next(m for m in endpoints if m != banned)
    reply = await asyncio.to_thread(
        call, port, "POST", "/v1/bans", token=token, body={"member": other, "reason": "403"}
    )
    # One line, so what curl prints of it ends its line.
    assert reply.status == 429 and reply.body.endswith(b"}\n"), reply
    refusal = reply.json()["error"]
    assert "ban rate limit" in refusal, refusal
    # The limit, where it comes from, and when the next ban is accepted.
    assert "(limit 1: a quarter of 3 replicas" in refusal, refusal
    assert "the next is accepted from" in refusal, refusal

    async def replaced() -> bool:
        now = await pool.endpoints()
        return len(now) == len(endpoints) and endpoints[banned] not in now.values()

    await wait_for(replaced, f"{banned} replaced on a new endpoint", deadline=120)
    old_instance = pool.instance_by_endpoint().get(endpoints[banned])

    async def moved() -> bool:
        before = pool.tunnels()
        answer = await asyncio.to_thread(through, gateway, stack, session)
        grew = [i for i, n in pool.tunnels().items() if n > before.get(i, 0)]
        return answer.ok and grew != [old_instance]

    await wait_for(moved, "the session carried by another exit than the banned one", deadline=60)


async def test_a_ban_by_session_bans_the_exit_carrying_it_though_a_member_joined(
    stack: Stack,
    pool: Pool,  # noqa: F811
    api_gateway: ApiGateway,
) -> None:
    """A crawler holds its session's tunnel open; a member joins, and the session's key now
    hashes to the newcomer; the site bans the page the tunnel brought: the ban by session
    bans the exit that carried it, not the newcomer."""
    port, token = api_gateway.port, api_gateway.tokens[0]
    members = [f"{pool.handle.id}/{n}" for n in range(3)]
    newcomer = f"{pool.handle.id}/3"
    endpoints = await pool.endpoints()
    assert sorted(endpoints) == members
    # A key that goes to one of the three now and to the newcomer once it joins.
    key = next(
        f"shop-{n}"
        for n in range(1000)
        if userhash_member(f"{USERNAME}-session-shop-{n}", [*members, newcomer]) == newcomer
    )
    carrier = userhash_member(f"{USERNAME}-session-{key}", members)
    tunnel = await asyncio.to_thread(
        hold_tunnel,
        ("127.0.0.1", api_gateway.process.port),
        (stack.origin.host, stack.origin.port),
        stack.origin.client_ssl_context,
        (f"{USERNAME}-session-{key}", PASSWORD),
    )
    with tunnel:
        assert await api(port, "GET", f"/v1/sessions/{key}", token=token) == (
            200,
            {"session": key, "member": carrier},
        )
        await pool.handle.execute_update("scale", {"replicas": 4})

        async def newcomer_serves() -> bool:
            answer = await api(port, "GET", f"/v1/sessions/{key}", token=token)
            return answer == (200, {"session": key, "member": newcomer})

        await wait_for(newcomer_serves, f"{key} going to {newcomer}", deadline=120)
        joined = await pool.endpoints()
        answer = await api(
            port, "POST", "/v1/bans", token=token, body={"session": key, "reason": "403"}
        )
        assert answer == (202, {"member": carrier, "accepted": True})

    async def replaced() -> bool:
        now = await pool.endpoints()
        return len(now) == 4 and now[carrier] != endpoints[carrier]

    await wait_for(replaced, f"{carrier}, the exit that carried {key}, replaced", deadline=120)
    assert (await pool.endpoints())[newcomer] == joined[newcomer], "the newcomer kept its exit"


async def test_the_api_doc_runs_as_written(
    stack: Stack,
    api_gateway: ApiGateway,
    tmp_path: Path,
) -> None:
    """docs/gateway-api.md's curl blocks, in order, against this gateway and its API."""
    found = examples(ROOT / API_DOC, ROOT, CURL)
    assert len(found) >= 4, f"no curl examples found in {API_DOC}"
    ca_file = tmp_path / "ca.pem"
    stack.origin.ca.cert_pem.write_to_path(str(ca_file))
    env = {
        "PATH": os.environ["PATH"],
        "TOKEN": api_gateway.tokens[0],
        PASSWORD_ENV: PASSWORD,
        "CURL_CA_BUNDLE": str(ca_file),
    }
    places = {
        "127.0.0.1:8888": f"127.0.0.1:{api_gateway.process.port}",
        "127.0.0.1:8889": f"127.0.0.1:{api_gateway.port}",
        "https://example.com": stack.origin.url,
    }
    for example in found:
        if example.directive("skip") is not None:
            continue
        script = example.text
        for written, actual in places.items():
            script = script.replace(written, actual)
        run = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-c", "set -eo pipefail\n" + script],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert run.returncode == 0, f"{example.source}:\n{script}{run.stdout}{run.stderr}"


async def test_the_running_gateway_follows_its_users_file(
    stack: Stack,
    pool: Pool,  # noqa: F811
    api_gateway: ApiGateway,
) -> None:
    gateway, port, token = api_gateway.process, api_gateway.port, api_gateway.tokens[0]
    assert (await asyncio.to_thread(through, gateway, stack, *ALICE)).ok
    assert (await asyncio.to_thread(through, gateway, stack, *BOB)).connect_status == 407

    # A users-file user's session: the API names its member once the gateway has
    # seen the username (a session key alone is taken for the fleet user's).
    endpoints = await pool.endpoints()
    before = pool.tunnels()
    username = f"{ALICE[0]}-session-a1"
    assert (await asyncio.to_thread(through, gateway, stack, username, ALICE[1])).ok
    instance_of = pool.instance_by_endpoint()
    member_of = {instance_of[endpoint]: member for member, endpoint in endpoints.items()}
    (carried,) = (member_of[i] for i in pool.tunnels() - before)

    async def named() -> bool:
        return await api(port, "GET", "/v1/sessions/a1", token=token) == (
            200,
            {"session": "a1", "member": carried},
        )

    await wait_for(named, "the API naming the member that carried alice's session")

    api_gateway.users_file.write_text(f"# alice left\n{BOB[0]}:{hash_password(BOB[1])}\n")

    async def swapped() -> bool:
        bob = await asyncio.to_thread(through, gateway, stack, *BOB)
        alice = await asyncio.to_thread(through, gateway, stack, *ALICE)
        return bob.ok and alice.connect_status == 407

    await wait_for(swapped, "bob accepted and alice refused", deadline=120)
    assert (await asyncio.to_thread(through, gateway, stack, USERNAME)).ok


@contextlib.contextmanager
def holding(port: int, sources: Sequence[str], each: int) -> Iterator[None]:
    """Anonymous clients at `sources` that keep `each` silent connections open apiece,
    opening a new one as soon as the API closes one, as an attacker would. Entered once
    every source has opened its connections."""
    stop, ready = threading.Event(), threading.Event()

    def attack() -> None:
        held: dict[str, list[socket.socket]] = {source: [] for source in sources}
        try:
            while not stop.is_set():
                for source, sockets in held.items():
                    for sock in [s for s in sockets if closed_by_peer(s)]:
                        sockets.remove(sock)
                        sock.close()
                    while len(sockets) < each:
                        sockets.append(connect_from(source, port))
                ready.set()
                stop.wait(0.1)
        finally:
            for sockets in held.values():
                for sock in sockets:
                    sock.close()

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    try:
        assert ready.wait(TIMEOUT), "the attacker's connections opened"
        yield
    finally:
        stop.set()
        thread.join()


async def only_the_excess_is_closed(
    port: int, source: str, meanwhile: Callable[[], Awaitable[None]]
) -> None:
    """`source` gets DEFAULT_PER_CLIENT connections; the ones over are closed at once,
    and `meanwhile` runs while the others are held."""
    over = 5
    sockets = [connect_from(source, port) for _ in range(DEFAULT_PER_CLIENT + over)]
    try:

        def closed() -> list[int]:
            return [i for i, sock in enumerate(sockets) if closed_by_peer(sock)]

        await wait_for(lambda: len(closed()) >= over, "the connections over the cap closed")
        assert closed() == list(range(DEFAULT_PER_CLIENT, DEFAULT_PER_CLIENT + over))
        await meanwhile()
    finally:
        for sock in sockets:
            sock.close()


async def test_idle_sockets_do_not_keep_a_token_holder_out(api_gateway: ApiGateway) -> None:
    port, token = api_gateway.port, api_gateway.tokens[0]

    async def served() -> None:
        """A token holder (and a health check) on 127.0.0.1, served as if alone."""
        for _ in range(3):
            assert (await api(port, "GET", "/v1/members", token=token))[0] == 200
            assert await api(port, "GET", "/healthz") == (200, {"status": "ok"})

    await only_the_excess_is_closed(port, "127.0.0.3", served)

    # One address trying to hold every connection the API has, and more.
    with holding(port, ["127.0.0.2"], MAX_CONNECTIONS + 8):
        await served()
    # Ten addresses, filling more than every connection the API has between them:
    # each newcomer takes the place of a silent socket of the address holding most.
    attackers = [f"127.0.0.{10 + i}" for i in range(10)]
    assert len(attackers) * DEFAULT_PER_CLIENT > MAX_CONNECTIONS
    with holding(port, attackers, DEFAULT_PER_CLIENT + 4):
        await served()


async def test_silent_and_dribbling_clients_are_cut_within_seconds(
    api_gateway: ApiGateway,
) -> None:
    silent = connect_from("127.0.0.4", port := api_gateway.port)
    dribbling = connect_from("127.0.0.5", port)
    dribbling.sendall(b"GET /healthz HTTP/1.1\r\n")

    def dribble() -> bool:
        """One more byte of a header that never ends; True once the API has closed."""
        try:
            dribbling.sendall(b"x")
        except OSError:  # reset: the API closed it
            return True
        return closed_by_peer(dribbling)

    try:
        await wait_for(lambda: closed_by_peer(silent), "the silent client cut", CUT_WITHIN)
        await wait_for(dribble, "the dribbling client cut", CUT_WITHIN)
        assert (await asyncio.to_thread(call, port, "GET", "/healthz")).status == 200
    finally:
        silent.close()
        dribbling.close()


async def test_over_tls_a_handshake_counts_against_its_client_and_its_deadline(
    temporal_env: WorkflowEnvironment,
    stack: Stack,
    pool: Pool,  # noqa: F811
    tmp_path: Path,
) -> None:
    ca = trustme.CA()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued = ca.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    tls = ("--api-tls-cert", str(cert), "--api-tls-key", str(key))
    async with started(temporal_env, stack, pool.handle.id, *tls) as gateway:
        port, token = gateway.port, gateway.tokens[0]

        async def served() -> None:
            members = await asyncio.to_thread(
                call, port, "GET", "/v1/members", token=token, context=trusting
            )
            assert members.status == 200

        # Connections that have not finished their handshake count against their address.
        await only_the_excess_is_closed(port, "127.0.0.6", served)
        # And one that never starts it is cut by the first byte's deadline.
        silent = connect_from("127.0.0.7", port)
        try:
            await wait_for(lambda: closed_by_peer(silent), "the silent client cut", CUT_WITHIN)
        finally:
            silent.close()
        await served()
