"""The gateway's Squid and router over three real local members, without Temporal.

Routing by username, auth and the proxies' rules, membership changes with
client loops running, and a member killed under load. Which
member carried a request is read from the members' own access logs, not from
the gateway, so the gateway's reporting is not its own witness.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import json
import os
import pwd
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import squid as gateway_squid
from gateway.routing import userhash_member
from gateway.squid import GatewayError, GatewaySquid, GatewayTimeout, Tunnels
from gateway.users import hash_password
from providers.base import CreateRequest
from providers.config import Config
from providers.local import LocalProvider
from providers.naming import owner_tags
from squid.conf import SQUID_USER
from squid.gateway import GatewayMember
from squid.process import RUNTIME_ROOT
from squid.procfs import group_members
from tests.helpers.config import PASSWORD, USERNAME, local_entry, proxy_config
from tests.helpers.network import accepts_connections, closed_by_peer, free_port, read_head
from tests.helpers.squid_upstream import requires_squid
from tests.helpers.tls_origin import TlsOrigin, TlsRequestHandler
from tests.helpers.tunnel import Answer, connect_request, request
from tests.helpers.waiting import DEADLINE, wait_until

pytestmark = [requires_squid, pytest.mark.slow]

POOL = "pool-t"
ROOT = Path(__file__).resolve().parents[2]
# How long a changing gateway may take to reach the step a test kills it at.
STEP_DEADLINE = 60.0


class Members:
    """Three local Squids standing in for a pool's Ready members."""

    def __init__(self, state_dir: Path, config: Config) -> None:
        self.state_dir = state_dir
        self.provider = LocalProvider.from_config(config.providers[0], config)
        self.config = config
        self.by_member: dict[str, GatewayMember] = {}
        self.names: dict[str, str] = {}
        self.suffix = uuid.uuid4().hex[:8]

    def add(self, n: int) -> GatewayMember:
        # A Squid's name is machine-wide (its /dev/shm segments): each test's
        # own, so the module's tests can run on several xdist workers at once.
        name = f"member-{n}-{self.suffix}"
        instance = self.provider.create(
            CreateRequest(
                name=name,
                proxy=self.config.proxy_settings(),
                tags=owner_tags(self.config.installation, f"{POOL}/{n}", 0),
            )
        )
        member = GatewayMember(f"{POOL}/{n}", instance.ip, instance.port)
        self.by_member[member.member] = member
        self.names[member.member] = name
        return member

    def tunnels(self) -> collections.Counter[str]:
        """Tunnels each member carried, from its own access log."""
        counts: collections.Counter[str] = collections.Counter()
        for member, name in self.names.items():
            log = self.state_dir / name / "access.log"
            if log.exists():
                counts[member] = log.read_text().count("TCP_TUNNEL/200")
        return +counts  # members that carried nothing are left out

    def kill(self, member: str) -> None:
        meta = json.loads((self.state_dir / self.names[member] / "instance.json").read_text())
        os.killpg(meta["pid"], signal.SIGKILL)


@pytest.fixture
def config(tls_origin: TlsOrigin, state_dir: Path) -> Config:
    return proxy_config(tls_origin.port, local_entry(state_dir))


@pytest.fixture
def members(state_dir: Path, config: Config) -> Members:
    found = Members(state_dir, config)
    for n in range(3):
        found.add(n)
    return found


@pytest.fixture
def gateway(state_dir: Path, config: Config, members: Members) -> Iterator[GatewaySquid]:
    squid = GatewaySquid(
        config.proxy_settings(), state_dir / ".gateway", ("127.0.0.1", free_port())
    )
    try:
        squid.start(list(members.by_member.values()))
        yield squid
    finally:
        squid.stop()


def through(
    gateway: GatewaySquid, origin: TlsOrigin, username: str, password: str = PASSWORD
) -> Answer:
    return request(
        ("127.0.0.1", gateway.front.port),
        username,
        password,
        (origin.host, origin.port),
        origin.client_ssl_context,
    )


def test_plain_username_rotates_over_every_member(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    answers = [through(gateway, tls_origin, USERNAME) for _ in range(99)]

    assert all(a.ok for a in answers), collections.Counter(answers)
    counts = members.tunnels()
    assert set(counts) == set(members.by_member), counts
    assert sum(counts.values()) == 99
    # Round-robin per CONNECT: an even share each, give or take Squid
    # resetting its counters as each member first answers.
    assert max(counts.values()) - min(counts.values()) <= 4, counts


def test_a_session_key_sticks_to_one_member_and_keys_spread(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    for _ in range(50):
        assert through(gateway, tls_origin, f"{USERNAME}-session-cart-42").ok
    (member,) = members.tunnels()
    assert members.tunnels()[member] == 50

    for key in range(30):
        assert through(gateway, tls_origin, f"{USERNAME}-session-k{key}").ok
    assert len(members.tunnels()) == 3, "30 keys should not all hash to one member"


def test_a_pinned_username_reaches_exactly_that_member(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    for member in members.by_member:
        before = members.tunnels()[member]
        for _ in range(5):
            assert through(gateway, tls_origin, f"{USERNAME}-proxy-{member}").ok
        assert members.tunnels()[member] == before + 5
    assert sum(members.tunnels().values()) == 15


def test_pinning_a_member_that_is_not_in_the_pool_fails_alone(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    # The router's "no member" answer: no member may carry it. A burst of them
    # must not make Squid count its router down (Squid 5 counts every error
    # answer to a CONNECT against the parent that gave it).
    for _ in range(20):
        assert through(gateway, tls_origin, f"{USERNAME}-proxy-{POOL}/99").connect_status == 503
    assert sum(members.tunnels().values()) == 0
    assert all(through(gateway, tls_origin, USERNAME).ok for _ in range(5))


@pytest.mark.parametrize(
    "username",
    [USERNAME, f"{USERNAME}-session-a", f"{USERNAME}-proxy-{POOL}/0"],
)
def test_a_wrong_password_is_407_in_every_form(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin, username: str
) -> None:
    assert through(gateway, tls_origin, username, "wrong-password").connect_status == 407
    assert sum(members.tunnels().values()) == 0


@pytest.mark.parametrize(
    "username",
    [
        "someone",
        f"{USERNAME}x",
        f"{USERNAME}-session-",
        f"{USERNAME}-session-a b",
        f"{USERNAME}-proxy-",
        f"{USERNAME}-other-x",
        f"x{USERNAME}",
    ],
)
def test_usernames_outside_the_three_forms_are_407_even_with_the_password(
    gateway: GatewaySquid, tls_origin: TlsOrigin, username: str
) -> None:
    assert through(gateway, tls_origin, username).connect_status == 407


# Usernames built to slip past the three forms; each Squid start costs
# seconds, so one gateway takes them all.
HOSTILE_USERNAMES = [
    f"{USERNAME}-session-{'k' * 129}",  # one past SESSION_KEY's 128
    f"{USERNAME}-session-{'k' * 5000}",
    f"{USERNAME}-session-a\nproxy",  # a second helper line, if the helper trusted it
    f"{USERNAME}-session-a%20b",
    f"{USERNAME}-session-clé",
    f"{USERNAME}-session-a'\"",
    f"{USERNAME}-session-a:b",  # basic auth splits at the first colon: a wrong password
    f"{USERNAME}-proxy-{POOL}/0\n",
    f"{USERNAME}-proxy-{'m' * 201}",  # one past PINNABLE_MEMBER's 200
    f"{USERNAME}-proxy-{POOL}/0 x",
    USERNAME.upper(),  # usernames are case-sensitive
    f"{USERNAME}-SESSION-a",
    "",
]


def test_hostile_usernames_are_407_and_reach_no_member(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    answers = {u[:40]: through(gateway, tls_origin, u).connect_status for u in HOSTILE_USERNAMES}
    assert set(answers.values()) == {407}, answers
    assert sum(members.tunnels().values()) == 0
    assert through(gateway, tls_origin, USERNAME).ok, "the gateway still serves"


def test_every_kind_of_allowed_session_key_sticks(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    for key in ["k" * 128, "._~+=-", "0", "A-b.C_d~e+f=g"]:
        before = members.tunnels()
        for _ in range(5):
            assert through(gateway, tls_origin, f"{USERNAME}-session-{key}").ok, key
        assert list((members.tunnels() - before).values()) == [5], key


def test_a_port_outside_allowed_connect_ports_is_403(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    answer = request(
        ("127.0.0.1", gateway.front.port),
        USERNAME,
        PASSWORD,
        ("127.0.0.1", 22),
        tls_origin.client_ssl_context,
    )
    assert answer.connect_status == 403
    assert sum(members.tunnels().values()) == 0


def test_denied_destinations_are_403_in_every_form(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    # The cloud metadata server and a private address, on an allowed port:
    # the front refuses them before any member is asked.
    for destination in ("169.254.169.254", "10.1.2.3"):
        for username in (USERNAME, f"{USERNAME}-session-a", f"{USERNAME}-proxy-{POOL}/0"):
            answer = request(
                ("127.0.0.1", gateway.front.port),
                username,
                PASSWORD,
                (destination, tls_origin.port),
                tls_origin.client_ssl_context,
            )
            assert answer.connect_status == 403, (destination, username)
    assert sum(members.tunnels().values()) == 0


class Loop:
    """A client sending CONNECTs through the gateway until stopped, counting outcomes."""

    def __init__(self, gateway: GatewaySquid, origin: TlsOrigin, username: str) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(gateway, origin, username))

    def _run(self, gateway: GatewaySquid, origin: TlsOrigin, username: str) -> None:
        while not self._stop.is_set():
            try:
                answer = through(gateway, origin, username)
                self.outcomes["ok" if answer.ok else f"status {answer}"] += 1
            except OSError as err:
                self.outcomes[type(err).__name__] += 1

    def __enter__(self) -> Loop:
        self._thread.start()
        return self

    def served(self, more: int) -> None:
        """Wait until `more` requests beyond those so far were answered (any answer)."""
        wanted = sum(self.outcomes.values()) + more
        wait_until(lambda: sum(self.outcomes.values()) >= wanted, 60, f"{more} more requests")

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def test_membership_changes_lose_no_request_and_move_only_the_leavers_sessions(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    before = {}
    for username in (f"{USERNAME}-session-s{i}" for i in range(12)):
        counts = members.tunnels()
        assert through(gateway, tls_origin, username).ok
        (before[username],) = (members.tunnels() - counts).keys()
    gone = f"{POOL}/2"
    logged = sum(members.tunnels().values())

    with Loop(gateway, tls_origin, USERNAME) as loop:
        fourth = members.add(3)
        loop.served(10)
        assert gateway.apply([*members.by_member.values()])
        loop.served(10)
        assert gateway.apply([m for m in members.by_member.values() if m.member != gone])
        loop.served(10)
    # A member logs a tunnel when it closes: the loop's last request through
    # `gone`, sent before the removal, may be logged after the loop stops.
    wait_until(
        lambda: sum(members.tunnels().values()) == logged + loop.outcomes["ok"],
        10,
        "every tunnel of the loop in a member's log",
    )
    carried = members.tunnels()[gone]

    assert set(loop.outcomes) == {"ok"}, loop.outcomes
    # In force once apply returns: the next rotation reaches the new member.
    counts = members.tunnels()
    for _ in range(3):
        assert through(gateway, tls_origin, USERNAME).ok
    assert (members.tunnels() - counts).keys() == {f"{POOL}/0", f"{POOL}/1", fourth.member}
    for _ in range(20):
        assert through(gateway, tls_origin, USERNAME).ok
    assert members.tunnels()[gone] == carried, "a removed member got requests"
    # Consistent hashing: only the removed member's sessions moved, and
    # some moved to the new member; none moved between the others.
    for username, member in before.items():
        counts = members.tunnels()
        assert through(gateway, tls_origin, username).ok
        (now,) = (members.tunnels() - counts).keys()
        if member != gone:
            assert now in (member, fourth.member), username


def test_back_to_back_changes_under_load_break_no_tunnel(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    """Forty membership changes under two client loops, a few requests apart.

    No change may cost a request, nor hand a client's TLS handshake to a
    member as if it were the origin (a member would answer 400).
    """
    fourth = members.add(3)
    three = [m for m in members.by_member.values() if m != fourth]
    with (
        Loop(gateway, tls_origin, USERNAME) as rotating,
        Loop(gateway, tls_origin, f"{USERNAME}-session-changes") as sticky,
    ):
        for flip in range(40):
            assert gateway.apply([*three, fourth] if flip % 2 == 0 else three)
            rotating.served(1)
            sticky.served(1)

    for loop in (rotating, sticky):
        assert set(loop.outcomes) == {"ok"}, loop.outcomes
        assert loop.outcomes["ok"] > 10
    answers = collections.Counter(
        line.split()[3]
        for name in members.names.values()
        for line in (members.state_dir / name / "access.log").read_text().splitlines()
    )
    assert set(answers) == {"TCP_TUNNEL/200"}, answers


def test_a_change_answered_late_leaves_the_next_one_whole_and_exact(
    gateway: GatewaySquid,
    members: Members,
    tls_origin: TlsOrigin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A change the gateway stopped waiting for leaves it not knowing which members the
    router has: its next change goes whole, its late answer is not taken for the next
    one's, and what is in force is exactly what the gateway was given."""
    router = gateway.router_process
    assert router is not None
    monkeypatch.setattr(gateway_squid, "APPLY_DEADLINE", 1.0)
    fourth = members.add(3)
    os.kill(router.pid, signal.SIGSTOP)
    try:
        with pytest.raises(GatewayTimeout):
            gateway.apply([*members.by_member.values()])
    finally:
        os.kill(router.pid, signal.SIGCONT)  # it applies that change, late

    for kept in ([f"{POOL}/0", fourth.member], [f"{POOL}/0", fourth.member, f"{POOL}/1"]):
        assert gateway.apply([members.by_member[member] for member in kept])
        counts = members.tunnels()
        for _ in range(3 * len(kept)):
            assert through(gateway, tls_origin, USERNAME).ok
        assert (members.tunnels() - counts).keys() == set(kept)


def test_a_killed_member_is_skipped_without_a_failed_request(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    victim = f"{POOL}/1"
    members.kill(victim)
    answers = [through(gateway, tls_origin, USERNAME) for _ in range(30)]
    answers += [through(gateway, tls_origin, f"{USERNAME}-session-k{i}") for i in range(30)]

    assert all(a.ok for a in answers), collections.Counter(answers)
    assert through(gateway, tls_origin, f"{USERNAME}-proxy-{victim}").connect_status == 503


def test_a_member_that_dies_under_a_request_passes_it_to_the_next(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    """A Squid killed at that instant still completes connects it cannot answer.

    Stood in for by a listener that takes each connection and closes it
    unanswered: nothing has reached the client yet, so the request goes on
    to the next member, and no client sees the death.
    """
    dying = socket.create_server(("127.0.0.1", 0))
    dying.settimeout(0.2)  # the acceptor looks at `closing` between accepts
    closing = threading.Event()

    def accept_and_close() -> None:
        while not closing.is_set():
            with contextlib.suppress(OSError):
                connection, _ = dying.accept()
                connection.close()

    acceptor = threading.Thread(target=accept_and_close)
    acceptor.start()
    try:
        port = dying.getsockname()[1]
        gateway.apply([*members.by_member.values(), GatewayMember(f"{POOL}/8", "127.0.0.1", port)])
        answers = [through(gateway, tls_origin, USERNAME) for _ in range(12)]
        answers += [through(gateway, tls_origin, f"{USERNAME}-session-k{i}") for i in range(30)]
        assert all(a.ok for a in answers), collections.Counter(answers)
        pinned = through(gateway, tls_origin, f"{USERNAME}-proxy-{POOL}/8")
        assert pinned.connect_status == 503, pinned
    finally:
        closing.set()
        dying.close()
        acceptor.join()


def test_the_members_password_is_in_no_file_argument_or_environment(
    gateway: GatewaySquid, tls_origin: TlsOrigin
) -> None:
    """Only the router holds it, read from its standard input."""
    assert through(gateway, tls_origin, USERNAME).ok
    assert gateway.conf.stat().st_mode & 0o777 == 0o640
    for path in gateway.directory.rglob("*"):
        if path.is_file():
            assert PASSWORD not in path.read_text(errors="replace"), path
    assert "login=" not in gateway.conf.read_text().replace("login=PASSTHRU", "")
    assert gateway.router_process is not None
    proc = Path(f"/proc/{gateway.router_process.pid}")
    for held in ("cmdline", "environ"):
        assert PASSWORD.encode() not in (proc / held).read_bytes(), held


def test_a_listen_address_in_use_fails_at_once_naming_it(state_dir: Path, config: Config) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        squid = GatewaySquid(config.proxy_settings(), state_dir / ".busy", ("127.0.0.1", port))
        with pytest.raises(GatewayError, match=f"--listen 127.0.0.1:{port}: the address is in use"):
            squid.start([])
    assert squid.process is None, "no Squid was started"


def test_a_router_port_taken_before_the_router_binds_it_is_traded_for_another(
    state_dir: Path, config: Config, members: Members, tls_origin: TlsOrigin
) -> None:
    squid = GatewaySquid(config.proxy_settings(), state_dir / ".raced", ("127.0.0.1", free_port()))
    # Another process binds the router's port between the gateway's check and the router's bind.
    with socket.create_server(("127.0.0.1", squid.router.port)) as thief:
        taken = thief.getsockname()[1]
        try:
            squid.start(list(members.by_member.values()))
            assert squid.router.port != taken
            assert all(through(squid, tls_origin, USERNAME).ok for _ in range(3))
        finally:
            squid.stop()


def test_two_gateways_send_a_session_key_to_the_same_member(
    gateway: GatewaySquid, members: Members, state_dir: Path, config: Config, tls_origin: TlsOrigin
) -> None:
    other = GatewaySquid(
        config.proxy_settings(), state_dir / ".other-gateway", ("127.0.0.1", free_port())
    )
    # The other gateway learns the members in another order: it does not matter.
    other.start(list(reversed(members.by_member.values())))
    try:
        for key in range(10):
            username = f"{USERNAME}-session-shared{key}"
            chosen = []
            for squid in (gateway, other):
                before = members.tunnels()
                assert through(squid, tls_origin, username).ok
                (member,) = (members.tunnels() - before).keys()
                chosen.append(member)
            assert chosen[0] == chosen[1], username
    finally:
        other.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="Squid only drops to `proxy` when started as root")
def test_a_state_dir_squids_user_cannot_reach_still_serves(
    state_dir: Path, config: Config, members: Members, tls_origin: TlsOrigin
) -> None:
    """A --state-dir under a private directory (as /root is): the files go where `proxy` reaches.

    The router runs from a copy there too, so a virtualenv under /root
    does not stop it.
    """
    private = state_dir / "private"
    private.mkdir(mode=0o700)
    squid = GatewaySquid(config.proxy_settings(), private / "gateway", ("127.0.0.1", free_port()))
    try:
        squid.start(list(members.by_member.values()))
        assert squid.directory.is_relative_to(RUNTIME_ROOT)
        assert through(squid, tls_origin, USERNAME).ok
        assert through(squid, tls_origin, f"{USERNAME}-session-s1").ok
        assert through(squid, tls_origin, USERNAME, "wrong-password").connect_status == 407
    finally:
        squid.stop()
        shutil.rmtree(squid.directory, ignore_errors=True)


def test_a_gateway_killed_while_its_members_change_leaves_nothing_serving(
    state_dir: Path, config: Config, members: Members, tls_origin: TlsOrigin
) -> None:
    """SIGKILL the gateway's process while it changes members: its Squid and router go too.

    Either left behind would serve a membership nobody keeps current. The
    watchdog kills the whole Squid, the router ends with its standard input,
    so clients are refused at once and the supervisor's next gateway gets
    the address back.
    """
    port = free_port()
    given = {
        "settings": dataclasses.asdict(config.proxy_settings()),
        "members": [dataclasses.astuple(m) for m in members.by_member.values()],
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.changing_gateway", str(state_dir / "gw"), str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write(json.dumps(given) + "\n")
        child.stdin.flush()
        pids: dict[str, int] = {}
        changes = 0
        # Past the deadline the child is killed, which ends its output and the loop.
        deadline = threading.Timer(STEP_DEADLINE, child.kill)
        deadline.start()
        for line in child.stdout:
            role, _, pid = line.partition(" pid ")
            if pid:
                pids[role] = int(pid)
            elif line.startswith("applied"):
                changes += 1
                if changes == 25:
                    break
        deadline.cancel()
        assert changes == 25 and pids.keys() == {"squid", "router"}, (changes, pids)
        child.send_signal(signal.SIGKILL)
        child.wait()

        wait_until(lambda: not group_members(pids["squid"]), 15, "Squid's processes to end")
        wait_until(lambda: not Path(f"/proc/{pids['router']}").exists(), 15, "the router to end")
        assert not accepts_connections(port)
        again = GatewaySquid(config.proxy_settings(), state_dir / "gw", ("127.0.0.1", port))
        try:
            again.start(list(members.by_member.values()))
            assert through(again, tls_origin, USERNAME).ok
        finally:
            again.stop()
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("part", ["master", "watchdog", "router"])
def test_a_dead_master_watchdog_or_router_stops_the_whole_gateway(
    part: str, gateway: GatewaySquid, tls_origin: TlsOrigin
) -> None:
    """Workers outliving a killed master would serve stale members; no watchdog, no fate
    sharing; no router, no member reached.

    Either way the gateway sees it (`running()` is what its loop watches and
    exits on), and its stop leaves no Squid process holding the address.
    """
    assert gateway.process is not None and gateway.watchdog is not None
    assert gateway.router_process is not None
    master = gateway.process.pid
    victim = {
        "master": master,
        "watchdog": gateway.watchdog.pid,
        "router": gateway.router_process.pid,
    }[part]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: not gateway.running(), 15, f"the gateway to see its {part} die")
    gateway.stop()
    assert not group_members(master)
    assert not accepts_connections(gateway.front.port)


def test_a_killed_front_worker_is_restarted_and_serves_again(
    gateway: GatewaySquid, tls_origin: TlsOrigin
) -> None:
    front = gateway.worker_pid()
    assert front is not None
    os.kill(front, signal.SIGKILL)
    wait_until(
        lambda: gateway.worker_pid() not in (None, front),
        15,
        "Squid's master to start a new front worker",
    )
    # One worker holds the listening socket: refused until the new one binds it.
    wait_until(
        lambda: (
            accepts_connections(gateway.front.port) and through(gateway, tls_origin, USERNAME).ok
        ),
        30,
        "the new front to serve",
    )
    assert gateway.running()


def test_the_computed_session_member_is_the_one_the_router_chose(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    # The control API names a session's member with gateway/routing.py's
    # userhash; the members' own access logs say which one carried it.
    names = list(members.by_member)
    for key in range(30):
        username = f"{USERNAME}-session-k{key}"
        before = members.tunnels()
        assert through(gateway, tls_origin, username).ok
        (carried,) = members.tunnels() - before
        assert userhash_member(username, names) == carried, username
    # One member fewer: its keys move, and only its.
    gone = names[0]
    gateway.apply([m for member, m in members.by_member.items() if member != gone])
    for key in range(30):
        username = f"{USERNAME}-session-k{key}"
        before = members.tunnels()
        assert through(gateway, tls_origin, username).ok
        (carried,) = members.tunnels() - before
        assert userhash_member(username, names[1:]) == carried, username


def test_routing_filters_reach_only_the_members_they_name(
    state_dir: Path, config: Config, members: Members, tls_origin: TlsOrigin
) -> None:
    zones = {0: "europe-west1-b", 1: "europe-west1-c", 2: "us-east1-b"}
    placed = {
        member: dataclasses.replace(
            m, zone=zones[n], region=zones[n].rsplit("-", 1)[0], provider="local"
        )
        for n, (member, m) in enumerate(sorted(members.by_member.items()))
    }
    first, second, third = sorted(placed)
    squid = GatewaySquid(
        config.proxy_settings(), state_dir / ".filters", ("127.0.0.1", free_port())
    )
    try:
        squid.start(list(placed.values()))

        def carried(username: str, times: int = 1) -> collections.Counter[str]:
            before = members.tunnels()
            for _ in range(times):
                assert through(squid, tls_origin, username).ok, username
            return members.tunnels() - before

        # Round-robin evens out the counts of the members a filter admits: first the wide one.
        assert set(carried(f"{USERNAME}-provider-local", 12)) == {first, second, third}
        assert set(carried(f"{USERNAME}-region-europe-west1", 12)) == {first, second}
        assert set(carried(f"{USERNAME}-zone-europe-west1-b", 6)) == {first}
        sticky = carried(f"{USERNAME}-region-europe-west1-session-cart-1", 6)
        assert len(sticky) == 1 and set(sticky) <= {first, second}
        assert set(carried(f"{USERNAME}-region-us-east1-provider-local-session-k", 3)) == {third}
        assert set(carried(f"{USERNAME}-zone-europe-west1-c-proxy-{second}")) == {second}

        before = members.tunnels()
        for username in (
            f"{USERNAME}-zone-asia-east1-a",
            f"{USERNAME}-provider-gcp-session-k",
            f"{USERNAME}-zone-europe-west1-b-proxy-{second}",
        ):
            reply = connect_reply(squid, tls_origin, username)
            assert reply.startswith(b"HTTP/1.1 503 "), (username, reply[:200])
            # Squid relays the router's status and error name, not its page.
            assert b"\r\nX-Squid-Error: 503:ERR_GATEWAY_NO_MEMBER 0\r\n" in reply, reply
            router = connect_reply(squid, tls_origin, username, squid.router.port)
            assert b"No member of the pool matches this username" in router, router
        for username in (f"{USERNAME}-zone-a-zone-b", f"{USERNAME}-zone--session-k"):
            assert through(squid, tls_origin, username).connect_status == 407, username
        assert members.tunnels() == before, "a filter that matches nothing falls back to nothing"
    finally:
        squid.stop()


def connect_reply(
    gateway: GatewaySquid, origin: TlsOrigin, username: str, port: int = 0, password: str = PASSWORD
) -> bytes:
    """The gateway's whole answer to a CONNECT it refuses: status line, headers, page."""
    credentials = base64.b64encode(f"{username}:{password}".encode()).decode()
    target = f"{origin.host}:{origin.port}"
    with socket.create_connection(("127.0.0.1", port or gateway.front.port), timeout=10) as sock:
        sock.sendall(
            f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
            f"Proxy-Authorization: Basic {credentials}\r\nConnection: close\r\n\r\n".encode()
        )
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def test_a_gateway_without_members_answers_that_no_member_matches(
    gateway: GatewaySquid, members: Members, tls_origin: TlsOrigin
) -> None:
    # Every member banned or gone at once: the router still answers.
    gateway.apply([])
    for username in (USERNAME, f"{USERNAME}-session-k", f"{USERNAME}-zone-eu"):
        reply = connect_reply(gateway, tls_origin, username)
        assert reply.startswith(b"HTTP/1.1 503 "), (username, reply[:100])
    gateway.apply(list(members.by_member.values()))
    assert through(gateway, tls_origin, USERNAME).ok


def test_users_file_changes_take_effect_without_dropping_an_open_tunnel(
    state_dir: Path, config: Config, members: Members, tls_origin: TlsOrigin
) -> None:
    alice, bob = ("alice", "alice-password-1"), ("bob.2", "bob password 2")
    squid = GatewaySquid(
        config.proxy_settings(),
        state_dir / ".users",
        ("127.0.0.1", free_port()),
        users=(
            f"# the crawlers\n{alice[0]}:{hash_password(alice[1])}\n"
            f"carol:{hash_password('carol-pw')} zones=europe-west1-b\n"
        ),
    )
    try:
        squid.start(list(members.by_member.values()))
        assert through(squid, tls_origin, USERNAME).ok, "the fleet's credential still works"
        assert through(squid, tls_origin, *alice).ok
        assert through(squid, tls_origin, f"{alice[0]}-session-cart-1", alice[1]).ok
        assert through(squid, tls_origin, f"{alice[0]}-provider-x", alice[1]).connect_status == 503
        assert through(squid, tls_origin, alice[0], "wrong").connect_status == 407
        assert through(squid, tls_origin, alice[0], PASSWORD).connect_status == 407
        assert through(squid, tls_origin, USERNAME, alice[1]).connect_status == 407
        assert through(squid, tls_origin, *bob).connect_status == 407
        # A user limited to zones must name one: refused otherwise, routed (here to
        # nothing: these members have no zone) when it does.
        for refused in ("carol", "carol-zone-us-east1-b", "carol-session-k"):
            assert through(squid, tls_origin, refused, "carol-pw").connect_status == 407
        carol = through(squid, tls_origin, "carol-zone-europe-west1-b", "carol-pw")
        assert carol.connect_status == 503

        with open_tunnel(squid, tls_origin, *alice) as tunnel:
            squid.install_users(f"{bob[0]}:{hash_password(bob[1])}\n")

            def swapped() -> bool:
                # Used all along (the origin closes a connection idle for 10 s).
                assert tunnel_get(tunnel) == 200, "the tunnel opened before the change works"
                return (
                    through(squid, tls_origin, *bob).ok
                    and through(squid, tls_origin, *alice).connect_status == 407
                )

            wait_until(swapped, 120, "bob accepted and alice refused", interval=0.5)
            assert tunnel_get(tunnel) == 200
        assert through(squid, tls_origin, USERNAME).ok
    finally:
        squid.stop()


@contextlib.contextmanager
def open_tunnel(
    gateway: GatewaySquid,
    origin: TlsOrigin,
    username: str,
    password: str,
    source: str = "127.0.0.1",
) -> Iterator[ssl.SSLSocket]:
    """A CONNECT tunnel through the gateway from client address `source`, TLS to the
    origin, one GET done; kept open."""
    credentials = base64.b64encode(f"{username}:{password}".encode()).decode()
    target = f"{origin.host}:{origin.port}"
    front = ("127.0.0.1", gateway.front.port)
    sock = socket.create_connection(front, timeout=10, source_address=(source, 0))
    try:
        sock.sendall(
            f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
            f"Proxy-Authorization: Basic {credentials}\r\n\r\n".encode()
        )
        assert read_head(sock).startswith(b"HTTP/1.1 200")
        with origin.client_ssl_context.wrap_socket(sock, server_hostname=origin.host) as tls:
            assert tunnel_get(tls) == 200
            yield tls
    finally:
        sock.close()


def tunnel_get(tls: ssl.SSLSocket) -> int:
    """GET / over an open tunnel, keeping the connection: the origin's status."""
    tls.sendall(b"GET / HTTP/1.1\r\nHost: origin\r\n\r\n")
    reply = b""
    while not reply.endswith(b"\r\n\r\nok"):  # the origin answers "ok" to every request
        chunk = tls.recv(4096)
        assert chunk, f"the tunnel closed after {reply!r}"
        reply += chunk
    return int(reply.split(b" ", 2)[1])


def test_a_client_that_does_not_ask_is_cut_and_an_idle_tunnel_is_not(
    gateway: GatewaySquid,
    members: Members,
    tls_origin: TlsOrigin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(TlsRequestHandler, "timeout", 120)  # the origin keeps idle tunnels
    target = f"{tls_origin.host}:{tls_origin.port}"
    with open_tunnel(gateway, tls_origin, USERNAME, PASSWORD) as tunnel:
        front = ("127.0.0.1", gateway.front.port)
        with (
            socket.create_connection(front) as silent,
            socket.create_connection(front) as half_head,
        ):
            half_head.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n".encode())
            wait_until(
                lambda: closed_by_peer(silent) and closed_by_peer(half_head),
                STEP_DEADLINE,
                "the gateway cutting a silent client and one that sent half a request head",
            )
        # The tunnel sat idle past both timeouts: a tunnel is no request waiting.
        assert tunnel_get(tunnel) == 200


def test_one_client_address_holds_at_most_its_connections(
    state_dir: Path, config: Config, members: Members, tls_origin: TlsOrigin
) -> None:
    squid = GatewaySquid(
        config.proxy_settings(),
        state_dir / ".capped",
        ("127.0.0.1", free_port()),
        client_connections=2,
    )
    greedy = "127.0.0.5"

    def connect_from(source: str) -> bytes:
        """The gateway's answer head to a CONNECT from `source` (b"" if it hung up)."""
        front = ("127.0.0.1", squid.front.port)
        target = (tls_origin.host, tls_origin.port)
        with socket.create_connection(front, timeout=10, source_address=(source, 0)) as sock:
            try:
                sock.sendall(connect_request(USERNAME, PASSWORD, target))
                return read_head(sock)
            except OSError:
                return b""

    try:
        squid.start(list(members.by_member.values()))
        with (
            open_tunnel(squid, tls_origin, USERNAME, PASSWORD, source=greedy),
            open_tunnel(squid, tls_origin, USERNAME, PASSWORD, source=greedy),
        ):
            assert not connect_from(greedy).startswith(b"HTTP/1.1 200"), "a third is dropped"
            assert connect_from("127.0.0.6").startswith(b"HTTP/1.1 200"), "others are not"
        wait_until(
            lambda: connect_from(greedy).startswith(b"HTTP/1.1 200"),
            STEP_DEADLINE,
            "the address served again once its tunnels closed",
        )
    finally:
        squid.stop()


def test_the_routers_port_comes_from_below_the_ephemeral_range_and_skips_taken_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A port from the ephemeral range can become any process's outgoing
    # connection between the check and the router's bind; below it, it cannot.
    # A range of its own (15000..15004, which nothing of the suite uses), so
    # other tests' gateways cannot take its ports meanwhile.
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("15005\t60999\n")
    monkeypatch.setattr(gateway_squid, "EPHEMERAL_RANGE", str(ranges))
    monkeypatch.setattr(gateway_squid, "ROUTER_PORTS_FROM", 15000)
    window = sorted(range(15000, 15005))
    with contextlib.ExitStack() as stack:
        for port in window[:4]:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", port))
        assert gateway_squid._free_port() == window[4]
        sock = stack.enter_context(socket.socket())
        sock.bind(("127.0.0.1", window[4]))
        with pytest.raises(GatewayError, match=r"no free loopback port in 15000\.\.15004"):
            gateway_squid._free_port()


@pytest.mark.skipif(os.geteuid() != 0, reason="a boundary only when the gateway runs as root")
def test_links_planted_in_the_state_dir_write_nothing_of_roots(
    state_dir: Path, config: Config, members: Members, tls_origin: TlsOrigin
) -> None:
    """Squid's user, holding a worker a client took over, plants links where the gateway writes.

    Followed, the gateway (root) would overwrite, chmod and chown the file a
    link names. Squid's user cannot write the state directory; links that
    are there all the same (as in a directory it could once write) are
    replaced or removed, never followed, by a membership change, a users
    change and a restart.
    """
    target = state_dir / "root-only"
    target.write_text("root's own\n")
    target.chmod(0o600)
    before = target.stat()
    alice, bob = ("alice", "alice-password-1"), ("bob", "bob-password-2")
    listen = ("127.0.0.1", free_port())
    directory = state_dir / ".planted"
    users = f"{alice[0]}:{hash_password(alice[1])} tunnels=2\n"
    squid = GatewaySquid(config.proxy_settings(), directory, listen, users=users)
    try:
        squid.start(list(members.by_member.values()))
        account = pwd.getpwnam(SQUID_USER)
        planting = subprocess.run(
            ["ln", "-s", str(target), str(directory / "planted")],
            capture_output=True,
            user=account.pw_uid,
            group=account.pw_gid,
            extra_groups=[],
            check=False,
        )
        assert planting.returncode != 0, "Squid's user may write the state directory"
        names = {p.name for p in directory.iterdir() if p.is_file()}
        # What a users change writes, then (for a restart) every file.
        written = {"users"}
        assert {"squid.conf", "users", "router.log", "cache.log", "squid.pid"} <= names
        plant(directory, written, target)
        squid.install_users(users + f"{bob[0]}:{hash_password(bob[1])}\n")
        squid.apply(list(members.by_member.values())[:2])
        assert through(squid, tls_origin, USERNAME).ok
        squid.stop()
        plant(directory, names, target)
        squid = GatewaySquid(config.proxy_settings(), directory, listen, users=users)
        squid.start(list(members.by_member.values()))
        assert through(squid, tls_origin, *alice).ok
    finally:
        squid.stop()
    after = target.stat()
    assert target.read_text() == "root's own\n"
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )


def plant(directory: Path, names: set[str], target: Path) -> None:
    """Links to `target` at `names` in `directory`, and at the temporary names of each."""
    for name in (*names, *(f".{n}.tmp" for n in names), *(f"{n}.new" for n in names)):
        (directory / name).unlink(missing_ok=True)
        (directory / name).symlink_to(target)


def test_what_a_client_sends_forges_no_router_log_line(
    gateway: GatewaySquid, tls_origin: TlsOrigin
) -> None:
    """The router's log is what metrics and the session map read, a line a field each.

    Sent straight to the router's loopback port, as any local process may:
    a username and a target with line breaks and spaces stay one field each.
    """
    forged = "\n1.000 1 200 TCP_TUNNEL/FIRSTUP_PARENT session-0 10.0.0.1 1 CONNECT a:1 x\n"
    username = f"{USERNAME}-session-k{forged}"
    for target in (f"{tls_origin.host}:{tls_origin.port}", "a:1\nforged:2"):
        with socket.create_connection(("127.0.0.1", gateway.router.port), timeout=10) as sock:
            credentials = base64.b64encode(f"{username}:{PASSWORD}".encode()).decode()
            sock.sendall(
                f"CONNECT {target} HTTP/1.1\r\nProxy-Authorization: Basic {credentials}\r\n\r\n"
                .encode()
            )  # fmt: skip
            assert sock.recv(100).startswith(b"HTTP/1.1 407 ")

    def logged() -> list[str]:
        return gateway.router.access_log.read_text().splitlines()

    wait_until(lambda: len(logged()) >= 2, DEADLINE, "both requests in the router's log")
    assert all(len(line.split()) == 10 for line in logged()), logged()
    assert not any(line.startswith("1.000 ") for line in logged()), logged()


def test_open_tunnels_are_those_a_member_granted_counted_for_its_pool(
    state_dir: Path, config: Config, members: Members, tls_origin: TlsOrigin
) -> None:
    """What each pool's demand is made of: not a client refused, nor one still asking."""
    pool_of = {f"{POOL}/0": "pool-eu", f"{POOL}/1": "pool-us", f"{POOL}/2": "pool-us"}
    gateway = GatewaySquid(
        config.proxy_settings(),
        state_dir / ".pools",
        ("127.0.0.1", free_port()),
        pool_of=pool_of.get,
    )
    try:
        gateway.start(list(members.by_member.values()))
        assert gateway.open_tunnels() == Tunnels(0, {})
        with contextlib.ExitStack() as stack:
            for member in (f"{POOL}/0", f"{POOL}/1", f"{POOL}/2"):
                pinned = f"{USERNAME}-proxy-{member}"
                stack.enter_context(open_tunnel(gateway, tls_origin, pinned, PASSWORD))
            silent = stack.enter_context(
                socket.create_connection(("127.0.0.1", gateway.front.port))
            )
            silent.sendall(b"CONNECT ")  # half a head: Squid waits, the router never sees it
            assert through(gateway, tls_origin, USERNAME, "wrong").connect_status == 407
            assert gateway.open_tunnels() == Tunnels(3, {"pool-eu": (1, 1), "pool-us": (2, 2)})
        wait_until(
            lambda: gateway.open_tunnels() == Tunnels(0, {"pool-eu": (0, 1), "pool-us": (0, 2)}),
            DEADLINE,
            "the closed tunnels to end, still counted as granted",
        )
    finally:
        gateway.stop()
