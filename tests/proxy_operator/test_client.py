"""GatewayClient against a stand-in of the gateway's control API (the contract in gateway/api.py).

The stand-in answers as the API documents: bearer token or 401, `/v1/members`,
`/v1/sessions/<key>` (404 when no member serves it), `POST /v1/bans`
(202, or 429 when the pool refuses); errors as `{"error": ...}`. The real
API is exercised end to end in tests/workflows/test_gateway_scrapy.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from proxy_operator.client import BanRefused, GatewayApiError, GatewayClient, Member
from proxy_operator.gateway_url import InvalidProxySetting
from tests.helpers.network import free_port

TOKEN = "tok-3b1e9f"
MEMBERS = {
    "pool": "web",
    "members": [
        {
            "member": "web/0",
            "state": "Ready",
            "zone": None,
            "region": None,
            "provider": "local",
            "exit_address": "127.0.0.1",
            "age_seconds": 12.5,
            "sessions": ["s1", "s2"],
        }
    ],
}


@dataclass
class StandIn:
    port: int
    bans: list[dict[str, Any]] = field(default_factory=list)
    refuse_bans: bool = False
    # Every request's method, path and Authorization header, as it came.
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/v1/members":
            self._answer(200, MEMBERS)
        elif self.path == "/v1/sessions/s1":
            self._answer(200, {"session": "s1", "member": "web/0"})
        else:
            self._answer(
                404, {"error": f"no member carried session {self.path.rsplit('/', 1)[1]!r}"}
            )

    def do_POST(self) -> None:
        if not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.server.stand_in.refuse_bans:
            self._answer(429, {"error": "ban rate limit: 1 bans accepted in the last 600s"})
            return
        self.server.stand_in.bans.append(body)
        self._answer(202, {"member": "web/0", "accepted": True})

    def _authorized(self) -> bool:
        self.server.stand_in.requests.append(
            (self.command, self.path, self.headers.get("Authorization"))
        )
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        self._answer(401, {"error": "unauthorized"})
        return False

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    stand_in: StandIn


@pytest.fixture
def api() -> Iterator[StandIn]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.stand_in = StandIn(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.stand_in
    server.shutdown()
    server.server_close()


def client(api: StandIn, token: str = TOKEN) -> GatewayClient:
    return GatewayClient(f"http://127.0.0.1:{api.port}/", token)


def test_members_and_sessions_are_read(api: StandIn) -> None:
    gateway = client(api)
    assert gateway.members() == [
        Member("web/0", "Ready", None, None, "local", "127.0.0.1", 12.5, ("s1", "s2"))
    ]
    assert gateway.session_member("s1") == "web/0"
    assert gateway.session_member("never-used") is None


def test_a_ban_is_posted_by_session_or_member(api: StandIn) -> None:
    gateway = client(api)
    assert gateway.report_ban(session="s1", reason="HTTP 403") == "web/0"
    assert gateway.report_ban(member="web/0", reason="captcha") == "web/0"
    assert api.bans == [
        {"session": "s1", "reason": "HTTP 403"},
        {"member": "web/0", "reason": "captcha"},
    ]


def test_a_refused_ban_is_ban_refused_with_the_pools_reason(api: StandIn) -> None:
    api.refuse_bans = True
    with pytest.raises(BanRefused) as raised:
        client(api).report_ban(session="s1", reason="HTTP 403")
    assert raised.value.status == 429
    assert "ban rate limit" in raised.value.message


def test_a_wrong_token_is_401_and_never_shown(api: StandIn) -> None:
    with pytest.raises(GatewayApiError) as raised:
        client(api, "wrong-token").members()
    assert raised.value.status == 401
    assert "wrong-token" not in str(raised.value) and "wrong-token" not in repr(client(api))


def test_an_unreachable_api_is_status_0_naming_the_address() -> None:
    gateway = GatewayClient(f"http://127.0.0.1:{free_port()}", TOKEN, timeout=5)
    with pytest.raises(GatewayApiError) as raised:
        gateway.members()
    assert raised.value.status == 0
    assert "127.0.0.1" in str(raised.value) and TOKEN not in str(raised.value)
    assert not gateway.healthy()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda g: g.report_ban(reason="x"), "member or session"),
        (lambda g: g.report_ban(member="web/0", session="s1", reason="x"), "member or session"),
        (lambda g: g.report_ban(session="s1", reason="x" * 201), "reason"),
        (lambda g: g.report_ban(session="s1", reason="line\nbreak"), "reason"),
        (lambda g: g.report_ban(session="a b", reason="x"), "session"),
        (lambda g: g.report_ban(member="web 0", reason="x"), "member"),
        (lambda g: g.session_member("../members"), "session"),
    ],
)
def test_bad_arguments_are_named_before_any_request(api: StandIn, call: Any, field: str) -> None:
    with pytest.raises(InvalidProxySetting) as raised:
        call(client(api))
    assert str(raised.value).startswith(f"{field}:")
    assert api.bans == []


@pytest.mark.parametrize(
    ("base_url", "token", "field"),
    [
        ("ftp://127.0.0.1:1", TOKEN, "api"),
        ("http://user:secret@127.0.0.1:1", TOKEN, "api"),
        ("ftp://user:secret@127.0.0.1", TOKEN, "api"),
        ("127.0.0.1:1", TOKEN, "api"),
        ("http://127.0.0.1:1", "", "api token"),
        ("http://127.0.0.1:1", "two words", "api token"),
    ],
)
def test_a_bad_address_or_token_is_named(base_url: str, token: str, field: str) -> None:
    with pytest.raises(InvalidProxySetting) as raised:
        GatewayClient(base_url, token)
    assert str(raised.value).startswith(f"{field}:")
    assert "secret" not in str(raised.value)


class _Redirecting(BaseHTTPRequestHandler):
    """Answers every request with a redirect to `server.location` (on another origin)."""

    server: _RedirectServer

    def do_GET(self) -> None:
        self.send_response(self.server.status)
        self.send_header("Location", self.server.location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _RedirectServer(ThreadingHTTPServer):
    daemon_threads = True
    status: int
    location: str


@pytest.fixture
def redirecting(api: StandIn) -> Iterator[_RedirectServer]:
    """A server in front of the API's stand-in that redirects everything to it."""
    server = _RedirectServer(("127.0.0.1", 0), _Redirecting)
    server.location = f"http://localhost:{api.port}/v1/members"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("call", "status"),
    [
        (lambda g: g.members(), 302),
        (lambda g: g.members(), 307),
        (lambda g: g.report_ban(member="web/0", reason="captcha"), 303),
        (lambda g: g.report_ban(member="web/0", reason="captcha"), 308),
    ],
)
def test_a_redirect_is_refused_and_the_token_goes_nowhere_else(
    api: StandIn, redirecting: _RedirectServer, call: Any, status: int
) -> None:
    redirecting.status = status
    gateway = GatewayClient(f"http://127.0.0.1:{redirecting.server_address[1]}", TOKEN)
    with pytest.raises(GatewayApiError) as raised:
        call(gateway)
    assert raised.value.status == status
    assert f"redirects to http://localhost:{api.port}" in raised.value.message
    assert TOKEN not in str(raised.value)
    # The other origin heard nothing: no request, so no token.
    assert api.requests == []
