"""The router in this process, on real sockets: what it does with more than it can hold."""

from __future__ import annotations

import asyncio
import base64
import io
import json

from gateway.metrics import MemberNames
from gateway.router import Router, answer
from gateway.routing import STAND_IN
from gateway.sessions import Carrier, SessionMap, record_router_line
from squid.gateway import GatewayMember
from tests.helpers.waiting import wait_for


async def connect(port: int, username: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client's connection to the router at `port`, its CONNECT sent as `username`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    login = base64.b64encode(f"{username}:password".encode()).decode()
    writer.write(f"CONNECT a:443 HTTP/1.1\r\nProxy-Authorization: Basic {login}\r\n\r\n".encode())
    return reader, writer


async def test_connections_past_its_descriptors_are_refused_and_the_rest_kept() -> None:
    router = Router("proxy", "password", None, io.StringIO())
    router.max_connections = 2
    server = await asyncio.start_server(router.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await wait_for(lambda: router.connections == 2, "the router to take both")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b"", "the third is closed at once"
        writer.close()
        # The two held ones are still served: a CONNECT without credentials gets its 407.
        for held_reader, held_writer in held:
            held_writer.write(b"CONNECT a:443 HTTP/1.1\r\n\r\n")
            assert (await asyncio.wait_for(held_reader.readline(), 5)).startswith(b"HTTP/1.1 407 ")
            held_writer.close()


async def test_a_tunnel_a_stand_in_answers_after_its_pool_woke_counts_for_that_pool() -> None:
    """The holder answers a held CONNECT only once the pool has a member, by when the
    member list without the stand-in may have reached the router: the tunnel is the
    pool's demand all the same (the pool would otherwise be sized without it)."""
    router = Router("proxy", "password", None, io.StringIO())
    held, woke = asyncio.Event(), asyncio.Event()

    async def holder(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        held.set()
        await woke.wait()
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await reader.read()  # hold the tunnel until the client closes it
        writer.close()

    stand_in_server = await asyncio.start_server(holder, "127.0.0.1", 0)
    stand_in_port = stand_in_server.sockets[0].getsockname()[1]
    stand_in = GatewayMember(f"{STAND_IN}pool-a", "127.0.0.1", stand_in_port)
    router.update([stand_in], {stand_in.member: "pool-a"})
    server = await asyncio.start_server(router.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, stand_in_server:
        reader, writer = await connect(port, "proxy")
        await asyncio.wait_for(held.wait(), 10)
        # The pool woke: its member replaces the stand-in before the holder answers.
        member = GatewayMember("pool-a/0", "127.0.0.1", 1)
        router.update([member], {member.member: "pool-a"})
        woke.set()
        answer = await asyncio.wait_for(reader.readline(), 10)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        await wait_for(lambda: router.granted == 1, "the tunnel granted")
        count, _, pools = router.tunnels().removeprefix("tunnels ").partition(" ")
        assert (count, json.loads(pools)) == ("1", {"pool-a": [1, 1]})
        writer.close()


def listed(n: int, host: str = "10.0.0.1") -> dict[str, object]:
    return {"member": f"pool-a/{n}", "host": host, "port": 3128 + n, "pool": "pool-a"}


def told(router: Router, message: object) -> str:
    return answer(router, json.dumps(message).encode() + b"\n")


def test_a_change_applies_only_to_the_members_it_was_made_from_and_a_resync_heals() -> None:
    """A change made from other members than the router's (a line lost before it, or a
    router started since) or a line it cannot read changes nothing and asks for the
    members whole; whole, they replace whatever the router had."""
    router = Router("proxy", "password", None, io.StringIO())
    assert told(router, {"change": {"after": None, "generation": 1, "in": [], "out": []}}) == (
        "resync"
    ), "a router that has no members whole yet applies no change"
    assert told(router, {"members": [listed(0), listed(1)], "generation": 1}) == "members 2 1"
    change = {"after": 1, "generation": 2, "in": [listed(2)], "out": ["pool-a/0"]}
    assert told(router, {"change": change}) == "members 2 2"
    assert [m.member for m in router.members.members] == ["pool-a/1", "pool-a/2"]

    # The change to generation 3 was lost: the one made from it is not applied.
    lost_after = {"after": 3, "generation": 4, "in": [listed(3)], "out": ["pool-a/1"]}
    garbled = json.dumps({"change": change})[:-9].encode() + b"\n"
    bad_port = {"change": {**change, "after": 2, "in": [listed(3) | {"port": "x"}]}}
    assert told(router, {"change": lost_after}) == "resync"
    assert answer(router, garbled) == "resync"
    assert told(router, bad_port) == "resync"
    assert told(router, ["members"]) == "resync"
    assert [m.member for m in router.members.members] == ["pool-a/1", "pool-a/2"]
    assert router.generation == 2

    # Whole, the members are the gateway's again, and changes from them apply.
    whole = [listed(1, "10.0.0.9"), listed(3)]
    assert told(router, {"members": whole, "generation": 5}) == "members 2 5"
    change = {"after": 5, "generation": 6, "in": [listed(4)], "out": ["pool-a/3"]}
    assert told(router, {"change": change}) == "members 2 6"
    assert [(m.member, m.host) for m in router.members.members] == [
        ("pool-a/1", "10.0.0.9"),
        ("pool-a/4", "10.0.0.1"),
    ]
    held = {"member": f"{STAND_IN}pool-b", "host": "127.0.0.1", "port": 4000, "pool": "pool-b"}
    change = {"after": 6, "generation": 7, "in": [], "out": [], "stand_ins": [held]}
    assert told(router, {"change": change}) == "members 3 7"
    assert [m.member for m in router.members.stand_ins] == [f"{STAND_IN}pool-b"]


async def test_a_session_tunnel_names_its_carrier_while_it_is_still_open() -> None:
    """A crawler keeps its tunnel open and reports a ban on it meanwhile: by the time the
    client has its 200, the router's log names the member that granted the tunnel, and the
    session map (the API's source for a ban by session) reads that member and endpoint."""
    log = io.StringIO()
    router = Router("proxy", "password", None, log)

    async def member_squid(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await reader.read()  # hold the tunnel until the client closes it
        writer.close()

    member_server = await asyncio.start_server(member_squid, "127.0.0.1", 0)
    member = GatewayMember("pool-a/1", "127.0.0.1", member_server.sockets[0].getsockname()[1])
    router.update([member], {member.member: "pool-a"})
    names, sessions = MemberNames(), SessionMap()
    names.add(member.member)
    server = await asyncio.start_server(router.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, member_server:
        reader, writer = await connect(port, "proxy-session-shop-1")
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 200 ")
        for line in log.getvalue().splitlines():
            record_router_line(line, names, sessions)
        carrier = sessions.get("shop-1")
        assert carrier == Carrier("pool-a/1", f"127.0.0.1:{member.port}", "proxy-session-shop-1")
        writer.close()
