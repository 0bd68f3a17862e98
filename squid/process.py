"""Running Squid on this machine: what the local provider and the gateway share.

Both start the Debian `squid` binary from a directory of rendered files.
Started as root, Squid drops to the `proxy` user (SQUID_USER), and that user
must then reach the directory: a proxy's auth helper reads the htpasswd,
the gateway's router (run as that user too) its copy of itself and the
users file, and Squid and the router write their logs. It may not write the
directory itself (`make_dir`): its logs are made for it (`make_writable`),
and every file is written so that nothing planted in its place is followed
(`write_file`). A checkout under a home
directory (mode 700, as /root is) is out of its reach, so such a directory is
swapped for one under RUNTIME_ROOT, which this module creates for it
(`squid_dir`). Run as anyone else, Squid stays that user and reaches
whatever the caller does.

Both launch Squid the same way (`launch`: a session of its own, its output
to a file), wait for it the same way (`await_ready`: until it serves, or
until it exits, then with what its logs say) and stop it the same way
(`stop`: SIGTERM, SIGKILL after a bound). What is theirs stays with them:
the local provider's records and adoption of a Squid across worker
restarts, the gateway's router and watchdog.

Squid parses whatever a client sends, and so do the helpers it starts; a
Squid bug a client reaches runs as Squid's user, who may read the
environment of every process of that user (/proc/<pid>/environ). Squid,
and through it every helper, therefore starts with `environment()`: a
fixed PATH and the locale and time zone, never what the caller was given
(its Temporal key, the fleet's password, cloud credentials).

Errors here are plain exceptions (OSError, SquidError, SquidExited); each
caller turns them into its own taxonomy (the provider's, the gateway's).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from squid import procfs
from squid.conf import SQUID_USER

log = logging.getLogger("proxy_operator.squid")

# Debian's package installs Squid here, which is off most users' PATH.
FALLBACK_BINARY = "/usr/sbin/squid"
SHM_DIR = Path("/dev/shm")
# Where Squid's files go when the configured directory is out of its user's
# reach: the system's runtime directory, cleared at boot like the processes
# whose files it holds.
RUNTIME_ROOT = Path("/run/proxy-operator")
PARSE_TIMEOUT_SECONDS = 60
# How often a wait looks again (whether Squid accepts, logged, or exited).
POLL_SECONDS = 0.01
# One connect attempt of `accepts`; a listening Squid answers in microseconds.
ACCEPT_CHECK_SECONDS = 0.5
# Squid's PATH: it runs every helper by an absolute path, so this only has
# to be a PATH that names system directories alone.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What Squid and its helpers are given of the caller's environment when it
# is set: how to read and write text, and which time its logs show.
PASSED_ON = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
# Lines of Squid's output that say what went wrong.
_TROUBLE = re.compile(r"FATAL|ERROR|unrecognized|Bungled")


class SquidError(Exception):
    """Squid is missing, rejected its config, would not stop, or its user cannot be found."""


class SquidExited(SquidError):
    """Squid exited while it was awaited; `excerpt` is what its logs say about why."""

    def __init__(self, excerpt: str) -> None:
        super().__init__(f"squid exited: {excerpt}")
        self.excerpt = excerpt


Account = tuple[int, int]


def find_binary(configured: str = "squid") -> str:
    """The Squid binary: `configured` on PATH, or Debian's path for a bare name.

    A bare name may just be off PATH (/usr/sbin is, for most users); an
    explicit path that does not exist is a mistake to report, not to mask.
    """
    found = shutil.which(configured)
    if found is None and os.sep not in configured:
        found = shutil.which(FALLBACK_BINARY)
    if found is None:
        raise SquidError(
            f"squid binary {configured!r} not found (nor {FALLBACK_BINARY}); "
            "install Squid (apt-get install squid)"
        )
    return found


def squid_account() -> Account | None:
    """The (uid, gid) Squid drops to and shares its files with; None when it runs as us."""
    if os.geteuid() != 0:
        return None
    try:
        account = pwd.getpwnam(SQUID_USER)
    except KeyError:
        raise SquidError(
            f"user {SQUID_USER!r} does not exist; Squid started as root needs it"
        ) from None
    return account.pw_uid, account.pw_gid


def squid_dir(preferred: Path, account: Account | None) -> Path:
    """`preferred`, or, when Squid's user could not reach it, a directory of the system's.

    The replacement is a function of `preferred` alone, so every process
    configured with the same directory (a restarted worker, a second one)
    finds the same files. Its parents are created world-traversable; the
    directory itself is left for the caller to create with its own mode.
    """
    preferred = preferred.resolve()
    if account is None or _traversable(preferred, account):
        return preferred
    moved = runtime_dir(preferred)
    RUNTIME_ROOT.mkdir(mode=0o755, parents=True, exist_ok=True)
    RUNTIME_ROOT.chmod(0o755)  # mkdir's mode is narrowed by the umask
    log.info(
        "user %r cannot reach %s; Squid's files for it go to %s instead",
        SQUID_USER,
        preferred,
        moved,
    )
    return moved


def runtime_dir(preferred: Path) -> Path:
    """Where `squid_dir` moves `preferred` (an absolute path) when Squid's user cannot reach it."""
    digest = hashlib.sha256(os.fsencode(preferred)).hexdigest()[:16]
    return RUNTIME_ROOT / f"{preferred.name}-{digest}"


def _traversable(directory: Path, account: Account) -> bool:
    """Whether `account` may pass through every existing directory on the way to `directory`."""
    uid, gid = account
    for path in (directory, *directory.parents):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # created later, by us, traversable
        shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
        if not (st.st_mode >> shift) & stat.S_IXOTH:
            return False
    return True


def write_file(path: Path, text: str, mode: int = 0o644, group: int | None = None) -> None:
    """Replace a file atomically, so no reader (Squid included) ever sees half of it.

    The text goes to a file of a fresh, unpredictable name, created with
    O_EXCL and O_NOFOLLOW, which is then renamed over `path`. A symbolic
    link (or anything else) planted at either name is replaced or refused,
    never followed: no file it points at is written, chmodded or chowned.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            os.fchmod(fd, mode)  # os.open's mode is narrowed by the umask
            if group is not None:
                os.fchown(fd, -1, group)
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_dir(path: Path, group: int | None) -> None:
    """`path` as a directory Squid's user (in `group`) may read and enter but not write.

    Squid's user can then plant nothing in it (a symbolic link where a
    file is about to be written, a config of its own); what it writes has
    to be made for it (`make_writable`). Anything but a directory at
    `path` (a link planted while it was still writable) is removed first,
    so nothing is created, chowned or chmodded through it. Nobody else may
    enter: the configs hold the fleet's credentials.
    """
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            path.unlink()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if group is not None:
        os.chown(path, -1, group, follow_symlinks=False)
    path.chmod(0o750)  # mkdir's mode is narrowed by the umask


def remove_planted(path: Path) -> None:
    """Remove `path` unless it is a file of one link: what is opened there as root is no link.

    A link planted while the directory was still writable by Squid's user
    would have the gateway, or Squid's master, write the file it names.
    """
    with contextlib.suppress(FileNotFoundError):
        found = os.lstat(path)
        if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
            path.unlink()


def make_writable(path: Path, account: Account | None) -> None:
    """A file Squid's user may write (a log), in a directory of `make_dir`'s, which it cannot.

    Squid's user cannot create it there, so it is created for it, as its
    own; its content stays (`remove_planted` first).
    """
    remove_planted(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        if account is not None:
            os.fchown(fd, *account)
        os.fchmod(fd, 0o640)
    finally:
        os.close(fd)


def environment() -> dict[str, str]:
    """The whole environment of Squid and its helpers: nothing secret, nothing it does not use.

    An allowlist, so a secret the caller is given later under any name
    stays out of it too.
    """
    passed = {name: os.environ[name] for name in PASSED_ON if name in os.environ}
    return {"PATH": SYSTEM_PATH, **passed}


def parse_errors(binary: str, conf: Path) -> str | None:
    """`squid -k parse` (tens of milliseconds): None if accepted, else what Squid said."""
    result = subprocess.run(
        [binary, "-k", "parse", "-f", str(conf)],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=PARSE_TIMEOUT_SECONDS,
        check=False,
    )
    if result.returncode == 0:
        return None
    return excerpt(result.stderr + result.stdout)


def log_excerpt(*paths: Path) -> str:
    """What Squid's logs say went wrong (missing files are skipped)."""
    texts = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            texts.append(path.read_text(errors="replace"))
    return excerpt("\n".join(texts))


def excerpt(text: str) -> str:
    """The lines that say what went wrong, or the last lines when none does."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    bad = [line for line in lines if _TROUBLE.search(line)]
    return " | ".join((bad or lines)[-3:]) or "no output"


def service_name(name: str, scope: str | None = None) -> str:
    """Squid's `-n` service name for `name`; it also prefixes Squid's /dev/shm segments.

    Squid accepts at most 32 alphanumeric characters, so the hyphens go and a
    short hash keeps apart names that differ only in their hyphens. Service
    names and /dev/shm are machine-wide: `scope` (the local provider's
    installation) goes into the hash, so two installations on one machine
    with an instance of the same name never share, nor remove, each other's
    segments.
    """
    hashed = name if scope is None else f"{scope}\x00{name}"
    digest = hashlib.sha256(hashed.encode()).hexdigest()[:8]
    return re.sub(r"[^a-z0-9]", "", name)[:24] + digest


def remove_shm(service: str) -> None:
    """Remove the shared-memory segments a Squid of `service` left (it leaves them when killed)."""
    for segment in SHM_DIR.glob(f"{service}-*"):
        with contextlib.suppress(FileNotFoundError):
            segment.unlink()


def clear_stale_pid_file(pid_file: Path) -> None:
    """Remove a pid file whose process is gone or a zombie, which would stop Squid from starting.

    Squid refuses to start while its pid file names a process that exists,
    and a zombie exists: a Squid whose parent was killed stays one until
    somebody reaps it, and in a container nobody may. Squid's master opens
    the pid file as root: one that is not a plain file is removed too.
    """
    remove_planted(pid_file)
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return
    if not procfs.running(pid):
        pid_file.unlink(missing_ok=True)


def bindable(address: str, port: int) -> bool:
    """Whether Squid could listen on `address:port` now."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Squid sets SO_REUSEADDR too, so a port in TIME_WAIT counts as free
        # while one with a listener (on this or the wildcard address) does not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def accepts(address: str, port: int) -> bool:
    """Whether something accepts TCP connections on `address:port` now (a wildcard: on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(address, address)
    try:
        with socket.create_connection((host, port), timeout=ACCEPT_CHECK_SECONDS):
            return True
    except OSError:
        return False


def launch(command: Sequence[str], directory: Path, output: Path) -> subprocess.Popen[bytes]:
    """Start `command` (Squid) in `directory`, its stdout and stderr appended to `output`.

    It runs in a session of its own: no signal aimed at the caller's process
    group (a Ctrl-C, a supervisor's SIGTERM, a killed worker's group) reaches
    it, so the caller stops it in its own order or leaves it serving; and
    its pid names its process group, which `stop` can kill whole.
    Squid's earliest errors (a bad flag, a missing file) are on `output`
    only, before it opens its cache.log. Its environment is `environment()`,
    which its helpers inherit.
    """
    remove_planted(output)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(output, flags, 0o640), "ab") as out:
        return subprocess.Popen(
            list(command),
            env=environment(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=directory,
            start_new_session=True,
        )


def wait_until(ready: Callable[[], bool], seconds: float) -> bool:
    """Poll `ready` until it holds (True) or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def await_ready(
    process: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    seconds: float,
    logs: Sequence[Path],
) -> bool:
    """Wait until `ready` holds (True) or `seconds` pass (False), while `process` runs.

    Raises SquidExited, with what `logs` say went wrong, as soon as the
    process exits instead: a broken start fails with Squid's own message
    at once, not as a timeout.
    """
    ended = wait_until(lambda: process.poll() is not None or ready(), seconds)
    if process.poll() is not None:
        raise SquidExited(log_excerpt(*logs))
    return ended


def stop(pid: int, exited: Callable[[], bool], grace: float, *, group: bool = False) -> None:
    """SIGTERM `pid`, and SIGKILL once `exited()` has not come true within `grace` seconds.

    With `group`, whatever is left of its process group (`pid` is its
    leader, as `launch` makes it) is killed afterwards: children that
    outlived it, and waited for until none runs. `exited` is the caller's
    witness, as only the caller knows whether `pid` is still the process it
    started (a Popen's poll, a recorded start time). SquidError if it, or
    its group, survives SIGKILL for `grace`.
    """
    if not exited():
        _signal(pid, signal.SIGTERM)
        if not wait_until(exited, grace):
            _signal(pid, signal.SIGKILL, group=group)
            if not wait_until(exited, grace):
                raise SquidError(f"process {pid} survives SIGKILL")
    if group:
        # SIGKILL is delivered, not done: a worker may still run for a moment.
        _signal(pid, signal.SIGKILL, group=True)
        if not wait_until(lambda: not procfs.group_members(pid), grace):
            raise SquidError(f"processes of group {pid} survive SIGKILL")


def _signal(pid: int, signum: int, *, group: bool = False) -> None:
    """Send `signum` to `pid` (or its process group); one that is gone already needs none."""
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
