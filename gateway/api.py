"""The gateway's control API: members, session lookups and bans, for scrapers.

    GET  /healthz                 no token; {"status": "ok"}
    GET  /readyz                  no token; {"status": "ready"}, or 503 and the reason
    GET  /metrics                 the gateway's Prometheus metrics
    GET  /v1/members              the pool's members, each with the sessions it carried last
    GET  /v1/sessions/<key>       which member that session goes to (gateway/sessions.py)
    POST /v1/bans                 {"member": ...} or {"session": ...}, and a "reason"

Every path but /healthz and /readyz takes `Authorization: Bearer <token>`, a token of
the tokens file (gateway/api_tokens.py); anything else is 401 with nothing
but `WWW-Authenticate: Bearer`, whatever the path. Each token has its own
token bucket (`--api-rate` per second, `--api-burst`); over it, 429. A ban is
forwarded to the pool's `report_ban`, whose own rate limit stays the judge.
Errors are `{"error": "<what, naming the field>"}`.

A small HTTP/1.1 server on asyncio, one request per connection: it is read
under deadlines counted from the connect (FIRST_BYTE_SECONDS to the request's
first byte, a TLS handshake included; HEAD_SECONDS to the end of its
headers; BODY_SECONDS more for the body), with bounded headers
(MAX_HEAD_BYTES) and body (MAX_BODY_BYTES), so a slow or hostile client
holds a connection for seconds. A client address (an IPv6 /64) holds at most
`per_client` connections, and all together at most MAX_CONNECTIONS: at that
bound a newcomer takes the place of the oldest connection no token has
vouched for, of the address holding the most. So sockets that never send a
token, from one address or a few, cannot keep a token holder out; only
an attacker with about MAX_CONNECTIONS addresses, reconnecting faster than
a client sends its head, still can (docs/gateway-api.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

from prometheus_client import REGISTRY, generate_latest

from gateway.api_tokens import TokenStore
from proxy_operator.username import SESSION_KEY

log = logging.getLogger("proxy_operator.gateway")

MAX_HEAD_BYTES = 8192
MAX_BODY_BYTES = 16 * 1024
# Both from the connect: a client that means to ask sends its head at once.
FIRST_BYTE_SECONDS = 3.0
HEAD_SECONDS = 5.0
BODY_SECONDS = 10.0
WRITE_SECONDS = 10.0
MAX_CONNECTIONS = 128
DEFAULT_PER_CLIENT = 16
# One address may hold no more than half of MAX_CONNECTIONS (gateway/api_settings.py).
MAX_PER_CLIENT = MAX_CONNECTIONS // 2
# An IPv6 client is its /64: one host is commonly given a whole /64 to pick from.
IPV6_CLIENT_PREFIX = 64
MAX_REASON = 200
MAX_MEMBER = 300
# Python's http.server's bound, for the same reason: a header flood is not a request.
MAX_HEADERS = 100
BEARER = "bearer"
SESSIONS_PREFIX = "/v1/sessions/"
JSON_TYPE = "application/json"


class ApiError(Exception):
    """An answer other than success: its status and the message for `{"error": ...}`."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Pool(Protocol):
    """What the API asks of the pool behind the gateway (gateway/api_pool.py)."""

    async def members(self) -> dict[str, Any]:
        """The `/v1/members` answer."""

    def session_member(self, key: str) -> str | None:
        """The member session `key` goes to now, if any member can carry it."""

    async def ban(self, *, member: str | None, session: str | None, reason: str) -> str:
        """Forward a ban to the pool's `report_ban`; the banned member's id, or ApiError."""


@dataclass
class TokenBucket:
    """`rate` requests a second, up to `burst` at once."""

    rate: float
    burst: float
    tokens: float = field(init=False)
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""


Handler = Callable[[Request], Awaitable[tuple[HTTPStatus, bytes, str]]]


@dataclass(eq=False)
class Connection:
    """One open connection: whose, how old, and whether a token vouched for it.

    A connection no token vouched for (still sending its head, or anonymous)
    is what gives way when every slot is taken; a token holder's request,
    waiting on the pool, is not cut for a stranger.
    """

    client: str
    order: int
    task: asyncio.Task[None] | None
    vouched: bool = False
    evicted: bool = False


def client_of(peer: object) -> str:
    """The address a connection counts against: its IP, or an IPv6 client's /64."""
    host = peer[0] if isinstance(peer, tuple) and peer else ""
    try:
        address = ipaddress.ip_address(str(host).partition("%")[0])
    except ValueError:
        return str(host)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/{IPV6_CLIENT_PREFIX}", strict=False))
    return str(address)


class ControlApi:
    """Serves the control API on one address; `start` binds it, `close` stops it."""

    def __init__(
        self,
        pool: Pool,
        tokens: TokenStore,
        *,
        rate: float,
        burst: int,
        tls: ssl.SSLContext | None = None,
        per_client: int = DEFAULT_PER_CLIENT,
        readiness: Callable[[], str | None] = lambda: None,
    ) -> None:
        """`readiness` says why the gateway should not be sent clients (gateway/health.py),
        None when it should; /readyz answers it."""
        self._pool = pool
        self._readiness = readiness
        self._tokens = tokens
        self._rate = rate
        self._burst = burst
        self._tls = tls
        self._per_client = per_client
        self._buckets: dict[bytes, TokenBucket] = {}
        # Each client's open connections, oldest first; and how many in all.
        self._open: dict[str, list[Connection]] = {}
        self._connections = 0
        self._order = itertools.count()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        # TLS is started per connection (`_read_head`), so a handshake is counted
        # against its client and held to the first byte's deadline like any head.
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
        scheme = "https" if self._tls else "http"
        log.info("control API on %s://%s:%d", scheme, host, port)

    def reload_tokens(self) -> None:
        self._tokens.reload()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), WRITE_SECONDS)

    # ---- one connection -------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = self._admit(client_of(writer.get_extra_info("peername")))
        if connection is None:
            writer.close()  # over a bound: refused at once, no answer to wait for
            return
        try:
            status, body, content_type, extra = await self._answer(reader, writer, connection)
            await self._write(writer, status, body, content_type, extra)
        except (OSError, TimeoutError, ssl.SSLError):
            pass  # the client left or stalled: nothing to answer
        except asyncio.CancelledError:
            if not connection.evicted:
                raise
            # Its place went to a newcomer (`_evict`): the connection just closes.
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
        finally:
            self._forget(connection)
            writer.close()
            with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
                await asyncio.wait_for(writer.wait_closed(), WRITE_SECONDS)

    def _admit(self, client: str) -> Connection | None:
        """A place for a new connection from `client`; None over its own bound, or when
        every place is taken by connections a token vouched for."""
        if len(self._open.get(client, ())) >= self._per_client:
            return None
        if self._connections >= MAX_CONNECTIONS and not self._evict():
            return None
        connection = Connection(client, next(self._order), asyncio.current_task())
        self._open.setdefault(client, []).append(connection)
        self._connections += 1
        return connection

    def _evict(self) -> bool:
        """Make one place: cut the oldest connection no token vouched for, of the
        client holding the most connections. False if there is none to cut."""
        oldest = [
            (len(held), -unvouched[0].order, unvouched[0])
            for held in self._open.values()
            if (unvouched := [c for c in held if not c.vouched])
        ]
        if not oldest:
            return False
        victim = max(oldest, key=lambda entry: entry[:2])[2]
        victim.evicted = True
        self._forget(victim)
        if victim.task is not None:
            victim.task.cancel()
        return True

    def _forget(self, connection: Connection) -> None:
        held = self._open.get(connection.client, [])
        if connection in held:
            held.remove(connection)
            self._connections -= 1
            if not held:
                del self._open[connection.client]

    async def _read_head(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        """The request line and headers, TLS first if the API has it, under both deadlines."""
        async with asyncio.timeout(HEAD_SECONDS):
            async with asyncio.timeout(FIRST_BYTE_SECONDS):
                if self._tls is not None:
                    await writer.start_tls(self._tls)
                first = await reader.readexactly(1)
            if not first.isalpha():  # a request line starts with its method
                raise ApiError(HTTPStatus.BAD_REQUEST, "request line: not `METHOD /path HTTP/1.1`")
            return first + await reader.readuntil(b"\r\n\r\n")

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: Connection
    ) -> tuple[HTTPStatus, bytes, str, dict[str, str]]:
        try:
            request = _parse_head(await self._read_head(reader, writer))
            handler = self._authorized(request, connection)
            request = await _with_body(reader, request)
            status, body, content_type = await handler(request)
            return status, body, content_type, {}
        except ApiError as err:
            extra = {"WWW-Authenticate": "Bearer"} if err.status == HTTPStatus.UNAUTHORIZED else {}
            return err.status, _json({"error": err.message}), JSON_TYPE, extra
        except asyncio.LimitOverrunError:
            error = {"error": f"request head: longer than {MAX_HEAD_BYTES} bytes"}
            return HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, _json(error), JSON_TYPE, {}
        except asyncio.IncompleteReadError as err:
            raise OSError("the client closed the connection") from err
        except OSError:  # TimeoutError among them: a client too slow, or gone
            raise
        except Exception:  # a handler's bug: a 500 and a log line, never a traceback to the client
            log.exception("control API request failed")
            error = {"error": "internal error (logged by the gateway)"}
            return HTTPStatus.INTERNAL_SERVER_ERROR, _json(error), JSON_TYPE, {}

    def _authorized(self, request: Request, connection: Connection) -> Handler:
        """The request's handler, once its token and rate allow it; ApiError otherwise."""
        if request.path == "/healthz":
            return _method(request, "GET", _healthz)
        if request.path == "/readyz":
            return _method(request, "GET", self._readyz)
        digest = self._tokens.match(_bearer(request.headers.get("authorization", "")))
        if digest is None:
            raise ApiError(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required")
        connection.vouched = True
        bucket = self._buckets.setdefault(digest, TokenBucket(self._rate, self._burst))
        if not bucket.take():
            raise ApiError(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"rate limit: {self._rate:g} requests a second per token (burst {self._burst})",
            )
        if request.path == "/metrics":
            return _method(request, "GET", _metrics)
        if request.path == "/v1/members":
            return _method(request, "GET", self._members)
        if request.path.startswith(SESSIONS_PREFIX):
            return _method(request, "GET", self._session)
        if request.path == "/v1/bans":
            return _method(request, "POST", self._ban)
        raise ApiError(HTTPStatus.NOT_FOUND, f"path: no {request.path[:100]!r} here")

    async def _write(
        self,
        writer: asyncio.StreamWriter,
        status: HTTPStatus,
        body: bytes,
        content_type: str,
        extra: dict[str, str],
    ) -> None:
        headers = {
            "Content-Type": content_type,
            "Content-Length": str(len(body)),
            "Cache-Control": "no-store",
            "Connection": "close",
            **extra,
        }
        head = f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        writer.write(head.encode() + b"\r\n" + body)
        await asyncio.wait_for(writer.drain(), WRITE_SECONDS)

    # ---- the endpoints ----------------------------------------------------------------

    async def _readyz(self, _: Request) -> tuple[HTTPStatus, bytes, str]:
        reason = self._readiness()
        if reason is None:
            return HTTPStatus.OK, _json({"status": "ready"}), JSON_TYPE
        answer = {"status": "not ready", "reason": reason}
        return HTTPStatus.SERVICE_UNAVAILABLE, _json(answer), JSON_TYPE

    async def _members(self, _: Request) -> tuple[HTTPStatus, bytes, str]:
        return HTTPStatus.OK, _json(await self._pool.members()), JSON_TYPE

    async def _session(self, request: Request) -> tuple[HTTPStatus, bytes, str]:
        key = request.path.removeprefix(SESSIONS_PREFIX)
        if not SESSION_KEY.fullmatch(key):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                "session: a key is 1 to 128 of A-Z a-z 0-9 . _ ~ + = -",
            )
        member = self._pool.session_member(key)
        if member is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"session: no member for {key!r} now")
        return HTTPStatus.OK, _json({"session": key, "member": member}), JSON_TYPE

    async def _ban(self, request: Request) -> tuple[HTTPStatus, bytes, str]:
        member, session, reason = parse_ban(request.body)
        banned = await self._pool.ban(member=member, session=session, reason=reason)
        return HTTPStatus.ACCEPTED, _json({"member": banned, "accepted": True}), JSON_TYPE


def parse_ban(body: bytes) -> tuple[str | None, str | None, str]:
    """A ban request's member or session, and reason; ApiError 400 naming the field."""

    def bad(message: str) -> ApiError:
        return ApiError(HTTPStatus.BAD_REQUEST, message)

    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise bad(f"body: not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise bad('body: a JSON object, {"member": ...} or {"session": ...}, and "reason"')
    unknown = sorted(set(raw) - {"member", "session", "reason"})
    if unknown:
        raise bad(f"{unknown[0][:50]}: not a field (member, session, reason)")
    member, session, reason = raw.get("member"), raw.get("session"), raw.get("reason", "")
    if (member is None) == (session is None):
        raise bad("member, session: give exactly one")
    if member is not None and not (
        isinstance(member, str) and 0 < len(member) <= MAX_MEMBER and member.isprintable()
    ):
        raise bad(f"member: a member id, 1 to {MAX_MEMBER} printable characters")
    if session is not None and not (isinstance(session, str) and SESSION_KEY.fullmatch(session)):
        raise bad("session: a key is 1 to 128 of A-Z a-z 0-9 . _ ~ + = -")
    if not isinstance(reason, str) or len(reason) > MAX_REASON or not reason.isprintable():
        raise bad(f"reason: text of at most {MAX_REASON} printable characters")
    return member, session, reason


def _parse_head(head: bytes) -> Request:
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise ApiError(HTTPStatus.BAD_REQUEST, "request head: not ASCII") from None
    request_line, *lines = text.removesuffix("\r\n\r\n").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        raise ApiError(HTTPStatus.BAD_REQUEST, "request line: not `METHOD /path HTTP/1.1`")
    if len(lines) > MAX_HEADERS:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"headers: more than {MAX_HEADERS}")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        name = name.lower()
        if not sep or not name or name != name.strip():
            raise ApiError(HTTPStatus.BAD_REQUEST, "headers: a line that is not `Name: value`")
        if name in headers and name in ("authorization", "content-length"):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{name}: given twice")
        headers[name] = value.strip()
    path = parts[1].partition("?")[0]
    return Request(parts[0], path, headers)


async def _with_body(reader: asyncio.StreamReader, request: Request) -> Request:
    """`request` with its body read (Content-Length only; no chunked bodies)."""
    if "transfer-encoding" in request.headers:
        raise ApiError(HTTPStatus.BAD_REQUEST, "transfer-encoding: not taken; send Content-Length")
    length_text = request.headers.get("content-length", "0")
    if not length_text.isdigit() or len(length_text) > 12:
        raise ApiError(HTTPStatus.BAD_REQUEST, "content-length: not a number of bytes")
    length = int(length_text)
    if length > MAX_BODY_BYTES:
        raise ApiError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body: larger than {MAX_BODY_BYTES} bytes"
        )
    if length == 0:
        return request
    async with asyncio.timeout(BODY_SECONDS):
        body = await reader.readexactly(length)
    return Request(request.method, request.path, request.headers, body)


def _bearer(header: str) -> str:
    """The token of `Bearer <token>`; "" for anything else, which no token matches."""
    scheme, _, token = header.partition(" ")
    return token if scheme.lower() == BEARER and token and " " not in token else ""


def _method(request: Request, method: str, handler: Handler) -> Handler:
    if request.method != method:
        raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"method: {request.path} takes {method} only")
    return handler


async def _healthz(_: Request) -> tuple[HTTPStatus, bytes, str]:
    return HTTPStatus.OK, _json({"status": "ok"}), JSON_TYPE


async def _metrics(_: Request) -> tuple[HTTPStatus, bytes, str]:
    return HTTPStatus.OK, generate_latest(REGISTRY), "text/plain; version=0.0.4; charset=utf-8"


def _json(value: Any) -> bytes:
    """A body of one JSON line: ended by a newline, so curl's next line starts on its own."""
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"
