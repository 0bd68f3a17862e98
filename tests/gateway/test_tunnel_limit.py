"""A users-file user's `tunnels=N`: the real gateway over three real local members.

The limit is held by the router (gateway/router.py), which counts each
user's open tunnels; these tests hold real tunnels open through the gateway,
as a crawler does, and watch what the next CONNECT is answered.
"""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.squid import GatewaySquid
from gateway.users import hash_password
from providers.config import Config
from tests.gateway.test_squid import (  # noqa: F401 (config, members: fixtures)
    Members,
    config,
    connect_reply,
    members,
    open_tunnel,
    through,
    tunnel_get,
)
from tests.helpers.config import USERNAME
from tests.helpers.network import free_port
from tests.helpers.squid_upstream import requires_squid
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import DEADLINE, wait_until

pytestmark = [requires_squid, pytest.mark.slow]

ALICE, BOB = ("alice", "alice-password-1"), ("bob", "bob password 2")


def users(alice_limit: str = " tunnels=2", bob_limit: str = "") -> str:
    return (
        f"{ALICE[0]}:{hash_password(ALICE[1])}{alice_limit}\n"
        f"{BOB[0]}:{hash_password(BOB[1])}{bob_limit}\n"
    )


@pytest.fixture
def gateway(state_dir: Path, config: Config, members: Members) -> Iterator[GatewaySquid]:  # noqa: F811
    squid = GatewaySquid(
        config.proxy_settings(), state_dir / ".limits", ("127.0.0.1", free_port()), users=users()
    )
    try:
        squid.start(list(members.by_member.values()))
        yield squid
    finally:
        squid.stop()


class HeldTunnels:
    """Tunnels held open as a crawler holds them, each used every KEEPALIVE seconds (the
    origin closes a connection idle for 10 s), so that one the gateway dropped is seen."""

    KEEPALIVE = 2.0

    def __init__(self, gateway: GatewaySquid, origin: TlsOrigin) -> None:
        self._gateway, self._origin = gateway, origin
        self._lock = threading.Lock()
        self._tunnels: dict[int, tuple[contextlib.ExitStack, ssl.SSLSocket]] = {}
        self._opened = 0
        self._dropped: list[str] = []
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep, daemon=True)

    def __enter__(self) -> HeldTunnels:
        self._keeper.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._keeper.join()
        for stack, _ in self._tunnels.values():
            stack.close()

    def open(self, username: str, password: str) -> int:
        """A new tunnel as `username` (answered 200, one GET through it done); its number."""
        stack = contextlib.ExitStack()
        tls = stack.enter_context(open_tunnel(self._gateway, self._origin, username, password))
        with self._lock:
            self._opened += 1
            self._tunnels[self._opened] = (stack, tls)
            return self._opened

    def close(self, number: int) -> None:
        with self._lock:
            stack, _ = self._tunnels.pop(number)
        stack.close()

    def assert_all_open(self) -> None:
        """Every tunnel held carried every request sent through it, this one too."""
        with self._lock:
            assert not self._dropped, self._dropped
            assert all(tunnel_get(tls) == 200 for _, tls in self._tunnels.values())

    def _keep(self) -> None:
        while not self._stop.wait(self.KEEPALIVE):
            with self._lock:
                for number, (_, tls) in self._tunnels.items():
                    try:
                        tunnel_get(tls)
                    except (AssertionError, OSError) as err:
                        self._dropped.append(f"tunnel {number}: {err}")


def refusal(gateway: GatewaySquid, origin: TlsOrigin, username: str, password: str) -> str:
    """The reason the gateway gives for refusing a CONNECT over a user's limit."""
    reply = connect_reply(gateway, origin, username, password=password)
    assert reply.startswith(b"HTTP/1.1 429 Too Many Requests\r\n"), reply[:300]
    assert b"\r\nX-Squid-Error: 429:ERR_GATEWAY_TUNNEL_LIMIT 0\r\n" in reply, reply
    head = reply.partition(b"\r\n\r\n")[0].decode()
    (reason,) = (
        line.partition(": ")[2] for line in head.split("\r\n") if line.startswith("X-Gateway-")
    )
    return reason


def test_a_user_holds_at_most_its_tunnels_and_a_closed_one_frees_its_slot(
    gateway: GatewaySquid, tls_origin: TlsOrigin
) -> None:
    at_limit = "alice holds 2 open tunnels, its limit is tunnels=2"
    with HeldTunnels(gateway, tls_origin) as held:
        held.open(*ALICE)
        # Every username form of the account counts against it.
        second = held.open(f"{ALICE[0]}-session-cart1", ALICE[1])
        assert refusal(gateway, tls_origin, *ALICE) == at_limit
        assert refusal(gateway, tls_origin, f"{ALICE[0]}-session-k2", ALICE[1]) == at_limit
        # What docs/operations.md says curl prints.
        proxy, origin = f"127.0.0.1:{gateway.front.port}", f"{tls_origin.host}:{tls_origin.port}"
        curl = subprocess.run(
            ["curl", "-sS", "-k", "-x", proxy, "-U", ":".join(ALICE), f"https://{origin}/"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert "CONNECT tunnel failed, response 429" in curl.stderr, curl.stderr

        # Nobody else is held to alice's limit: bob has none, nor has the fleet's user.
        for _ in range(3):
            held.open(*BOB)
        assert through(gateway, tls_origin, USERNAME).ok
        held.assert_all_open()  # the refusals closed nothing

        held.close(second)
        wait_until(lambda: through(gateway, tls_origin, *ALICE).ok, DEADLINE, "alice's freed slot")
        held.open(*ALICE)
        assert refusal(gateway, tls_origin, *ALICE) == at_limit
        held.assert_all_open()


def test_a_users_file_change_moves_a_limit_without_dropping_a_tunnel(
    gateway: GatewaySquid,
    members: Members,  # noqa: F811
    tls_origin: TlsOrigin,
) -> None:
    with HeldTunnels(gateway, tls_origin) as held:
        for _ in range(2):
            held.open(*ALICE)

        # Lowered below what is open: nothing closes, nothing new opens.
        gateway.install_users(users(" tunnels=1"))
        reason = refusal(gateway, tls_origin, *ALICE)
        assert reason == "alice holds 2 open tunnels, its limit is tunnels=1"
        held.assert_all_open()

        # Raised: one more, then the new limit.
        gateway.install_users(users(" tunnels=3"))
        held.open(*ALICE)
        reason = refusal(gateway, tls_origin, *ALICE)
        assert reason == "alice holds 3 open tunnels, its limit is tunnels=3"

        # A membership change leaves the count as it is.
        gateway.apply([*members.by_member.values(), members.add(3)])
        reason = refusal(gateway, tls_origin, *ALICE)
        assert reason == "alice holds 3 open tunnels, its limit is tunnels=3"

        # A user given a first limit: the tunnels it already holds count.
        held.open(*BOB)
        gateway.install_users(users(" tunnels=3", " tunnels=1"))
        reason = refusal(gateway, tls_origin, *BOB)
        assert reason == "bob holds 1 open tunnel, its limit is tunnels=1"
        held.assert_all_open()
