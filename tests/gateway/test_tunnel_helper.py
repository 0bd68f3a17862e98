"""The tunnel helper (gateway/tunnel_helper.py) and the socket table it reads, without Squid.

Its tunnels are real connections to a real listener, as a back worker's
are: the helper learns which are still open from the kernel, so nothing
here is simulated. The whole path through Squid is tests/gateway/test_tunnel_limit.py.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.socket_table import (
    Connection,
    as_written,
    established,
    established_as_written,
    unmapped,
)
from gateway.tunnel_helper import Ledger, answer
from gateway.users import FollowedUsers, hash_password
from tests.helpers.waiting import DEADLINE, wait_until

ROOT = Path(__file__).resolve().parents[2]
HASH = hash_password("pw")


class Listener:
    """A listening socket whose accepted connections stand in for a back's tunnels."""

    def __init__(self, stack: contextlib.ExitStack, family: int = socket.AF_INET) -> None:
        self._stack = stack
        self.host = "127.0.0.1" if family == socket.AF_INET else "::1"
        self.server = stack.enter_context(socket.socket(family))
        self.server.bind((self.host, 0))
        self.server.listen()
        self.port = self.server.getsockname()[1]

    def connect(self, client_family: int | None = None) -> tuple[Connection, socket.socket]:
        """A new connection: as the listener's end sees it, and the client's socket."""
        client = socket.create_connection((self.host, self.port))
        accepted, _ = self.server.accept()
        self._stack.enter_context(accepted)
        self._stack.enter_context(client)
        here, there = accepted.getsockname(), accepted.getpeername()
        ip = ipaddress.ip_address
        return (ip(here[0]), here[1], ip(there[0]), there[1]), client


@pytest.fixture
def listener() -> Iterator[Listener]:
    with contextlib.ExitStack() as stack:
        yield Listener(stack)


def test_the_socket_table_gives_both_ends_of_a_connection(listener: Listener) -> None:
    (local, port, remote, remote_port), _ = listener.connect()
    table = set(established())
    assert (local, port, remote, remote_port) in table  # the listener's end
    assert (remote, remote_port, local, port) in table  # the client's


def test_a_connection_is_found_as_the_kernel_writes_it(listener: Listener) -> None:
    connection, client = listener.connect()
    local, port, remote, remote_port = connection
    assert as_written(connection) in established_as_written()
    assert as_written((remote, remote_port, local, port)) in established_as_written()
    client.close()
    wait_until(
        lambda: as_written(connection) not in established_as_written(),
        DEADLINE,
        "the closed connection gone from the table",
    )


def test_an_ipv4_client_of_an_ipv6_socket_is_found_as_ipv4() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.socket(socket.AF_INET6))
        try:
            server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            server.bind(("::", 0))
        except OSError:
            pytest.skip("no dual-stack sockets here")
        server.listen()
        client = stack.enter_context(
            socket.create_connection(("127.0.0.1", server.getsockname()[1]))
        )
        accepted = stack.enter_context(server.accept()[0])
        here, there = accepted.getsockname(), accepted.getpeername()
        assert here[0].startswith("::ffff:"), "the kernel gives it as v4-mapped"
        connection = (
            unmapped(ipaddress.ip_address(here[0])),
            here[1],
            unmapped(ipaddress.ip_address(there[0])),
            there[1],
        )
        assert connection in set(established())
        assert as_written(connection) in established_as_written()
        assert client.getsockname()[1] == there[1]


def test_ipv6_connections_are_read_too() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with contextlib.ExitStack() as stack:
        try:
            listener = Listener(stack, socket.AF_INET6)
        except OSError:
            pytest.skip("no ::1 here")
        connection, _ = listener.connect()
        assert connection in set(established())
        assert as_written(connection) in established_as_written()


def test_a_user_gets_its_limit_across_ledgers_and_a_closed_tunnel_frees_its_slot(
    listener: Listener, tmp_path: Path
) -> None:
    # The backs' helpers share one file: two Ledgers over it are two backs.
    back_a, back_b = Ledger(str(tmp_path / "tunnels")), Ledger(str(tmp_path / "tunnels"))
    (first, first_client), (second, _), (third, _) = (written(listener) for _ in range(3))

    assert back_a.admit("alice", first, 2) is None
    assert back_b.admit("alice", second, 2) is None
    assert back_a.admit("alice", third, 2) == 2
    assert back_b.admit("bob", third, 1) is None, "another user's count is its own"
    # The same connection asked again (Squid's retry) takes no second slot.
    assert back_b.admit("bob", third, 1) is None

    first_client.close()
    wait_until(
        lambda: back_b.admit("alice", third, 2) is None, DEADLINE, "alice's closed tunnel freed"
    )
    # The third connection is alice's now, bob's entry of it gone with it.
    fourth, _ = written(listener)
    assert back_a.admit("bob", fourth, 1) is None
    assert back_a.admit("alice", fourth, 2) == 2


def test_a_ledger_line_left_half_written_is_dropped(listener: Listener, tmp_path: Path) -> None:
    path = tmp_path / "tunnels"
    (local, remote), _ = written(listener)
    path.write_text("alice 0100007F:0001\nbob 0100007F:0001 0100007F:0002 x\ncarol x y\n")
    assert Ledger(str(path)).admit("alice", (local, remote), 1) is None
    assert path.read_text() == f"alice {local} {remote}\n"


def written(listener: Listener) -> tuple[tuple[str, str], socket.socket]:
    """A new connection to `listener`, as the ledger keeps it, and its client's socket."""
    connection, client = listener.connect()
    return as_written(connection), client


def users_file(tmp_path: Path, text: str) -> FollowedUsers:
    path = tmp_path / "users"
    path.write_text(text)
    return FollowedUsers(str(path), "proxy", "test")


@pytest.mark.parametrize(
    "line",
    ["", "alice 127.0.0.1 1 127.0.0.1\n", "alice x 1 127.0.0.1 2 -\n", "alice 1 2 3 4 -\n"],
)
def test_a_malformed_request_is_answered_bh_naming_the_helper(line: str, tmp_path: Path) -> None:
    users = users_file(tmp_path, f"alice:{HASH} tunnels=1\n")
    reply = answer(line, users, Ledger(str(tmp_path / "tunnels")))
    assert reply.startswith("BH message=\"the gateway's tunnel helper got "), reply


def test_users_without_a_limit_are_answered_ok_and_never_recorded(
    listener: Listener, tmp_path: Path
) -> None:
    users = users_file(tmp_path, f"alice:{HASH}\n")
    ledger = Ledger(str(tmp_path / "tunnels"))
    (local, port, remote, remote_port), _ = listener.connect()
    for username in ("alice", "alice-session-k", "proxy", "stranger"):
        line = f"{username} {remote} {remote_port} {local} {port} -\n"
        assert answer(line, users, ledger) == "OK"
    assert not (tmp_path / "tunnels").exists()


def test_the_helper_speaks_squids_protocol(listener: Listener, tmp_path: Path) -> None:
    (tmp_path / "users").write_text(f"alice:{HASH} tunnels=1\n")
    connections = [listener.connect()[0] for _ in range(2)]
    lines = "".join(
        f"alice-session-k%2D1 {remote} {remote_port} {local} {port} -\n"
        for local, port, remote, remote_port in connections
    )
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "gateway" / "tunnel_helper.py"),
            "proxy",
            str(tmp_path / "users"),
            str(tmp_path / "tunnels"),
        ],
        input=lines,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    reason = "alice holds 1 open tunnel, its limit is tunnels=1"
    assert result.stdout.splitlines() == [
        "OK",
        f'ERR message="{reason}" gateway_refused="{reason}"',
    ]
