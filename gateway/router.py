"""The gateway's router: takes the front's CONNECTs, checks who asks, picks a member, relays.

    client -> Squid (the front: the proxies' rules) -> router (loopback) -> pool member

    python3 router.py LISTEN_PORT ACCESS_LOG FLEET_USER [--users FILE]
    stdin:  {"password": "..."}              once, first: the fleet's password
            {"members": [{...}, ...], "generation": <g>}
                                             the members in rotation, whole: at start
                                             and to resync
            {"change": {"after": <g0>, "generation": <g>, "in": [{...}, ...],
                        "out": ["<member>", ...], "stand_ins": [{...}, ...]}}
                                             one change to generation <g0>'s members
            {"tunnels": null}                the tunnels members granted, per pool
    stdout: "listening", then "members <n> <g>" once generation <g> is in force
            (<n> members and stand-ins), "resync" for a change it did not apply,
            and 'tunnels <n> {"<pool>": [<open>, <granted>], ...}' to each question

A member is `{"member", "host", "port"}`, optionally with the `"zone"`,
`"region"` and `"provider"` filters match and the `"pool"` its tunnels count
for. A change's `in` are members new or with new fields, `out` the ids that
leave, and `stand_ins`, only when they changed, the stand-ins whole, in
order. The router applies a change only to the generation it was made from
(`after`), and a line it cannot read not at all: either way it keeps its
members and answers "resync", for which the gateway sends them whole. So a
line lost, garbled or sent to a router started since can cost a resync,
never a drifted index.

A tunnels answer gives the tunnels open now that a member granted
(answered 200), all of them and per pool, and per pool the tunnels granted
since the router started: the gateway's demand, each pool's own
(gateway/demand.py). A pool none of whose members has granted a tunnel is
not listed.

A membership change is applied to an in-memory index (gateway/routing.py)
in place, between two requests, at a cost of what it touches: nothing
reloads, no client waits, and a tunnel to a member that left keeps flowing
until either end closes it (the pool drains a leaving member for
`drain_seconds`). Choosing a member costs the same at 10 members as at
10,000, and so does a change of one member in and one out.

For each CONNECT the front passes on (with the client's credentials):

- the credentials: the fleet's (every username form of the fleet's USER,
  proxy_operator.username.parse_gateway_username) or a users-file user's (its
  scrypt hash, gateway/users.py, checked in a thread of its own and
  remembered while the file stays the same); anything else 407;
- a users-file user's `zones=` and `tunnels=` (open tunnels counted here,
  where they open and close: 429 at the limit);
- the member: gateway/routing.py's order; a member that refuses or does not
  answer within MEMBER_CONNECT_TIMEOUT is tried no more for this request,
  the next one is; MEMBER_CONNECT_FAIL_LIMIT failures in a row and it is
  skipped until a probe finds it answering; none to try: 503
  (ERR_GATEWAY_NO_MEMBER) and the request goes nowhere;
- the CONNECT goes to the member with the fleet's credentials, the member's
  answer goes back as it came, and on 200 the bytes flow both ways.

Every CONNECT ends with one access log line in GATEWAY_LOG_FORMAT's fields,
the member named by its route's peer name, which the gateway's metrics and
session map read (gateway/metrics.py, gateway/sessions.py). A session's
tunnel also gets a line when its member grants it, of kind TUNNEL_OPENED,
written before the client sees the 200: by the time a client can report a
ban on that session, the gateway can read which member carried it, however
long the tunnel stays open (rotate and pin tunnels get none: nothing asks).

It holds the fleet's password, from its standard input (never its
environment or arguments), and runs as Squid's user, started by the
gateway (gateway/squid.py), which it outlives by nothing: it exits when its
standard input closes. Standard library only, run from a copy the gateway
makes where Squid's user reads it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import resource
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

# Run as a script: the copy's root holds gateway/ and providers/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.relay import HEAD_TIMEOUT, read_head, relay
from gateway.routing import Members
from gateway.users import Checker, Verdict
from proxy_operator.username import GatewayUsername, parse_gateway_username
from squid.gateway import (
    MEMBER_CONNECT_FAIL_LIMIT,
    MEMBER_CONNECT_TIMEOUT,
    NO_MEMBER_PAGE,
    NO_MEMBER_STATUS,
    NO_MEMBER_TEMPLATE,
    REALM,
    ROUTER_RESYNC,
    TUNNEL_LIMIT_PAGE,
    TUNNEL_LIMIT_STATUS,
    TUNNEL_LIMIT_TEMPLATE,
    TUNNEL_OPENED,
    TUNNEL_REFUSED_HEADER,
    GatewayMember,
    Route,
    fleet_login,
    peer_name,
)

# A member answers a CONNECT once its own connect to the origin is done or
# given up (Squid's connect_timeout is a minute).
ANSWER_TIMEOUT = 75.0
# Members one request is tried on before it fails, as forward_max_tries.
MAX_TRIES = 10
PROBE_SECONDS = 1.0
# Descriptors kept for the log, stdin and the rest; each connection takes two
# (the client's and its member's).
DESCRIPTORS_KEPT = 32
# Left as they are in a log field: what a username, host:port or method is made of.
LOG_SAFE = "-._~+=/:@[]"


@dataclass
class Health:
    """A member's connect failures in a row, and whether it is skipped for them."""

    failures: int = 0
    probing: asyncio.Task[None] | None = None


class Router:
    """The listening router: credentials, limits, members; see the module docstring."""

    def __init__(self, user: str, password: str, users: str | None, log: TextIO) -> None:
        """`users`: the users file's path, or None for the fleet's credentials alone."""
        self._credentials = Checker(user, password, users)
        # One scrypt check at a time, off the event loop: a check takes tens of ms.
        self._checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="credentials")
        self._log = log
        self.members = Members(())
        # The gateway's generation of the members in force; None until it sends them whole.
        self.generation: int | None = None
        self._health: dict[str, Health] = {}
        self._tunnels: Counter[str] = Counter()
        self.connections = 0
        # Tunnels open now that a member granted (answered 200): the gateway's demand.
        self.granted = 0
        # Each member's pool, and per pool the tunnels open now and granted since start.
        self._pool_of: dict[str, str] = {}
        self._open_by_pool: Counter[str] = Counter()
        self._granted_by_pool: Counter[str] = Counter()
        self.max_connections = _descriptors() // 2 - DESCRIPTORS_KEPT
        self._login = fleet_login(user, password)

    def update(
        self, members: list[GatewayMember], pools: dict[str, str], generation: int | None = None
    ) -> None:
        """The members in rotation from now on, whole (`pools`: each one's pool), as of
        `generation`; a member that left keeps its open tunnels, still counted for its pool."""
        self.members = Members(members)
        self._pool_of = pools
        self.generation = generation
        for gone in self._health.keys() - self.members.by_id.keys():
            self._forget(gone)

    def change(
        self,
        entering: list[GatewayMember],
        leaving: list[str],
        stand_ins: list[GatewayMember] | None,
        pools: dict[str, str],
        generation: int,
    ) -> None:
        """One change to the members in rotation (Members.change), as of `generation`;
        `pools`: the pools of those entering and of the stand-ins given."""
        if stand_ins is not None:
            for stand_in in self.members.stand_ins:
                self._pool_of.pop(stand_in.member, None)
        self.members.change(entering, leaving, stand_ins)
        for gone in leaving:
            if gone not in self.members.by_id:
                self._pool_of.pop(gone, None)
                self._forget(gone)
        self._pool_of.update(pools)
        self.generation = generation

    def _forget(self, member: str) -> None:
        """Drop a member's health: it left rotation."""
        health = self._health.pop(member, None)
        if health is not None and health.probing is not None:
            health.probing.cancel()

    @property
    def routed(self) -> int:
        """The members in rotation and the stand-ins: the count a change's answer gives."""
        return len(self.members.by_id) + len(self.members.stand_ins)

    # ---- one CONNECT --------------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        started = time.time()
        record: list[str] = []
        if self.connections >= self.max_connections:
            writer.close()  # past what its descriptors allow: refused, nothing else hurt
            return
        self.connections += 1
        try:
            head = await asyncio.wait_for(read_head(reader), HEAD_TIMEOUT)
            if head is None:
                return  # the front's probe (a connect alone), or too much
            await self._connect(head, reader, writer, record)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            self.connections -= 1
            writer.close()
            if record:
                self._write_log(started, record)

    async def _connect(
        self,
        head: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        record: list[str],
    ) -> None:
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target = rest.partition(" ")[0]
        username, password = _credentials(lines[1:])
        record[:] = ["-", "-", "-", "-", _logged(method), _logged(target), _logged(username)]
        if method != "CONNECT" or not target:
            await _answer(writer, record, 405, "Method Not Allowed", "CONNECT only.\n")
            return
        verdict = await self._check(username, password)
        if verdict is None or verdict.account is None:
            refusal = verdict.refusal if verdict is not None and verdict.refusal else "refused"
            await _answer(
                writer,
                record,
                407,
                "Proxy Authentication Required",
                f"Credentials {refusal}.\n",
                [f'Proxy-Authenticate: Basic realm="{REALM}"'],
            )
            return
        parsed = parse_gateway_username(username, verdict.account)
        assert parsed is not None, "a verdict names the account the username parsed for"
        account = verdict.account
        if verdict.tunnels is not None and self._tunnels[account] >= verdict.tunnels:
            held = self._tunnels[account]
            reason = (
                f"{account} holds {held} open tunnel{'s' if held != 1 else ''}, "
                f"its limit is tunnels={verdict.tunnels}"
            )
            await _answer(
                writer,
                record,
                TUNNEL_LIMIT_STATUS,
                "Too Many Requests",
                TUNNEL_LIMIT_PAGE.replace("%o", reason),
                [
                    f"X-Squid-Error: {TUNNEL_LIMIT_STATUS}:{TUNNEL_LIMIT_TEMPLATE} 0",
                    f"{TUNNEL_REFUSED_HEADER}: {reason}",
                ],
            )
            return
        self._tunnels[account] += 1
        try:
            await self._forward(head, username, parsed, reader, writer, record)
        finally:
            self._tunnels[account] -= 1
            if not self._tunnels[account]:
                del self._tunnels[account]

    async def _forward(
        self,
        head: bytes,
        username: str,
        parsed: GatewayUsername,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        record: list[str],
    ) -> None:
        route = Route.PIN if parsed.pin else Route.SESSION if parsed.session else Route.ROTATE
        tried = 0
        for member in self._candidates(username, parsed):
            if tried == MAX_TRIES:
                break
            tried += 1
            # Its pool as routed: a stand-in answers only once its pool has woken, by
            # when the member list that replaced it may have come.
            pool = self._pool_of.get(member.member, "")
            asked = await self._ask(member, head)
            if asked is None:
                continue
            member_reader, member_writer, answer = asked
            peer = peer_name(member.member, route)
            record[0:4] = [_status(answer), peer, member.host, str(member.port)]
            if record[0] == "200" and route is Route.SESSION:
                self._write_log(time.time(), record, TUNNEL_OPENED)
            try:
                writer.write(answer)
                await writer.drain()
                if record[0] == "200":
                    self.granted += 1
                    self._open_by_pool[pool] += 1
                    self._granted_by_pool[pool] += 1
                    try:
                        await relay(reader, writer, member_reader, member_writer)
                    finally:
                        self.granted -= 1
                        self._open_by_pool[pool] -= 1
            finally:
                member_writer.close()
            return
        if tried:
            await _answer(
                writer, record, 503, "Service Unavailable", "No member answered.\n",
                ["X-Squid-Error: ERR_CONNECT_FAIL 111"],
            )  # fmt: skip
            return
        await _answer(
            writer,
            record,
            NO_MEMBER_STATUS,
            "Service Unavailable",
            NO_MEMBER_PAGE,
            [f"X-Squid-Error: {NO_MEMBER_STATUS}:{NO_MEMBER_TEMPLATE} 0"],
        )

    def _candidates(self, username: str, parsed: GatewayUsername) -> Iterator[GatewayMember]:
        """The route's order, members skipped for their failures last (a stale skip costs
        a try, never the request)."""
        skipped = []
        for member in self.members.order(username, parsed):
            health = self._health.get(member.member)
            if health is not None and health.probing is not None:
                skipped.append(member)
            else:
                yield member
        yield from skipped

    async def _ask(
        self, member: GatewayMember, head: bytes
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes] | None:
        """`member`'s connection and its answer to the CONNECT, or None (counted against it)
        if it refuses, is silent, or closes before it answers: nothing has reached the
        client yet, so the next member may take the request."""
        try:
            member_reader, member_writer = await asyncio.wait_for(
                asyncio.open_connection(member.host, member.port), MEMBER_CONNECT_TIMEOUT
            )
        except (OSError, TimeoutError):
            self._failed(member)
            return None
        try:
            member_writer.write(_member_head(head, self._login))
            await member_writer.drain()
            answer = await asyncio.wait_for(member_reader.readuntil(b"\r\n\r\n"), ANSWER_TIMEOUT)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            member_writer.close()
            self._failed(member)  # died under the request (a killed Squid accepts, then resets)
            return None
        except BaseException:
            member_writer.close()
            raise
        health = self._health.pop(member.member, None)
        if health is not None and health.probing is not None:
            health.probing.cancel()
        return member_reader, member_writer, answer

    def _failed(self, member: GatewayMember) -> None:
        if member.member not in self.members.by_id:
            return  # left the pool meanwhile
        health = self._health.setdefault(member.member, Health())
        health.failures += 1
        if health.failures >= MEMBER_CONNECT_FAIL_LIMIT and health.probing is None:
            health.probing = asyncio.create_task(self._probe(member))

    async def _probe(self, member: GatewayMember) -> None:
        """Connect to a skipped member every PROBE_SECONDS until it answers; then use it again."""
        while True:
            await asyncio.sleep(PROBE_SECONDS)
            with contextlib.suppress(OSError, TimeoutError):
                _, probe = await asyncio.wait_for(
                    asyncio.open_connection(member.host, member.port), MEMBER_CONNECT_TIMEOUT
                )
                probe.close()
                self._health.pop(member.member, None)
                return

    def tunnels(self) -> str:
        """The answer to a tunnels question (the module docstring)."""
        pools = {
            pool: [self._open_by_pool[pool], granted]
            for pool, granted in self._granted_by_pool.items()
        }
        return f"tunnels {self.granted} {json.dumps(pools, separators=(',', ':'))}"

    async def _check(self, username: str, password: str) -> Verdict | None:
        """Who `username` with `password` is, or None: no account has that username form."""
        if not username or not password:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._checks, self._credentials.check, username, password)

    def _write_log(self, started: float, record: list[str], kind: str | None = None) -> None:
        """One access log line: a CONNECT's when it ends, or a session tunnel's when granted
        (`kind` TUNNEL_OPENED; the module docstring)."""
        status, peer, host, port, method, target, username = record
        if kind is None:
            kind = "TCP_TUNNEL/FIRSTUP_PARENT" if peer != "-" else "TCP_DENIED/HIER_NONE"
        elapsed = round((time.time() - started) * 1000)
        self._log.write(
            f"{started:.3f} {elapsed} {status} {kind} {peer} {host} {port} "
            f"{method} {target} {username}\n"
        )
        self._log.flush()


def _descriptors() -> int:
    """The most descriptors this process may open, raised to the hard limit first: a tunnel
    holds two, and the usual soft limit of 1,024 would cap a gateway at 500 tunnels."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _logged(text: str) -> str:
    """`text` as one field of a log line: what a client sent may hold spaces or line
    breaks, which would forge fields or lines the metrics and the session map read."""
    return quote(text, safe=LOG_SAFE) if text else "-"


def _status(answer: bytes) -> str:
    """The status code of a member's answer head, "000" if it has none."""
    status = answer[9:12].decode("latin-1")
    return status if status.isdigit() else "000"


def _credentials(header_lines: list[str]) -> tuple[str, str]:
    """The Basic username and password of a head's Proxy-Authorization, or empty strings."""
    for line in header_lines:
        name, _, value = line.partition(":")
        if name.strip().lower() != "proxy-authorization":
            continue
        scheme, _, encoded = value.strip().partition(" ")
        if scheme.lower() != "basic":
            return "", ""
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return "", ""
        username, _, password = decoded.partition(":")
        return username, password
    return "", ""


def _member_head(head: bytes, login: str) -> bytes:
    """The client's CONNECT head with the fleet's credentials for its own."""
    lines = head.decode("latin-1").split("\r\n")
    kept = [
        line
        for line in lines[1:]
        if line and line.partition(":")[0].strip().lower() != "proxy-authorization"
    ]
    return "\r\n".join([lines[0], *kept, f"Proxy-Authorization: {login}", "", ""]).encode("latin-1")


async def _answer(
    writer: asyncio.StreamWriter,
    record: list[str],
    status: int,
    reason: str,
    page: str,
    headers: list[str] | None = None,
) -> None:
    """Refuse the request with `status`, as Squid writes its own errors, and close."""
    record[0] = str(status)
    body = page.encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        *(headers or []),
        "Content-Type: text/plain; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
        "",
        "",
    ]
    writer.write("\r\n".join(head).encode() + body)
    await writer.drain()


def answer(router: Router, line: bytes) -> str:
    """The router's answer to one line of its standard input after the password (the
    module docstring), applying it first; a line it cannot read changes nothing."""
    try:
        message = json.loads(line)
        if not isinstance(message, dict):
            return ROUTER_RESYNC
        if "tunnels" in message:
            return router.tunnels()
        if "members" in message:
            listed = message["members"]
            router.update([_member(f) for f in listed], _pools(listed), int(message["generation"]))
        else:
            change = message["change"]
            if change["after"] is None or change["after"] != router.generation:
                return ROUTER_RESYNC
            entering = [_member(fields) for fields in change["in"]]
            leaving = [str(member) for member in change["out"]]
            listed = change.get("stand_ins")
            stand_ins = None if listed is None else [_member(fields) for fields in listed]
            pools = _pools([*change["in"], *(listed or [])])
            router.change(entering, leaving, stand_ins, pools, int(change["generation"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return ROUTER_RESYNC
    return f"members {router.routed} {router.generation}"


def _pools(members: list[dict[str, Any]]) -> dict[str, str]:
    """Each member's pool, for those the message names one for."""
    return {str(m["member"]): str(m["pool"]) for m in members if m.get("pool") is not None}


def _member(fields: dict[str, Any]) -> GatewayMember:
    return GatewayMember(
        str(fields["member"]),
        str(fields["host"]),
        int(fields["port"]),
        fields.get("zone"),
        fields.get("region"),
        fields.get("provider"),
    )


async def _serve(port: int, log: TextIO, user: str, users: str | None) -> int:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader(limit=64 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    first = json.loads(await stdin.readline())
    router = Router(user, first["password"], users, log)
    server = await asyncio.start_server(router.serve, "127.0.0.1", port, backlog=1024)
    print("listening", flush=True)
    async with server:
        while line := await stdin.readline():
            print(answer(router, line), flush=True)
    return 0  # the gateway is gone


def main(argv: list[str]) -> int:
    args = argv[1:]
    if args == ["--check"]:
        return 0  # it imported: this interpreter runs it
    users = None
    if args[3:4] == ["--users"] and len(args) == 5:
        users, args = args[4], args[:3]
    if len(args) != 3 or not args[0].isdigit():
        print("usage: router.py LISTEN_PORT ACCESS_LOG FLEET_USER [--users FILE]", file=sys.stderr)
        return 2
    port, log_path, user = int(args[0]), args[1], args[2]
    with open(log_path, "a", encoding="utf-8") as log:
        return asyncio.run(_serve(port, log, user, users))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
