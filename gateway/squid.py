"""The gateway's processes: Squid at the front, the router behind it.

    client -> Squid, the front (listen address) -> router (loopback) -> pool member

Squid faces the clients with the proxies' own rules (client CIDRs, CONNECT
only, allowed ports, denied destinations, timeouts, connections per client
address) and passes every request on to the router (`never_direct`,
`login=PASSTHRU`), its one parent. The router (gateway/router.py) checks the
credentials, picks the member and relays. Its config never changes while it
runs: a membership change is a line on the router's standard input, in
force before the next request, with nothing reloaded, paused or cut.

Every file lives in the gateway's state directory: squid.conf, the users
file's copy, the router's copy and its access log, Squid's access and cache
logs, squid.out. The directory is private to the gateway and Squid's user,
who may read it and not write it: the gateway runs as root, and a Squid or
router that a client took over must not plant a file or link there that the
gateway or Squid's master (also root) would then write through or read as a
config. What Squid's user writes (the logs) is made for it, as its own.

The fleet's password reaches the router on its standard input alone: no
file, argument or environment holds it, and Squid, which parses what
clients send first, never sees it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gateway.routing import is_stand_in
from proxy_operator import username as username_module
from squid import gateway as squid_gateway
from squid import procfs
from squid.conf import SQUID_USER, ProxySettings, SquidPaths, render_gateway_front
from squid.gateway import ROUTER_RESYNC, GatewayMember
from squid.process import (
    SquidError,
    SquidExited,
    accepts,
    await_ready,
    bindable,
    clear_stale_pid_file,
    environment,
    excerpt,
    find_binary,
    launch,
    log_excerpt,
    make_dir,
    make_writable,
    parse_errors,
    remove_planted,
    remove_shm,
    service_name,
    squid_account,
    squid_dir,
    stop,
    write_file,
)

log = logging.getLogger("proxy_operator.gateway")

# The router and the modules it imports, copied into the gateway's directory
# at start: it runs as Squid's user, which may not reach the installed files
# (a checkout or virtualenv under /root). Standard library only.
ROUTER = Path("gateway/router.py")
_HERE = Path(__file__).resolve()
ROUTER_SOURCES = {
    ROUTER: _HERE.with_name("router.py"),
    Path("gateway/__init__.py"): None,
    Path("gateway/relay.py"): _HERE.with_name("relay.py"),
    Path("gateway/routing.py"): _HERE.with_name("routing.py"),
    Path("gateway/users.py"): _HERE.with_name("users.py"),
    Path("proxy_operator/__init__.py"): None,
    Path("proxy_operator/username.py"): Path(username_module.__file__).resolve(),
    Path("squid/__init__.py"): None,
    Path("squid/gateway.py"): Path(squid_gateway.__file__).resolve(),
}
ROUTER_DIR = "router"
# The router's loopback port comes from below the kernel's ephemeral range
# (`_free_port`), from 26000 up: clear of the local provider's default
# 20000..20999 and of the suite's and benchmarks' local Squids (21000..25999).
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL_LOW = 32768
ROUTER_PORTS_FROM = 26000
START_DEADLINE = 30.0
# A membership change is one line the router reads between two requests.
APPLY_DEADLINE = 30.0
# The front is reloaded at most this many times at start until its probe finds the router.
FRONT_RELOADS = 3
STOP_GRACE = 10.0
# Lines of Squid's cache.log the gateway waits for.
ACCEPTING = "Accepting HTTP Socket connections"
RECONFIGURING = "Reconfiguring Squid Cache"
PEER_UP = "peerConnectSucceded: TCP connection to"
PEER_DOWN = "peerConnectFailedSilent: TCP connection to"


class GatewayError(Exception):
    """The gateway's Squid or router would not start, parse its config or take members."""


class GatewayTimeout(GatewayError):
    """What the gateway's Squid was waited for did not come in time (it still runs)."""


@dataclass(frozen=True)
class Listener:
    """Where one of the gateway's processes listens, and its access log."""

    role: str
    address: str
    port: int
    access_log: Path


@dataclass(frozen=True)
class Tunnels:
    """The router's count: tunnels open now that a member granted, and per pool (open
    now, granted since the router started); a pool that granted none is not listed."""

    open: int
    pools: dict[str, tuple[int, int]]


class GatewaySquid:
    """Starts, updates and stops the gateway's Squid and router; blocking calls."""

    def __init__(
        self,
        settings: ProxySettings,
        state_dir: Path,
        listen: tuple[str, int],
        squid_binary: str = "squid",
        users: str | None = None,
        client_connections: int | None = None,
        pool_of: Callable[[str], str | None] = lambda member: None,
    ) -> None:
        """`users` is a users file's text (gateway/users.py), checked; None: the fleet's
        credential alone. `client_connections`: the most connections one client address
        may hold at the front; None, no cap. `pool_of`: a member's pool, which its
        tunnels count for (`open_tunnels`)."""
        self._settings = settings
        self._pool_of = pool_of
        self._users = users
        self._client_connections = client_connections
        try:
            self._binary = find_binary(squid_binary)
            self._account = squid_account()
        except SquidError as err:
            raise GatewayError(str(err)) from err
        # Squid's user must reach every file: a --state-dir it cannot (under
        # /root, run as root) is swapped for one of the system's.
        self.directory = squid_dir(state_dir, self._account)
        self._service = service_name(str(self.directory))
        self.process: subprocess.Popen[bytes] | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None
        self.router_process: subprocess.Popen[str] | None = None
        self._router_lock = threading.Lock()
        # What the router wrote that was not read yet, and the questions whose answers
        # the gateway stopped waiting for (still to come, in order).
        self._router_read = b""
        self._unanswered = 0
        host, port = listen
        self.front = Listener("front", host, port, self.directory / "front.log")
        self.router = self._new_router()
        # The members in rotation, in the router's order (gateway/routing.py), stand-ins last.
        self.members: tuple[GatewayMember, ...] = ()
        self._in_force: frozenset[GatewayMember] = frozenset()  # `members`, to compare
        # The router's members (by id, in its order) and stand-ins, and the generation
        # they are; None when unknown (a change unanswered): the next goes whole.
        self._routed: dict[str, GatewayMember] = {}
        self._stand_ins: tuple[GatewayMember, ...] = ()
        self._generation: int | None = None
        self._generations = itertools.count(1)

    def _new_router(self) -> Listener:
        return Listener("router", "127.0.0.1", _free_port(), self.directory / "router.log")

    @property
    def conf(self) -> Path:
        return self.directory / "squid.conf"

    @property
    def _pid_file(self) -> Path:
        return self.directory / "squid.pid"

    @property
    def cache_log(self) -> Path:
        return self.directory / "cache.log"

    @property
    def _squid_out(self) -> Path:
        """Squid's stdout and stderr: its errors from before it opens cache.log."""
        return self.directory / "squid.out"

    @property
    def _router_err(self) -> Path:
        """The router's stderr: why it would not start, or a traceback if it fell over."""
        return self.directory / "router.err"

    # ---- the lifecycle ----------------------------------------------------------------

    def start(self, members: Sequence[GatewayMember]) -> None:
        """Start the router on `members`, then Squid; return once both serve."""
        self._make_dir(self.directory)
        python = self._install_router()
        if self._users is not None:
            self.install_users(self._users)
        front = self.front
        if not bindable(front.address, front.port):
            # Squid would start without it and log nothing: say so now.
            raise GatewayError(f"--listen {front.address}:{front.port}: the address is in use")
        try:
            try:
                self._start_router(python, members)
            except GatewayError:
                if bindable(self.router.address, self.router.port):
                    raise
                # Between _free_port's check and the router's bind another
                # process took its port: once more, on another.
                log.warning("the router's port %d was taken; starting again", self.router.port)
                self._stop_router()
                self.router = self._new_router()
                self._start_router(python, members)
            self._launch()
        except BaseException:
            self.stop()  # a gateway that did not start leaves nothing behind
            raise
        log.info("started Squid on %s:%s", self.front.address, self.front.port)

    def _start_router(self, python: str, members: Sequence[GatewayMember]) -> None:
        make_writable(self.router.access_log, self._account)
        command = [
            python,
            str(self.directory / ROUTER_DIR / ROUTER),
            str(self.router.port),
            str(self.router.access_log),
            self._settings.username,
        ]
        if self._users is not None:
            command += ["--users", str(self._users_copy)]
        uid, gid = self._account if self._account is not None else (None, None)
        remove_planted(self._router_err)
        self._router_read, self._unanswered = b"", 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(self._router_err, flags, 0o640), "w") as err:
            # A session of its own, as Squid's: a Ctrl-C to the gateway's process
            # group must not end it before the gateway stops Squid in front of it.
            self.router_process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=environment(),
                text=True,
                user=uid,
                group=gid,
                extra_groups=None if uid is None else [],  # not root's groups
                start_new_session=True,
            )
        self._tell_router({"password": self._settings.password}, "listening", START_DEADLINE)
        self._send_members(members)

    def _launch(self) -> None:
        """Write squid.conf, start Squid and its watchdog; return once it serves."""
        self._write_checked(self.conf, self._front_conf())
        remove_shm(self._service)
        clear_stale_pid_file(self._pid_file)
        for log_file in (self.cache_log, self.front.access_log):
            make_writable(log_file, self._account)
        offset = self._cache_log_size()
        self.process = launch(
            [self._binary, "--foreground", "-f", str(self.conf), "-n", self._service],
            self.directory,
            self._squid_out,
        )
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "gateway.watchdog", str(self.process.pid), self._service],
            env=_watchdog_environment(),
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        self._await(
            partial(self._accepting, offset),
            f"Squid not accepting on {self.front.address}:{self.front.port}",
            START_DEADLINE,
        )
        self._await_front_finds_router(offset)

    def _await_front_finds_router(self, offset: int) -> None:
        """Reload the front until a probe since `offset` found the router up.

        Squid counts a parent whose first probe failed down until a request
        makes it probe again (and that request fails). On a starved machine
        a probe can time out, or a reload not come (seen once in a loaded
        run), so each try waits a share of START_DEADLINE and the next sends
        SIGHUP again. Only at start: the front never reloads once it serves.
        """
        wait = START_DEADLINE / FRONT_RELOADS
        for _ in range(FRONT_RELOADS):
            with contextlib.suppress(GatewayTimeout):
                self._await(partial(self._probed, offset), "Squid has not probed the router", wait)
            if self._logged(offset, PEER_UP) > 0:
                return
            offset = self._cache_log_size()
            self._reload_front()
        if self._logged(offset, PEER_UP) == 0:
            came = self._logged(offset, RECONFIGURING) > 0
            output = self._scrub(log_excerpt(self._squid_out, self.cache_log))
            raise GatewayError(
                f"Squid's probes did not find the router up after {FRONT_RELOADS} reloads "
                f"(the last one {'came' if came else 'never came'}): {output}"
            )

    def _probed(self, offset: int) -> bool:
        return self._logged(offset, PEER_UP) + self._logged(offset, PEER_DOWN) > 0

    def _reload_front(self) -> None:
        pid = self.worker_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it died: the master starts it anew
                os.kill(pid, signal.SIGHUP)

    @property
    def in_force(self) -> frozenset[GatewayMember]:
        """The members in rotation (`members`) as a set: what the next change is compared with."""
        return self._in_force

    def apply(self, members: Sequence[GatewayMember]) -> bool:
        """Put `members` in rotation; False when nothing changed. In force on return.

        The router gets what changed, not the members whole: it applies a
        change on the event loop that serves every request (gateway/routing.py).
        """
        now, before = set(members), self._in_force
        if now == before:
            return False
        if self._generation is None:
            self._send_members(members)
        else:
            self._send_change(members, now - before, before - now)
        return True

    def _send_members(self, members: Sequence[GatewayMember]) -> None:
        """Give the router `members` whole: at start, and whenever its generation is unknown
        or it asks (a change it did not apply)."""
        generation = next(self._generations)
        routed: dict[str, GatewayMember] = {}
        for member in members:
            if not is_stand_in(member.member):
                routed.pop(member.member, None)  # the last of an id, last: as the router
                routed[member.member] = member
        stand_ins = tuple(m for m in members if is_stand_in(m.member))
        self._generation = None
        self._tell_router(
            {"members": [self._listed(m) for m in members], "generation": generation},
            f"members {len(routed) + len(stand_ins)} {generation}",
            APPLY_DEADLINE,
        )
        self._routed, self._stand_ins, self._generation = routed, stand_ins, generation
        self.members = (*routed.values(), *stand_ins)
        self._in_force = frozenset(members)

    def _send_change(
        self,
        members: Sequence[GatewayMember],
        arrived: AbstractSet[GatewayMember],
        departed: AbstractSet[GatewayMember],
    ) -> None:
        """Give the router the change from the members it has to `members` (`arrived`
        and `departed` from one to the other), or `members` whole if it asks."""
        arriving = {m.member: m for m in arrived if not is_stand_in(m.member)}
        leaving = [
            m.member for m in departed if m.member not in arriving and m.member in self._routed
        ]
        # A member whose exit address alone changed: the router routes by none of it.
        routed = self._routed
        entering = [m for m in arriving.values() if not _routes_alike(routed.get(m.member), m)]
        stand_ins = self._stand_ins
        if any(is_stand_in(m.member) for m in arrived | departed):
            stand_ins = tuple(m for m in members if is_stand_in(m.member))
        if entering or leaving or stand_ins != self._stand_ins:
            generation = next(self._generations)
            change: dict[str, object] = {
                "after": self._generation,
                "generation": generation,
                "in": [self._listed(m) for m in entering],
                "out": leaving,
            }
            if stand_ins != self._stand_ins:
                change["stand_ins"] = [self._listed(m) for m in stand_ins]
            self._generation = None  # unknown until the router answers
            count = len(self._routed) - len(leaving) + len(arriving.keys() - self._routed.keys())
            line = self._ask_router({"change": change}, APPLY_DEADLINE)
            if line == ROUTER_RESYNC:
                self._send_members(members)
                return
            if line != f"members {count + len(stand_ins)} {generation}":
                raise GatewayError(f"the router answered {line!r}: {self._router_failure()}")
            self._generation = generation
        for gone in leaving:
            del self._routed[gone]
        moved = {m.member for m in entering}
        for member in arriving.values():
            if member.member in moved:
                self._routed.pop(member.member, None)  # to the end, as the router
            self._routed[member.member] = member
        self._stand_ins = stand_ins
        self.members = (*self._routed.values(), *stand_ins)
        self._in_force = (self._in_force - departed) | arrived

    def _listed(self, member: GatewayMember) -> dict[str, object]:
        """`member` as the router reads it (gateway/router.py)."""
        return {
            "member": member.member,
            "host": member.host,
            "port": member.port,
            "zone": member.zone,
            "region": member.region,
            "provider": member.provider,
            "pool": self._pool_of(member.member),
        }

    def open_tunnels(self) -> Tunnels:
        """Tunnels open now that a member granted, and per pool: what demand is made of.

        Counted by the router, where tunnels open and close: a client refused
        (no or wrong credentials, a port not allowed) or still being checked
        holds none, however long its check takes.
        """
        line = self._ask_router({"tunnels": None}, APPLY_DEADLINE)
        word, _, rest = line.partition(" ")
        count, _, pools = rest.partition(" ")
        try:
            by_pool = json.loads(pools)
            tunnels = Tunnels(
                int(count), {str(p): (int(n[0]), int(n[1])) for p, n in by_pool.items()}
            )
        except (ValueError, TypeError, AttributeError, IndexError):
            tunnels = None
        if word != "tunnels" or not count.isdigit() or tunnels is None:
            raise GatewayError(f"the router answered {line!r}: {self._router_failure()}")
        return tunnels

    def _tell_router(self, message: dict[str, object], answer: str, deadline: float) -> None:
        """Send the router one line; return once it answers `answer`."""
        line = self._ask_router(message, deadline)
        if line != answer:
            raise GatewayError(f"the router answered {line!r}: {self._router_failure()}")

    def _ask_router(self, message: dict[str, object], deadline: float) -> str:
        """Send the router one line and read its answer (one question at a time: a change
        and a demand sample come from different threads)."""
        router = self.router_process
        if router is None or router.stdin is None or router.stdout is None:
            raise GatewayError("the router was never started")
        with self._router_lock:
            try:
                router.stdin.write(json.dumps(message) + "\n")
                router.stdin.flush()
            except OSError as err:
                raise GatewayError(f"the router is gone: {self._router_failure()}") from err
            # The router answers every line in turn: the answers to questions that
            # timed out come first, and are not this one's.
            self._unanswered += 1
            end = time.monotonic() + deadline
            while self._unanswered:
                try:
                    line = self._router_line(router.stdout.fileno(), end)
                except GatewayTimeout:
                    raise GatewayTimeout(f"the router did not answer in {deadline:.0f}s") from None
                self._unanswered -= 1
            return line

    def _router_line(self, stdout: int, end: float) -> str:
        """The router's next answer line, by monotonic time `end`, read here alone (a
        buffered reader would hide a second line from `select`)."""
        while b"\n" not in self._router_read:
            ready, _, _ = select.select([stdout], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                raise GatewayTimeout("the router did not answer in time")
            chunk = os.read(stdout, 1 << 16)
            if not chunk:
                raise GatewayError(f"the router is gone: {self._router_failure()}")
            self._router_read += chunk
        line, _, self._router_read = self._router_read.partition(b"\n")
        return line.decode(errors="replace").strip()

    def _router_failure(self) -> str:
        router = self.router_process
        if router is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                router.wait(timeout=1)
        return self._scrub(excerpt(self._router_err.read_text(errors="replace")))

    def stop(self) -> None:
        """SIGTERM Squid (SIGKILL if it lingers) and remove its shm segments; end the router.

        Workers whose master was killed outlive it, serving and holding the
        listen address: whatever is left of Squid's process group is killed.
        The watchdog is told last, when there is nothing left for it to do.
        """
        process = self.process
        if process is not None:
            try:
                stop(process.pid, lambda: process.poll() is not None, STOP_GRACE, group=True)
            except SquidError as err:
                raise GatewayError(str(err)) from err
        remove_shm(self._service)
        self._stop_router()
        _end_by_its_input(self.watchdog)

    def _stop_router(self) -> None:
        """End the router: its standard input closed is its signal to go."""
        _end_by_its_input(self.router_process)

    def running(self) -> bool:
        """Squid and the router serve, and the watchdog would end Squid if this process died."""
        processes = (self.process, self.watchdog, self.router_process)
        return all(p is not None and p.poll() is None for p in processes)

    def worker_pid(self) -> int | None:
        """The pid of Squid's worker now (the master starts a new one if it dies)."""
        if self.process is None:
            return None
        return _kid_pid(self.process.pid, 1)

    # ---- steps ----------------------------------------------------------------------------

    def _paths(self) -> SquidPaths:
        return SquidPaths(
            htpasswd=str(self.directory / "htpasswd"),
            pid_file=str(self._pid_file),
            access_log=f"stdio:{self.front.access_log}",
            cache_log=str(self.cache_log),
            coredump_dir=str(self.directory),
            effective_user=SQUID_USER if self._account is not None else None,
            http_address=self.front.address,
        )

    @property
    def _users_copy(self) -> Path:
        """The users file as the router reads it (Squid's user may not reach the original)."""
        return self.directory / "users"

    def install_users(self, text: str) -> None:
        """Replace the users the router checks (atomically: it reads the file as it changes).

        Takes effect at the next check of each username; nothing reloads,
        and open tunnels are not touched.
        """
        candidate = self._users_copy.with_name("users.new")
        self._write(candidate, text)
        candidate.replace(self._users_copy)

    def _front_conf(self) -> str:
        settings = replace(self._settings, port=self.front.port)
        return render_gateway_front(
            settings, self._paths(), self.router.port, self._client_connections
        ).squid_conf

    def _write(self, path: Path, text: str) -> None:
        write_file(path, text, 0o640, None if self._account is None else self._account[1])

    def _make_dir(self, path: Path) -> None:
        """A directory of the gateway's that Squid's user may enter and not write; nobody else."""
        make_dir(path, None if self._account is None else self._account[1])

    def _install_router(self) -> str:
        """Copy the router where Squid's user reads it; return an interpreter that runs it.

        The interpreter is this one if Squid's user can run the router with
        it, else the system's python3 (it needs the standard library alone).
        Tried for real, as that user, so a router that could not run fails
        the start with the reason.
        """
        root = self.directory / ROUTER_DIR
        self._make_dir(root)
        for relative, source in ROUTER_SOURCES.items():
            target = root / relative
            self._make_dir(target.parent)
            self._write(target, "" if source is None else source.read_text())
        check = [str(root / ROUTER), "--check"]
        system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
        failures = []
        for python in dict.fromkeys([sys.executable, *([system] if system else [])]):
            failure = self._router_fails([python, *check])
            if failure is None:
                return python
            failures.append(f"{python}: {failure}")
        raise GatewayError(
            f"user {SQUID_USER!r} cannot run the gateway's router with "
            f"{' nor '.join(failures)}; install python3 (3.11 or newer) for it"
        )

    def _router_fails(self, command: list[str]) -> str | None:
        """Why Squid's user cannot run `command`, or None if it can."""
        uid, gid = self._account if self._account is not None else (None, None)
        try:
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                env=environment(),
                capture_output=True,
                text=True,
                timeout=START_DEADLINE,
                check=False,
                user=uid,
                group=gid,
                extra_groups=None if uid is None else [],
            )
        except (OSError, subprocess.SubprocessError) as err:
            return str(err)
        return None if result.returncode == 0 else excerpt(result.stderr + result.stdout)

    def _write_checked(self, path: Path, text: str) -> None:
        """Write `path` once Squid has parsed it, so Squid never reads a bad one."""
        candidate = path.with_name(path.name + ".new")
        self._write(candidate, text)
        rejected = parse_errors(self._binary, candidate)
        if rejected is not None:
            raise GatewayError(f"squid rejected {path}: {self._scrub(rejected)}")
        candidate.replace(path)

    def _scrub(self, text: str) -> str:
        """Nothing the gateway shows may carry the members' password."""
        password = self._settings.password
        for secret in {password, quote(password, safe="")}:
            text = text.replace(secret, "***")
        return text

    def _accepting(self, offset: int) -> bool:
        return self._logged(offset, ACCEPTING) > 0 and accepts(self.front.address, self.front.port)

    def _cache_log_size(self) -> int:
        try:
            return self.cache_log.stat().st_size
        except FileNotFoundError:
            return 0

    def _logged(self, offset: int, text: str) -> int:
        """How many lines of cache.log after byte `offset` hold `text`."""
        try:
            with self.cache_log.open("rb") as cache_log:
                cache_log.seek(offset)
                tail = cache_log.read()
        except FileNotFoundError:
            return 0
        wanted = text.encode()
        return sum(1 for line in tail.splitlines() if wanted in line)

    def _await(self, ready: Callable[[], bool], failure: str, deadline: float) -> None:
        """Wait until `ready` holds; GatewayError with Squid's logs if it exits or time is up."""
        if self.process is None:
            raise GatewayError(f"{failure}: Squid was never started")
        logs = (self._squid_out, self.cache_log)
        try:
            if await_ready(self.process, ready, deadline, logs):
                return
        except SquidExited as exited:
            raise GatewayError(f"Squid exited: {self._scrub(exited.excerpt)}") from None
        output = self._scrub(log_excerpt(*logs))
        raise GatewayTimeout(f"{failure} after {deadline:.0f}s: {output}")


def _end_by_its_input(process: subprocess.Popen[Any] | None) -> None:
    """Close the standard input of a process that ends with it; kill it if it lingers."""
    if process is None:
        return
    with contextlib.suppress(OSError):
        if process.stdin is not None:
            process.stdin.close()
    try:
        process.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _watchdog_environment() -> dict[str, str]:
    """Squid's environment, and where Python finds this package: the watchdog needs no secret."""
    found = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    return {**environment(), **found}


def _kid_pid(master: int, number: int) -> int | None:
    """The pid of the master's worker `number`: its child run as `--kid squid-<number>`."""
    wanted = f"squid-{number}".encode()
    return next(
        (pid for pid in procfs.children(master) if wanted in procfs.command_line(pid)), None
    )


def _routes_alike(before: GatewayMember | None, after: GatewayMember) -> bool:
    """Whether the router routes `after` as `before` (their exit addresses aside)."""
    return before is not None and replace(after, exit_address=before.exit_address) == before


def _free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range.

    Between this check and the router's bind the port is free for anyone:
    one from the ephemeral range (what binding port 0 gives) can meanwhile
    become the local end of any process's outgoing connection, and the
    router then never listens (seen once in the suite). Below the range,
    only an explicit bind can take it.
    """
    low = _ephemeral_low()
    window = range(ROUTER_PORTS_FROM if low > ROUTER_PORTS_FROM + 1 else 1024, low)
    for port in random.sample(window, len(window)):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise GatewayError(f"no free loopback port in {window.start}..{window.stop - 1}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unreadable)."""
    try:
        return int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW
