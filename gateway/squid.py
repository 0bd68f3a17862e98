"""The gateway's Squid: one SMP Squid whose workers have roles.

    client -> front worker (listen address) -> back worker 2 or 3 (loopback) -> pool member

    squid.conf:  workers 3
                 if ${process_number} = 2    kid 2, a back: include back-2.conf
                 if ${process_number} = 3    kid 3, a back: include back-3.conf
                 if ${process_number} = 1    kid 1, the front: include front.conf
                 (and front.conf for the master, 0, and the coordinator, kid 4)

A membership change rewrites the backs' configs and reloads one back at a
time (SIGHUP to that worker); the front never reloads. What makes that lose
nothing:

- The front is paused (SIGSTOP) while a back reloads, from SETTLE before
  the SIGHUP until that back accepts again. Squid 5.7 rebuilds every
  cache_peer on a reconfigure, and a CONNECT whose connect to a member is
  under way at that instant loses its peer: Squid then takes the connection
  for a direct one, answers 200 and relays the client's TLS handshake to the
  member, which answers 400 (measured: 4 such in 14,037 requests over 30
  membership changes without the pause). Paused, the front sends nothing
  new, and what it sent gets past its connect (if that takes under SETTLE)
  before the back reloads.
  Clients' connections wait in the listening socket's queue meanwhile; open
  tunnels stall, and nothing is refused or cut.
- A reloaded back's new peers count as down until Squid's first probe of
  each answers, and a CONNECT it gets before then fails with 500. The front
  tries it again on the other back (each back has a port of its own), and
  the next back is reloaded only once every peer of this one has been
  probed (answering or not: Squid logs both at debug_options 15,2).
- The listening sockets stay open throughout: in SMP mode the coordinator
  opens them and keeps them (Ipc::Coordinator::handleSharedListenRequest
  caches them in `listeners`), and a reloading worker closes only its copy.
  A plain (`-N`) Squid closes its socket while it reconfigures: 2,165
  refused connects over 10 reloads under a tight connect loop
  (docs/architecture.md, "The gateway"; `python -m bench.reconfigure`).

Every file lives in the gateway's state directory: the four configs, the
htpasswd, one access log per worker, the shared cache.log, squid.out. The
back configs hold the members' credentials (cache_peer login=), so the
directory is private to the gateway and Squid's user, who may read it and
not write it: the gateway runs as root, and a Squid worker a client took
over must not plant a file or link there that the gateway or Squid's master
(also root) would then write through or read as a config. What Squid's user
writes (the logs, the tunnel helper's ledger) is made for it, as its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from urllib.parse import quote

from providers import procfs
from providers import squid as squid_module
from providers.squid import (
    NO_MEMBER_PAGE,
    NO_MEMBER_TEMPLATE,
    SQUID_USER,
    TUNNEL_LIMIT_PAGE,
    TUNNEL_LIMIT_TEMPLATE,
    GatewayMember,
    ProxySettings,
    SquidPaths,
    render_gateway_back,
    render_gateway_front,
)
from providers.squid_process import (
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
    remove_shm,
    service_name,
    squid_account,
    squid_dir,
    stop,
    write_file,
)

log = logging.getLogger("proxy_operator.gateway")

# The auth and tunnel helpers and the modules they import, copied into the
# gateway's directory at start: Squid runs them as its own user, which may not
# reach the installed files (a checkout or virtualenv under /root).
AUTH_HELPER = Path("gateway/auth_helper.py")
TUNNEL_HELPER = Path("gateway/tunnel_helper.py")
HELPER_SOURCES = {
    AUTH_HELPER: Path(__file__).resolve().with_name("auth_helper.py"),
    Path("providers/__init__.py"): None,  # the helpers import providers.squid alone
    Path("gateway/__init__.py"): None,  # and gateway.users, gateway.socket_table
    Path("gateway/users.py"): Path(__file__).resolve().with_name("users.py"),
    TUNNEL_HELPER: Path(__file__).resolve().with_name("tunnel_helper.py"),
    Path("gateway/socket_table.py"): Path(__file__).resolve().with_name("socket_table.py"),
    Path("providers/squid.py"): Path(squid_module.__file__).resolve(),
}
HELPER_DIR = "helper"
HELPER_CHECK_TIMEOUT = 30.0
FRONT = 1  # the front's ${process_number}
BACKS = (2, 3)  # the backs'; the coordinator is kid 4
# The backs' loopback ports come from below the kernel's ephemeral range
# (`_free_ports`), from 26000 up: clear of the local provider's default
# 20000..20999 and of the suite's and benchmarks' local Squids (21000..25999).
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL_LOW = 32768
BACK_PORTS_FROM = 26000
START_DEADLINE = 30.0
RELOAD_DEADLINE = 30.0
# How many times the front may reload at start for its probes to find the backs.
FRONT_RELOADS = 3
# How long the paused front waits before a back reloads: longer than the
# connects to members of the CONNECTs it sent that back take.
SETTLE = 0.2
STOP_GRACE = 10.0
# Where Squid's SMP processes put their IPC sockets, `<service>-kid-<n>.ipc`:
# built into Debian's Squid (DEFAULT_STATEDIR), not set in squid.conf. Squid
# leaves them behind when it exits.
IPC_DIR = Path("/var/run/squid")
# Squid's own error page templates (Debian's --datadir): the backs' error_directory
# holds copies of them next to the gateway's page for a username no member admits.
SQUID_ERROR_TEMPLATES = Path("/usr/share/squid/errors/templates")
# How long Squid trusts a checked username when a users file is in use: a
# user taken out of the file is refused from its next check on.
USERS_CREDENTIALS_TTL = "20 seconds"
# What the workers log (cache.log, "kid<n>| ..."): taking connections again,
# the start of a reload, and, at the level their debug_options ask for, a
# probe of a peer that answered or did not.
ACCEPTING = "Accepting HTTP Socket connections"
RECONFIGURING = "Reconfiguring Squid Cache"
PEER_UP = "peerConnectSucceded: TCP connection to"
PEER_DOWN = "peerConnectFailedSilent: TCP connection to"


class GatewayError(Exception):
    """The gateway's Squid would not start, parse its config or reload."""


class GatewayTimeout(GatewayError):
    """What the gateway's Squid was waited for did not come in time (it still runs)."""


@dataclass(frozen=True)
class Worker:
    """One of the Squid's workers: its role, process number, address, config and access log."""

    role: str
    number: int
    address: str
    port: int
    conf: Path
    access_log: Path


class GatewaySquid:
    """Starts, reloads and stops the gateway's Squid; blocking calls."""

    def __init__(
        self,
        settings: ProxySettings,
        state_dir: Path,
        listen: tuple[str, int],
        squid_binary: str = "squid",
        users: str | None = None,
        client_connections: int | None = None,
    ) -> None:
        """`users` is a users file's text (gateway/users.py), checked; None: the fleet's
        credential alone. `client_connections`: the most connections one client address
        may hold at the front; None, no cap."""
        self._settings = settings
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
        self._python: str | None = None  # chosen at start, once the helper is in place
        self.process: subprocess.Popen[bytes] | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None
        host, port = listen
        self.front = self._worker("front", FRONT, host, port)
        self.backs = self._new_backs()
        self.members: tuple[GatewayMember, ...] = ()

    def _new_backs(self) -> list[Worker]:
        ports = _free_ports(len(BACKS))
        return [
            self._worker(f"back-{n}", n, "127.0.0.1", p) for n, p in zip(BACKS, ports, strict=True)
        ]

    def _worker(self, role: str, number: int, address: str, port: int) -> Worker:
        conf, access_log = self.directory / f"{role}.conf", self.directory / f"{role}.log"
        return Worker(role, number, address, port, conf, access_log)

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
    def workers(self) -> list[Worker]:
        return [self.front, *self.backs]

    # ---- the lifecycle ----------------------------------------------------------------

    def start(self, members: Sequence[GatewayMember]) -> None:
        """Render and check the configs, start Squid; return once every worker serves."""
        self.members = tuple(members)
        self._make_dir(self.directory)
        self._python = self._install_helper()
        self._install_error_pages()
        if self._users is not None:
            self.install_users(self._users)
        if not IPC_DIR.is_dir():
            # Squid would start, its workers would never listen, and it would log nothing.
            raise GatewayError(
                f"{IPC_DIR} does not exist; Squid's workers talk over sockets there "
                f"(Debian's squid package creates it at boot): "
                f"`install -d -o {SQUID_USER} -g {SQUID_USER} {IPC_DIR}`"
            )
        if self._account is None and not os.access(IPC_DIR, os.W_OK | os.X_OK):
            raise GatewayError(
                f"Squid's workers talk over sockets in {IPC_DIR}, which this user cannot "
                f"write: run the gateway as root (Squid then runs as {SQUID_USER!r}), or "
                f"make it writable (`sudo chmod 1777 {IPC_DIR}`, again after a reboot)"
            )
        front = self.front
        if not bindable(front.address, front.port):
            # Squid would start without it and log nothing: say so now.
            raise GatewayError(f"--listen {front.address}:{front.port}: the address is in use")
        try:
            self._launch()
        except GatewayTimeout:
            taken = [b for b in self.backs if not bindable(b.address, b.port)]
            if not taken:
                raise
            # Between _free_ports' check and Squid's bind another process took
            # a back's port (Squid then starts that worker without it): once more,
            # on other ports.
            log.warning(
                "the %s worker's port %d was taken before Squid bound it; starting again",
                taken[0].role,
                taken[0].port,
            )
            self.backs = self._new_backs()
            self._launch()
        log.info("started Squid on %s:%s", self.front.address, self.front.port)

    def _launch(self) -> None:
        """Write the configs, start Squid and its watchdog; return once every worker serves
        (stopped again, with nothing left running, if they do not)."""
        self._write_checked(self.front.conf, self._front_conf())
        self._write_backs()
        self._write_checked(self.conf, self._top_conf())
        remove_leftovers(self._service)
        clear_stale_pid_file(self._pid_file)
        for log_file in (self.cache_log, *(worker.access_log for worker in self.workers)):
            make_writable(log_file, self._account)
        offset = self._cache_log_size()
        # --foreground, not -N: -N runs no workers, hence no SMP.
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
        try:
            self._await_serving(offset)
        except BaseException:
            self.stop()  # a gateway that did not start leaves no Squid behind
            raise

    def _await_serving(self, offset: int) -> None:
        """Every worker accepts, every peer was probed, and the front's probes found the backs."""
        for worker in self.workers:
            self._await(
                partial(self._accepting, offset, worker),
                f"{worker.role} worker not accepting on {worker.address}:{worker.port}",
                START_DEADLINE,
            )
        for back in self.backs:
            self._await_probes(offset, back, self._peers(back))
        self._await_probes(offset, self.front, len(self.backs))
        self._await_front_finds_backs(offset)

    def _await_front_finds_backs(self, offset: int) -> None:
        """Reload the front until its probes since `offset` found every back up.

        The workers start together: the front may probe the backs before
        they listen, and Squid counts a peer whose probe failed down until a
        request makes it probe again (and that request fails). A reload
        probes again, now that they listen. On a starved machine a reload's
        probe can time out too, or its reload not come (seen once in a
        loaded test run: no probe logged 30 s after the SIGHUP), so each try
        waits a share of START_DEADLINE and the next sends SIGHUP again.
        """
        wait = START_DEADLINE / FRONT_RELOADS
        for _ in range(FRONT_RELOADS):
            if self._logged(offset, self.front, PEER_UP) >= len(self.backs):
                return
            offset = self._cache_log_size()
            self._signal(self.front, signal.SIGHUP)
            with contextlib.suppress(GatewayTimeout):
                self._await_probes(offset, self.front, len(self.backs), deadline=wait)
        if self._logged(offset, self.front, PEER_UP) < len(self.backs):
            came = self._logged(offset, self.front, RECONFIGURING) > 0
            output = self._scrub(log_excerpt(self._squid_out, self.cache_log))
            raise GatewayError(
                f"the front worker's probes did not find its {len(self.backs)} backs up "
                f"after {FRONT_RELOADS} reloads (the last one "
                f"{'came' if came else 'never came'}): {output}"
            )

    def apply(self, members: Sequence[GatewayMember]) -> bool:
        """Reload the backs, one at a time, onto `members`; False when nothing changed."""
        members = tuple(members)
        if set(members) == set(self.members):
            return False
        previous, self.members = self.members, members
        try:
            self._write_backs()
            for back in self.backs:
                self._reload(back)
        except (GatewayError, subprocess.SubprocessError):
            self.members = previous  # so the same change is tried again
            raise
        return True

    def stop(self) -> None:
        """SIGTERM Squid (SIGKILL if it lingers), then remove its shm segments and IPC sockets.

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
        remove_leftovers(self._service)
        watchdog = self.watchdog
        if watchdog is not None:
            assert watchdog.stdin is not None
            watchdog.stdin.close()
            try:
                watchdog.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                watchdog.kill()
                watchdog.wait()

    def running(self) -> bool:
        """Squid serves, and its watchdog would end it if this process died."""
        return all(p is not None and p.poll() is None for p in (self.process, self.watchdog))

    def worker_pid(self, worker: Worker) -> int | None:
        """The pid of `worker` now (the master starts a new one if a worker dies)."""
        if self.process is None:
            return None
        return _kid_pid(self.process.pid, worker.number)

    # ---- steps ----------------------------------------------------------------------------

    def _paths(self, worker: Worker) -> SquidPaths:
        return SquidPaths(
            htpasswd=str(self.directory / "htpasswd"),
            pid_file=str(self._pid_file),
            access_log=f"stdio:{worker.access_log}",
            cache_log=str(self.cache_log),
            coredump_dir=str(self.directory),
            effective_user=SQUID_USER if self._account is not None else None,
            http_address=worker.address,
        )

    @property
    def _users_copy(self) -> Path:
        """The users file as the auth helper reads it (Squid's user may not reach the original)."""
        return self.directory / "users"

    def install_users(self, text: str) -> None:
        """Replace the users the auth helper checks (atomically: it reads the file as it changes).

        Takes effect at each username's next check, at most USERS_CREDENTIALS_TTL
        away; nothing reloads, and open tunnels are not touched.
        """
        candidate = self._users_copy.with_name("users.new")
        self._write(candidate, text)
        candidate.replace(self._users_copy)

    @property
    def _errors(self) -> Path:
        """The backs' error_directory: Squid's templates, and the gateway's own."""
        return self.directory / "errors"

    def _install_error_pages(self) -> None:
        """Squid's error templates, and NO_MEMBER_TEMPLATE, where the backs read them."""
        if not SQUID_ERROR_TEMPLATES.is_dir():
            raise GatewayError(
                f"{SQUID_ERROR_TEMPLATES} (Squid's error pages, from Debian's squid-common) "
                "does not exist"
            )
        self._make_dir(self._errors)
        for template in SQUID_ERROR_TEMPLATES.iterdir():
            if template.is_file():
                self._write(self._errors / template.name, template.read_text(errors="replace"))
        self._write(self._errors / NO_MEMBER_TEMPLATE, NO_MEMBER_PAGE)
        self._write(self._errors / TUNNEL_LIMIT_TEMPLATE, TUNNEL_LIMIT_PAGE)

    def _front_conf(self) -> str:
        settings = replace(self._settings, port=self.front.port)
        ports = [back.port for back in self.backs]
        paths = self._paths(self.front)
        return render_gateway_front(settings, paths, ports, self._client_connections).squid_conf

    def _write_backs(self) -> None:
        """Render both backs' configs onto `members` (the htpasswd too); reload nothing."""
        assert self._python is not None, "start() installs the helper first"
        wrapper = [self._python, *self._helper_command(AUTH_HELPER)]
        ttl, tunnels = "1 hour", []
        if self._users is not None:
            wrapper += ["--users", str(self._users_copy)]
            ttl = USERS_CREDENTIALS_TTL  # a removed user's next check comes this soon
            tunnels = [self._python, *self._helper_command(TUNNEL_HELPER)]
        for back in self.backs:
            settings = replace(self._settings, port=back.port)
            rendered = render_gateway_back(
                settings, self._paths(back), self.members, wrapper, str(self._errors), ttl, tunnels
            )
            self._write(self.directory / "htpasswd", rendered.htpasswd)
            self._write_checked(back.conf, rendered.squid_conf)

    def _top_conf(self) -> str:
        # Squid reads a nested if by its own condition alone (an inner else
        # inside a false block is taken), hence one flat block per process.
        lines = [
            "# Rendered by proxy-operator-gateway; edits are overwritten.",
            "# Kid 1 is the front; kids 2 and 3 the backs, which reload in turn.",
            f"workers {1 + len(self.backs)}",
        ]
        coordinator = 2 + len(self.backs)
        for number, conf in [
            *((back.number, back.conf) for back in self.backs),
            (self.front.number, self.front.conf),
            (0, self.front.conf),  # the master: the pid file and cache.log are the same
            (coordinator, self.front.conf),
        ]:
            lines += [f"if ${{process_number}} = {number}", f"include {conf}", "endif"]
        return "\n".join([*lines, ""])

    def _write(self, path: Path, text: str) -> None:
        write_file(path, text, 0o640, None if self._account is None else self._account[1])

    def _make_dir(self, path: Path) -> None:
        """A directory of the gateway's that Squid's user may enter and not write; nobody else."""
        make_dir(path, None if self._account is None else self._account[1])

    def _install_helper(self) -> str:
        """Copy the helpers where Squid's user reads them; return an interpreter that runs them.

        The interpreter is this one if Squid's user can run the helpers with
        it, else the system's python3 (they need the standard library
        alone). Tried for real, as that user, so a helper that could not run
        fails the start instead of every client's first request.
        """
        root = self.directory / HELPER_DIR
        self._make_dir(root)
        for relative, source in HELPER_SOURCES.items():
            target = root / relative
            self._make_dir(target.parent)
            self._write(target, "" if source is None else source.read_text())
        # Each helper checks nothing and exits at the end of its input.
        checks = [[*self._helper_command(AUTH_HELPER), "true"]]
        if self._users is not None:
            self._tunnels_ledger.unlink(missing_ok=True)  # a previous run's tunnels are gone
            make_writable(self._tunnels_ledger, self._account)
            checks.append(self._helper_command(TUNNEL_HELPER))
        system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
        failures = []
        for python in dict.fromkeys([sys.executable, *([system] if system else [])]):
            failure = next(filter(None, (self._helper_fails([python, *c]) for c in checks)), None)
            if failure is None:
                return python
            failures.append(f"{python}: {failure}")
        raise GatewayError(
            f"user {SQUID_USER!r} cannot run the gateway's helpers with "
            f"{' nor '.join(failures)}; install python3 (3.11 or newer) for them"
        )

    def _helper_command(self, helper: Path) -> list[str]:
        """How Squid runs `helper` (AUTH_HELPER or TUNNEL_HELPER), but for the interpreter."""
        script = str(self.directory / HELPER_DIR / helper)
        if helper == TUNNEL_HELPER:
            users, ledger = str(self._users_copy), str(self._tunnels_ledger)
            return [script, self._settings.username, users, ledger]
        return [script, self._settings.username]

    @property
    def _tunnels_ledger(self) -> Path:
        """The tunnels the tunnel helper admitted (it creates and keeps the file)."""
        return self.directory / "tunnels"

    def _helper_fails(self, command: list[str]) -> str | None:
        """Why Squid's user cannot run `command`, or None if it can."""
        uid, gid = self._account if self._account is not None else (None, None)
        try:
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                env=environment(),  # what Squid gives the helpers
                capture_output=True,
                text=True,
                timeout=HELPER_CHECK_TIMEOUT,
                check=False,
                user=uid,
                group=gid,
                extra_groups=None if uid is None else [],  # not root's groups
            )
        except (OSError, subprocess.SubprocessError) as err:
            return str(err)
        return None if result.returncode == 0 else excerpt(result.stderr + result.stdout)

    def _write_checked(self, path: Path, text: str) -> None:
        """Write `path` once Squid has parsed it, so a running worker never reads a bad one."""
        candidate = path.with_name(path.name + ".new")
        self._write(candidate, text)
        rejected = parse_errors(self._binary, candidate)
        if rejected is not None:
            raise GatewayError(f"squid rejected {path}: {self._scrub(rejected)}")
        candidate.replace(path)

    def _scrub(self, text: str) -> str:
        """Squid echoes config lines in its errors; the members' password must not follow."""
        password = self._settings.password
        for secret in {password, quote(password, safe="")}:
            text = text.replace(secret, "***")
        return text

    def _reload(self, back: Worker) -> None:
        """Reload one back with the front paused; return once every peer of it was probed."""
        offset = self._cache_log_size()
        with self._paused(self.front):
            log.debug("front paused for the %s worker", back.role)
            time.sleep(SETTLE)
            self._caught_up(back)
            self._signal(back, signal.SIGHUP)
            log.debug("the %s worker reloading", back.role)
            self._await(
                lambda: self._logged(offset, back, ACCEPTING) > 0,
                f"{back.role} worker not accepting again",
                RELOAD_DEADLINE,
            )
        log.debug("the %s worker accepting again, front resumed", back.role)
        # Probes logged before the reload began were of the peers it dropped.
        self._await_probes(self._after(offset, back, RECONFIGURING), back, self._peers(back))
        log.info("reloaded the %s worker (%d members)", back.role, len(self.members))

    def _caught_up(self, back: Worker) -> None:
        """Return once `back` answers a request sent now, or it cannot.

        SETTLE assumes the back handles the connects of what the front sent
        it within SETTLE; a back starved of CPU (a busy machine) may not,
        and a reload then loses the peer of a CONNECT still connecting
        (measured: 1 in 41 requests with 6 test processes on 2 cores).
        The back answers a malformed request (400, logged without a peer,
        so no metric counts it) only after its event loop got to it,
        which comes after the connects that were ready before it. A back
        that cannot answer is reloaded anyway: the reload is what restarts
        a stuck one.
        """
        try:
            with socket.create_connection((back.address, back.port), RELOAD_DEADLINE) as probe:
                probe.sendall(b"CAUGHT-UP\r\n\r\n")
                probe.recv(1)
        except OSError as err:
            log.warning("the %s worker did not answer before its reload: %s", back.role, err)

    @contextlib.contextmanager
    def _paused(self, worker: Worker) -> Iterator[None]:
        pid = self.worker_pid(worker)
        try:
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pid = None  # it died: the master is starting it anew, nothing to pause
        if pid is None:
            yield
            return
        try:
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _signal(self, worker: Worker, signum: int) -> None:
        pids: list[int] = []

        def found() -> bool:
            pid = self.worker_pid(worker)
            pids.extend([pid] if pid is not None else [])
            return bool(pids)

        self._await(found, f"no {worker.role} worker", RELOAD_DEADLINE)
        with contextlib.suppress(ProcessLookupError):  # it died: the master starts it anew
            os.kill(pids[0], signum)

    def _peers(self, back: Worker) -> int:
        return sum(
            1 for line in back.conf.read_text().splitlines() if line.startswith("cache_peer ")
        )

    def _await_probes(
        self, offset: int, worker: Worker, peers: int, deadline: float = RELOAD_DEADLINE
    ) -> None:
        """Wait until `worker` has logged `peers` probe outcomes (answers or not) since `offset`."""
        self._await(
            lambda: sum(self._logged(offset, worker, o) for o in (PEER_UP, PEER_DOWN)) >= peers,
            f"{worker.role} worker has not probed its {peers} peers",
            deadline,
        )

    def _accepting(self, offset: int, worker: Worker) -> bool:
        return self._logged(offset, worker, ACCEPTING) > 0 and accepts(worker.address, worker.port)

    def _cache_log_size(self) -> int:
        try:
            return self.cache_log.stat().st_size
        except FileNotFoundError:
            return 0

    def _logged(self, offset: int, worker: Worker, text: str) -> int:
        """How many lines `worker` wrote to the shared cache.log after byte `offset` with `text`."""
        return sum(1 for _ in self._lines(offset, worker, text))

    def _after(self, offset: int, worker: Worker, text: str) -> int:
        """The byte just past `worker`'s first line with `text` after `offset` (or `offset`)."""
        return next(iter(self._lines(offset, worker, text)), offset)

    def _lines(self, offset: int, worker: Worker, text: str) -> Iterator[int]:
        """Where each line of `worker` with `text` after byte `offset` ends, in order."""
        try:
            with self.cache_log.open("rb") as cache_log:
                cache_log.seek(offset)
                tail = cache_log.read()
        except FileNotFoundError:
            return
        prefix, wanted = f" kid{worker.number}| ".encode(), text.encode()
        end = offset
        for line in tail.splitlines(keepends=True):
            end += len(line)
            if prefix in line and wanted in line:
                yield end

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


def remove_leftovers(service: str) -> None:
    """Squid's shm segments and IPC sockets: it leaves both behind when it exits or is killed."""
    remove_shm(service)
    for leftover in IPC_DIR.glob(f"{service}-*.ipc"):
        with contextlib.suppress(OSError):
            leftover.unlink()


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


def _free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now, below the kernel's ephemeral range.

    Between this check and Squid's bind the ports are free for anyone: one
    from the ephemeral range (what binding port 0 gives) can meanwhile become
    the local end of any process's outgoing connection, and the back worker
    then never listens (seen once in the suite). Below the range, only an
    explicit bind can take it. Held open together, so none repeats.
    """
    low = _ephemeral_low()
    window = range(BACK_PORTS_FROM if low > BACK_PORTS_FROM + count else 1024, low)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in random.sample(window, len(window)):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()  # not held: a busy window must not run out of descriptors
                continue
            stack.enter_context(sock)
            ports.append(port)
            if len(ports) == count:
                return ports
    raise GatewayError(f"no {count} free loopback ports in {window.start}..{window.stop - 1}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unreadable)."""
    try:
        return int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW
