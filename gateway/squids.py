"""The gateway's three Squids: a front that never reloads, two backs that reload in turn.

    client -> front (listen address) -> back-0 or back-1 (loopback) -> pool member

A non-SMP Squid's `-k reconfigure` closes its listening socket while it
re-reads its config (Squid 5.7: 2,165 refused connects over 10 reloads under
a tight connect loop), so such a Squid cannot take membership changes
without refusing clients. One SMP Squid (`workers 2`, run with
`--foreground`; `-N` runs no kids) keeps the socket open, because its
coordinator holds it (Ipc::Coordinator::handleSharedListenRequest caches
the listening sockets it opened in `listeners` and hands kids copies): 0
refused over 20 reloads. But with the gateway's config every reload then
pauses all workers at once, and CONNECTs routed while a worker swaps its
peers get 500 "cannot forward": 7 x 500, 1 x 403 and 5 broken tunnels in
569 CONNECTs over 30 reloads (reloading the kids one at a time: 8 to 13
failures in about 1,800), against 0 x 500 and 1 broken tunnel in 2,250 for
these three Squids under the same clients (docs/architecture.md, "Why not
one SMP Squid"; `python -m bench.reconfigure` repeats the bare-Squid part).

The front's config names only the two backs and never changes; a membership
change rewrites the backs' config and reloads one back, waits until it
accepts again and the front uses it again, then reloads the other. A
CONNECT the front sends to a reloading back is refused at once and retried
on the other back.

Every file lives under the gateway's state directory, one directory per
Squid (squid.conf, htpasswd, access.log, cache.log, squid.out). The backs'
squid.conf holds the members' credentials (cache_peer login=), so the
directories are private to the gateway and Squid's user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from urllib.parse import quote

from providers.errors import Permanent
from providers.local import (
    FALLBACK_BINARY,
    _check_traversable,
    _remove_shm,
    _squid_account,
    _write,
    service_name,
)
from providers.squid import (
    SQUID_USER,
    GatewayMember,
    ProxySettings,
    RenderedSquid,
    SquidPaths,
    render_gateway_back,
    render_gateway_front,
)

log = logging.getLogger("proxy_operator.gateway")

AUTH_HELPER = Path(__file__).resolve().with_name("auth_helper.py")
START_DEADLINE = 30.0
RELOAD_DEADLINE = 30.0
STOP_GRACE = 10.0
POLL = 0.05
ACCEPTING = "Accepting HTTP Socket connections"


class GatewayError(Exception):
    """A Squid of the gateway would not start, parse its config or reload."""


@dataclass
class _Squid:
    """One of the three: its directory, service name, port and process."""

    role: str
    directory: Path
    service: str
    address: str
    port: int
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def conf(self) -> Path:
        return self.directory / "squid.conf"

    @property
    def cache_log(self) -> Path:
        return self.directory / "cache.log"

    @property
    def access_log(self) -> Path:
        return self.directory / "access.log"

    def paths(self, effective_user: str | None) -> SquidPaths:
        return SquidPaths(
            htpasswd=str(self.directory / "htpasswd"),
            pid_file=str(self.directory / "squid.pid"),
            access_log=f"stdio:{self.access_log}",
            cache_log=str(self.cache_log),
            coredump_dir=str(self.directory),
            effective_user=effective_user,
            http_address=self.address,
        )

    def log_count(self, text: str) -> int:
        try:
            return self.cache_log.read_text(errors="replace").count(text)
        except FileNotFoundError:
            return 0


class GatewaySquids:
    """Starts, reloads and stops the front and the two backs; blocking calls."""

    def __init__(
        self,
        settings: ProxySettings,
        state_dir: Path,
        listen: tuple[str, int],
        squid_binary: str = "squid",
    ) -> None:
        self._settings = settings
        self._state_dir = state_dir.resolve()
        self._binary = shutil.which(squid_binary) or shutil.which(FALLBACK_BINARY) or squid_binary
        self._account = _squid_account()
        self._python = _helper_python(self._account)
        host, port = listen
        self.front = self._squid("front", host, port)
        self.backs = [self._squid(f"back-{i}", "127.0.0.1", _free_port()) for i in range(2)]
        self.members: tuple[GatewayMember, ...] = ()

    def _squid(self, role: str, address: str, port: int) -> _Squid:
        directory = self._state_dir / role
        return _Squid(role, directory, service_name(f"{self._state_dir}-{role}"), address, port)

    @property
    def squids(self) -> list[_Squid]:
        return [*self.backs, self.front]

    # ---- the lifecycle ----------------------------------------------------------------

    def start(self, members: Sequence[GatewayMember]) -> None:
        """Render, check and start the backs, then the front; return once all accept."""
        self.members = tuple(members)
        self._state_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        self._share(self._state_dir)
        if self._account is not None:
            try:
                _check_traversable(self._state_dir, *self._account)
            except Permanent as err:
                raise GatewayError(str(err).replace("local.state_dir", "--state-dir")) from err
        for squid in self.squids:
            squid.directory.mkdir(mode=0o770, exist_ok=True)
            self._share(squid.directory)
            squid.directory.chmod(0o770)
            self._write_config(squid, self._render(squid))
        # The backs first: a front that finds no back at its start probes
        # counts them down and answers 500 until it probes them again.
        for group in (self.backs, [self.front]):
            for squid in group:
                self._launch(squid)
            for squid in group:
                self._await(partial(_accepts, squid.address, squid.port), squid, START_DEADLINE)

    def apply(self, members: Sequence[GatewayMember]) -> bool:
        """Reload the backs, one at a time, onto `members`; False when nothing changed."""
        members = tuple(members)
        if set(members) == set(self.members):
            return False
        previous, self.members = self.members, members
        try:
            for back in self.backs:
                self._reload(back)
        except (GatewayError, subprocess.SubprocessError):
            self.members = previous  # so the same change is tried again
            raise
        return True

    def stop(self) -> None:
        """SIGTERM every Squid (SIGKILL if it lingers) and remove their shm segments."""
        for squid in reversed(self.squids):
            process = squid.process
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for squid in self.squids:
            process = squid.process
            if process is None:
                continue
            try:
                process.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_GRACE)
            _remove_shm(squid.service)

    def running(self) -> bool:
        return all(s.process is not None and s.process.poll() is None for s in self.squids)

    # ---- steps ----------------------------------------------------------------------------

    def _render(self, squid: _Squid) -> RenderedSquid:
        paths = squid.paths(SQUID_USER if self._account is not None else None)
        wrapper = [self._python, str(AUTH_HELPER), self._settings.username]
        settings = replace(self._settings, port=squid.port)
        if squid is self.front:
            ports = [b.port for b in self.backs]
            return render_gateway_front(settings, paths, ports, wrapper)
        return render_gateway_back(settings, paths, self.members, wrapper)

    def _write_config(self, squid: _Squid, rendered: RenderedSquid) -> None:
        group = None if self._account is None else self._account[1]
        _write(squid.directory / "htpasswd", rendered.htpasswd, 0o640, group)
        candidate = squid.directory / "squid.conf.new"
        _write(candidate, rendered.squid_conf, 0o640, group)
        self._check(candidate)
        candidate.replace(squid.conf)

    def _check(self, conf: Path) -> None:
        result = subprocess.run(
            [self._binary, "-k", "parse", "-f", str(conf)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            bad = [
                line
                for line in (result.stderr + result.stdout).splitlines()
                if "FATAL" in line or "ERROR" in line
            ]
            raise GatewayError(f"squid rejected {conf}: {self._scrub(' | '.join(bad[-3:]))}")

    def _scrub(self, text: str) -> str:
        """Squid echoes config lines in its errors; the members' password must not follow."""
        password = self._settings.password
        for secret in {password, quote(password, safe="")}:
            text = text.replace(secret, "***")
        return text

    def _launch(self, squid: _Squid) -> None:
        _remove_shm(squid.service)
        with open(squid.directory / "squid.out", "ab") as out:
            squid.process = subprocess.Popen(
                [self._binary, "-N", "-f", str(squid.conf), "-n", squid.service],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=squid.directory,
                start_new_session=True,
            )
        log.info("started %s Squid on %s:%s", squid.role, squid.address, squid.port)

    def _reload(self, back: _Squid) -> None:
        """Reconfigure one back and wait until it accepts connections again.

        Meanwhile the front's connects to it are refused and retried on the
        other back; the front never counts it down (BACK_CONNECT_FAIL_LIMIT).
        """
        accepting = back.log_count(ACCEPTING)
        self._write_config(back, self._render(back))
        self._signal_reconfigure(back)
        self._await(
            lambda: back.log_count(ACCEPTING) > accepting and _accepts(back.address, back.port),
            back,
            RELOAD_DEADLINE,
        )
        log.info("reloaded %s with %d members", back.role, len(self.members))

    def _signal_reconfigure(self, back: _Squid) -> None:
        """`squid -k reconfigure`, asked again until RELOAD_DEADLINE while it exits non-zero.

        It exits 1 without sending the signal when it finds no PID to signal
        (no PID file, or a PID it cannot signal), so asking again cannot
        reload a back twice. Exit 1 was seen once, on a machine with both cores
        busy, for a back that was running; its output was not kept then, so
        the cause is not known. A back that has exited fails at once; the last
        attempt's output is reported, with the password scrubbed.
        """
        until = time.monotonic() + RELOAD_DEADLINE
        while True:
            done = subprocess.run(
                [self._binary, "-k", "reconfigure", "-f", str(back.conf), "-n", back.service],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if done.returncode == 0:
                return
            if back.process is None or back.process.poll() is not None:
                raise GatewayError(f"{back.role} Squid exited: {self._output(back)}")
            if time.monotonic() > until:
                said = self._scrub((done.stderr + done.stdout).strip()[-500:])
                raise GatewayError(f"squid -k reconfigure of {back.role} failed: {said}")
            log.warning(
                "squid -k reconfigure of %s exited %d; trying again", back.role, done.returncode
            )
            time.sleep(POLL * 10)

    def _await(self, ready: Callable[[], bool], squid: _Squid, deadline: float) -> None:
        until = time.monotonic() + deadline
        while not ready():
            if squid.process is not None and squid.process.poll() is not None:
                raise GatewayError(f"{squid.role} Squid exited: {self._output(squid)}")
            if time.monotonic() > until:
                raise GatewayError(
                    f"{squid.role} Squid not accepting on {squid.address}:{squid.port} "
                    f"after {deadline:.0f}s: {self._output(squid)}"
                )
            time.sleep(POLL)

    def _output(self, squid: _Squid) -> str:
        texts = []
        for path in (squid.directory / "squid.out", squid.cache_log):
            with contextlib.suppress(FileNotFoundError):
                texts.append(path.read_text(errors="replace"))
        lines = [line for line in "\n".join(texts).splitlines() if line.strip()]
        bad = [line for line in lines if "FATAL" in line or "ERROR" in line]
        return self._scrub(" | ".join((bad or lines)[-3:]) or "no output")

    def _share(self, directory: Path) -> None:
        """Squid started as root drops to `proxy`, which must reach its files."""
        if self._account is not None:
            os.chown(directory, -1, self._account[1])


def _helper_python(account: tuple[int, int] | None) -> str:
    """An interpreter Squid's user can run the auth helper with.

    Squid started as root runs its helpers as `proxy`, which may not reach
    this process's interpreter (a virtualenv under root's home); the
    system's python3 then runs the helper, which needs only the standard
    library and providers/squid.py.
    """
    if account is None or _runnable(Path(sys.executable), *account):
        return sys.executable
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system is not None and _runnable(Path(system), *account):
        return system
    raise GatewayError(
        f"user {SQUID_USER!r} cannot run {sys.executable} nor a system python3 for the "
        "gateway's auth helper; install python3 or run the gateway unprivileged"
    )


def _runnable(path: Path, uid: int, gid: int) -> bool:
    """Whether `uid`/`gid` may execute `path` and reach the auth helper's directory."""
    resolved = path.resolve()
    return all(
        _permits(step, uid, gid, 0o1)
        for step in (resolved, *resolved.parents, *AUTH_HELPER.parents)
    ) and _permits(AUTH_HELPER, uid, gid, 0o4)


def _permits(path: Path, uid: int, gid: int, bit: int) -> bool:
    """Whether `path`'s mode grants `bit` (1 execute, 4 read) to `uid`/`gid`."""
    try:
        st = path.stat()
    except OSError:
        return False
    shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
    return bool((st.st_mode >> shift) & bit)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _accepts(address: str, port: int) -> bool:
    host = "127.0.0.1" if address in ("0.0.0.0", "") else "::1" if address == "::" else address
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
