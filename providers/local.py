"""The `local` provider: real Squid processes on this machine.

Each instance is one Squid bound to `bind_address`, on its own port from
`first_port..last_port`, with everything it owns in `<state_dir>/<name>/`:

    tags.json                 the owner's tags: list_by_tag selects on them,
                              delete and adoption check them; first in, last out
    squid.conf, htpasswd      rendered by squid/conf.py
    instance.json             port and created_at, recorded before Squid starts;
                              its pid (and start time) once it serves
    cache.log, access.log     Squid's own logs
    squid.out                 Squid's stdout and stderr (early start-up errors)

The directories are the only state, so a restarted worker, or a second
provider object over the same `state_dir`, finds every instance again. Squid
runs in the foreground (`-N`) in a session of its own: a worker killed with
SIGKILL leaves it serving, and the next worker recognises it by its pid and
start time, or, when the worker died before recording the pid, by its
command line, and adopts it: there is never a second Squid for one instance.
Squid started as root drops to the `proxy` user, so the directories are
shared with that user's group, which may read them and not write them
(squid/process.py says why); its logs are made for it.

Only instances whose tags say they belong to this installation are deleted,
and only the one a request's owner, generation and namespace made is adopted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationInfo, field_validator

from providers.base import CreateRequest, Instance, InstanceState
from providers.catalog import ProviderType
from providers.config import Config, Port, ProviderEntry, ProviderSettings
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded, Transient
from providers.naming import adoption_mismatch, ownership_mismatch
from squid import process as squid_process
from squid.conf import SQUID_USER, SquidPaths, render
from squid.procfs import command_lines, processes_under, start_time


class LocalConfig(ProviderSettings):
    """Squid processes on this machine, one directory each under `state_dir`."""

    state_dir: str = ".data/local-proxies"
    bind_address: str = "127.0.0.1"
    # Local proxies cannot all listen on the proxy port, so each gets a free
    # port from first_port..last_port instead.
    first_port: Port = 20000
    last_port: Port = 20999
    squid_binary: str = "squid"

    def member_networks(self) -> tuple[str, ...] | None:
        """Only the address the instances are published at (`client_address`)."""
        try:
            return (ipaddress.ip_network(client_address(self.bind_address)).with_prefixlen,)
        except ValueError:
            return None  # not an IP address: the provider refuses to start with it

    @field_validator("last_port")
    @classmethod
    def _range_not_empty(cls, last: int, info: ValidationInfo) -> int:
        # An empty range would only show up later, as QuotaExceeded on every create.
        first = info.data.get("first_port")
        if first is not None and last < first:
            raise ValueError(f"must be at least first_port ({first}), not {last}")
        return last


def client_address(bind_address: str) -> str:
    """Where clients reach a Squid bound to `bind_address` (an IP address).

    A wildcard bind is reachable on loopback; never publish 0.0.0.0.
    """
    address = ipaddress.ip_address(bind_address)
    if address.is_unspecified:
        return "::1" if address.version == 6 else "127.0.0.1"
    return bind_address


PROVIDER_TYPE = ProviderType(
    name="local",
    settings=LocalConfig,
    placement_keys=frozenset(),
    build=lambda entry, config: LocalProvider.from_config(entry, config),
    # Every default works on any machine with Squid installed.
    block_optional=True,
)

PROVIDER_ID_PREFIX = "local/"
CONF_FILE = "squid.conf"
HTPASSWD_FILE = "htpasswd"
METADATA_FILE = "instance.json"
TAGS_FILE = "tags.json"
PID_FILE = "squid.pid"
CACHE_LOG = "cache.log"
ACCESS_LOG = "access.log"
SQUID_OUT = "squid.out"
LOCK_FILE = ".lock"
# An instance directory is assembled under this prefix and renamed into place,
# so `<name>/` never exists without its tags.
NEW_DIR_PREFIX = ".new-"

# Instance names become directory names and Squid service names: DNS labels only.
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# create waits this long for Squid to accept connections or fail, so a broken
# start surfaces as an error with Squid's own message instead of a silent death.
START_GRACE_SECONDS = 5.0
# delete sends SIGTERM, and SIGKILL when Squid is still up after this long;
# helpers get as long to exit after Squid.
STOP_GRACE_SECONDS = 5.0

# Squids this worker process started, whichever provider object did it: any
# of them may see one exit and must reap it. Kept for the process's lifetime,
# as a Squid deliberately outlives the object that started it.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
_CHILDREN_LOCK = threading.Lock()

# OS errors that mean "out of a resource", not "broken": retry after a while.
_EXHAUSTED = {errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


@dataclass(frozen=True)
class _Metadata:
    """instance.json: what the provider needs to find the process again."""

    port: int
    # None from just before Squid is launched until it serves: a worker
    # killed in between leaves the record, and the next one finds the process.
    pid: int | None
    # procfs.start_time(pid) when Squid was launched: tells it from a reused pid.
    started: str | None
    created_at: datetime

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["created_at"] = self.created_at.isoformat()
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> _Metadata:
        data: dict[str, Any] = json.loads(text)
        pid, started = data.get("pid"), data.get("started")
        return cls(
            port=int(data["port"]),
            pid=None if pid is None else int(pid),
            started=None if started is None else str(started),
            created_at=datetime.fromisoformat(data["created_at"]),
        )


class LocalProvider:
    """Squid processes on this machine, one directory each under `state_dir`."""

    def __init__(self, settings: LocalConfig, installation: str) -> None:
        try:
            self._client_ip = client_address(settings.bind_address)
        except ValueError as exc:
            raise Permanent(f"local.bind_address: {exc}", cause=exc) from exc
        self._settings = settings
        self._installation = installation
        # Absolute and canonical: squid.conf names its files by this path, and
        # Squid's helpers are found by it in their command lines. Squid's
        # user must reach it, so one it cannot (a checkout under /root, run
        # as root) is swapped for a directory of the system's, the same for
        # every worker configured alike.
        self._state_dir = squid_process.squid_dir(Path(settings.state_dir), _account_or_none())
        self._bind = settings.bind_address

    @classmethod
    def from_config(cls, entry: ProviderEntry, config: Config) -> LocalProvider:
        """The registry's constructor; the proxy settings arrive with each request."""
        return cls(PROVIDER_TYPE.settings_of(entry), config.installation)

    # -- the Provider contract ---------------------------------------------

    def create(self, req: CreateRequest) -> Instance:
        """Start Squid for `req.name`, adopt it if it runs, restart it if it died.

        A create that fails leaves nothing behind: no directory, no process,
        no shm segment. Only an instance this request's owner and generation
        made is adopted or restarted; any other of that name is Permanent.
        """
        name = _checked_name(req.name)
        with _edge(f"create local instance {name}"):
            mismatch = ownership_mismatch(req.tags, self._installation)
            if mismatch:
                # This installation's delete and orphan GC could never act on it.
                raise Permanent(f"create {name}: the request's tags are {mismatch}")
            binary = self._squid_binary()
            self._state_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            with self._locked():
                previous = self._claimed(req)
                if previous is not None and self._adopted(name, previous):
                    return self._instance(name)
                try:
                    process, port = self._start(binary, req, previous)
                except Exception:
                    self._discard(name)
                    raise
            try:
                self._await_start(name, process, port)
                with self._locked():
                    self._record(name, process)
            except Exception:
                with self._locked():
                    self._discard(name)
                raise
            return self._instance(name)

    def get(self, provider_id: str) -> Instance:
        name = self._name(provider_id)
        with _edge(f"get {provider_id}"):
            return self._instance(name)

    def delete(self, provider_id: str) -> None:
        """Stop Squid and its helpers, then remove the directory and shm segments.

        Blocks until Squid has exited (it takes a few seconds to shut down), so
        a get right after delete already raises NotFound.
        """
        name = self._name(provider_id)
        with _edge(f"delete {provider_id}"):
            directory = self._dir(name)
            if not directory.exists() or _vacated(directory):
                return
            mismatch = ownership_mismatch(_read_tags(directory), self._installation)
            if mismatch:
                raise Permanent(f"delete {provider_id}: refused, {mismatch}")
            # A create of the same name may restart Squid while it is being
            # stopped without the lock; then it is stopped again.
            while True:
                self._stop(name, self._metadata(name))
                with self._locked():
                    meta = self._metadata(name)
                    if meta is not None and self._squid(name, meta) is not None:
                        continue
                    self._remove(name)
                    return

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        with _edge(f"list local instances tagged {key}={value}"):
            if not self._state_dir.is_dir():
                return []
            found: list[Instance] = []
            for path in sorted(self._state_dir.iterdir()):
                if path.name.startswith(".") or not path.is_dir():
                    continue
                try:
                    if _read_tags(path).get(key) == value:
                        found.append(self._instance(path.name))
                except (NotFound, FileNotFoundError):
                    continue  # deleted meanwhile, or a create still writing it
            return found

    # -- state on disk -------------------------------------------------------

    def _name(self, provider_id: str) -> str:
        prefix, _, name = provider_id.partition(PROVIDER_ID_PREFIX)
        if prefix:
            raise Permanent(f"{provider_id!r} is not a local provider id (local/<name>)")
        return _checked_name(name)

    def _dir(self, name: str) -> Path:
        return self._state_dir / name

    def _metadata(self, name: str) -> _Metadata | None:
        """instance.json, or None before the first start finished writing it."""
        try:
            return _Metadata.from_json((self._dir(name) / METADATA_FILE).read_text())
        except FileNotFoundError:
            return None

    def _instance(self, name: str) -> Instance:
        """The instance as a client sees it: RUNNING only once Squid accepts."""
        meta = self._metadata(name)
        if meta is None:
            raise NotFound(f"local instance {name} does not exist")
        tags = _read_tags(self._dir(name))
        if self._squid(name, meta) is None:
            state, ip = InstanceState.TERMINATED, ""
        elif squid_process.accepts(self._client_ip, meta.port):
            state, ip = InstanceState.RUNNING, self._client_ip
        else:
            state, ip = InstanceState.PROVISIONING, ""
        return Instance(
            provider_id=PROVIDER_ID_PREFIX + name,
            name=name,
            state=state,
            ip=ip,
            port=meta.port,
            tags=tags,
            created_at=meta.created_at,
        )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise starts and removals across threads and worker processes.

        flock locks belong to an open file, so every call opens the file anew
        and two threads of one worker exclude each other like two workers do.
        """
        with open(self._state_dir / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _claimed(self, req: CreateRequest) -> _Metadata | None:
        """The record of `req.name` if it exists and is this request's; the caller holds the lock.

        A directory of that name with other tags (another installation
        sharing the state_dir, another owner, generation or Temporal
        namespace, one made by hand) is Permanent: it is never adopted,
        restarted or overwritten.
        """
        directory = self._dir(req.name)
        if not directory.exists() or _vacated(directory):
            return None
        mismatch = adoption_mismatch(_read_tags(directory), self._installation, req.tags)
        if mismatch:
            raise Permanent(
                f"create {req.name}: a local instance of that name exists and is not "
                f"this proxy's, {mismatch}"
            )
        return self._metadata(req.name)

    def _adopted(self, name: str, meta: _Metadata) -> bool:
        """Whether Squid of this record runs; one never recorded is recorded now."""
        squid = self._squid(name, meta)
        if squid is None:
            return False
        if meta.pid is None:
            pid, started = squid
            squid_process.write_file(
                self._dir(name) / METADATA_FILE, _recorded(meta, pid, started).to_json()
            )
        return True

    def _record(self, name: str, process: subprocess.Popen[bytes]) -> None:
        """Write the pid of a started Squid into its record; the caller holds the lock."""
        meta = self._metadata(name)
        started = start_time(process.pid)
        if meta is None or started is None:
            raise Transient(f"squid for {name} was stopped while it started")
        if meta.pid is None:
            squid_process.write_file(
                self._dir(name) / METADATA_FILE, _recorded(meta, process.pid, started).to_json()
            )

    def _discard(self, name: str) -> None:
        """Undo a failed create: stop what runs, remove what was written."""
        self._stop(name, self._metadata(name))
        self._remove(name)

    def _remove(self, name: str) -> None:
        """The directory, its tags last (so what remains is still known as ours), and shm."""
        directory = self._dir(name)
        with contextlib.suppress(FileNotFoundError):
            for entry in directory.iterdir():
                if entry.name == TAGS_FILE:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            (directory / TAGS_FILE).unlink(missing_ok=True)
            directory.rmdir()
        squid_process.remove_shm(self._service(name))

    # -- starting --------------------------------------------------------------

    def _squid_binary(self) -> str:
        try:
            return squid_process.find_binary(self._settings.squid_binary)
        except squid_process.SquidError as err:
            raise Permanent(f"{err} or set local.squid_binary") from err

    def _start(
        self, binary: str, req: CreateRequest, previous: _Metadata | None
    ) -> tuple[subprocess.Popen[bytes], int]:
        """Render, check, record and launch Squid; the caller holds the lock.

        The record (port, created_at) is written before the launch, so a
        worker killed right after it leaves a record the next create adopts
        the running Squid by. Returns the process and its port.
        """
        name = req.name
        directory = self._dir(name)
        account = _account()
        group = None if account is None else account[1]
        fresh = previous is None and not directory.exists()
        if fresh:
            self._make_dir(name, req.tags, group)
        squid_process.make_dir(directory, group)  # whoever made it, Squid's user may not write it

        port = self._allocate_port(name, previous.port if previous else None)
        paths = SquidPaths(
            htpasswd=str(directory / HTPASSWD_FILE),
            pid_file=str(directory / PID_FILE),
            # stdio: Squid writes the log itself instead of forking a log
            # daemon, one process fewer per proxy.
            access_log=f"stdio:{directory / ACCESS_LOG}",
            cache_log=str(directory / CACHE_LOG),
            coredump_dir=str(directory),
            effective_user=SQUID_USER if group is not None else None,
            http_address=self._bind,
        )
        try:
            rendered = render(dataclasses.replace(req.proxy, port=port), paths)
        except ValueError as exc:  # settings that could open the proxy: retrying cannot help
            raise Permanent(f"cannot render squid.conf for {name}: {exc}", cause=exc) from exc
        conf = directory / CONF_FILE
        squid_process.write_file(conf, rendered.squid_conf, 0o640, group)
        # Squid's auth helper reads the hash as `proxy`: group-readable, never world.
        squid_process.write_file(directory / HTPASSWD_FILE, rendered.htpasswd, 0o640, group)
        rejected = squid_process.parse_errors(binary, conf)
        if rejected is not None:  # retrying cannot help
            raise Permanent(f"squid rejected {conf}: {rejected}")

        # Helpers of a Squid that was killed may still be exiting; once none
        # runs, segments it left would only make the new one fail. Nothing
        # can run from a directory made just now.
        if not fresh:
            self._stop(name, None)
        service = self._service(name)
        squid_process.remove_shm(service)
        created_at = previous.created_at if previous else datetime.now(UTC)
        starting = _Metadata(port=port, pid=None, started=None, created_at=created_at)
        squid_process.write_file(directory / METADATA_FILE, starting.to_json())
        for log_file in (CACHE_LOG, ACCESS_LOG):
            squid_process.make_writable(directory / log_file, account)
        # In a session of its own, Squid outlives a crashed or killed worker.
        process = squid_process.launch(
            [binary, "-N", "-f", str(conf), "-n", service], directory, directory / SQUID_OUT
        )
        with _CHILDREN_LOCK:
            _CHILDREN[process.pid] = process
        return process, port

    def _make_dir(self, name: str, tags: dict[str, str], group: int | None) -> None:
        """Create `<name>/` with its tags in one rename; the caller holds the lock.

        A `.new-` directory can only be left by a worker that died here: the
        lock is held from its mkdir to its rename.
        """
        staging = self._state_dir / f"{NEW_DIR_PREFIX}{name}"
        shutil.rmtree(staging, ignore_errors=True)
        squid_process.make_dir(staging, group)
        squid_process.write_file(
            staging / TAGS_FILE, json.dumps(tags, indent=2, sort_keys=True) + "\n"
        )
        staging.rename(self._dir(name))

    def _allocate_port(self, name: str, preferred: int | None) -> int:
        """The preferred port if free, else the first port in range that nobody uses.

        Ports recorded by other instances stay reserved even while their Squid
        is down, so a restart gets its port back.
        """
        taken = set()
        for path in self._state_dir.iterdir():
            if path.name != name and not path.name.startswith("."):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    taken.add(_Metadata.from_json((path / METADATA_FILE).read_text()).port)
        first, last = self._settings.first_port, self._settings.last_port
        candidates = ([preferred] if preferred else []) + list(range(first, last + 1))
        for port in candidates:
            if port not in taken and squid_process.bindable(self._bind, port):
                return port
        raise QuotaExceeded(
            f"no free port for a local proxy in {first}..{last} on {self._bind} "
            f"({len(taken)} reserved by local instances, the rest in use)"
        )

    def _await_start(self, name: str, process: subprocess.Popen[bytes], port: int) -> None:
        """Wait briefly for Squid to accept; raise with its log if it exits instead.

        One that takes longer is left starting: the instance reads as
        PROVISIONING until it accepts.
        """
        directory = self._dir(name)
        try:
            squid_process.await_ready(
                process,
                partial(squid_process.accepts, self._client_ip, port),
                START_GRACE_SECONDS,
                (directory / SQUID_OUT, directory / CACHE_LOG),
            )
        except squid_process.SquidExited as exited:
            raise Transient(f"squid for {name} exited while starting: {exited.excerpt}") from None

    # -- processes ---------------------------------------------------------

    def _squid(self, name: str, meta: _Metadata) -> tuple[int, str] | None:
        """(pid, start time) of this instance's Squid while it runs or is still exiting.

        The recorded start time guards against pid reuse (after a reboot or a
        long downtime the pid may be another process's). It is a better
        witness than the command line, which is already empty while an
        exiting process still holds its listening socket. A Squid launched but
        not yet recorded is found by its command line instead.
        """
        _reap()
        if meta.pid is None:
            return _unrecorded_squid(self._dir(name) / CONF_FILE, self._service(name))
        return (meta.pid, meta.started or "") if start_time(meta.pid) == meta.started else None

    def _service(self, name: str) -> str:
        """The Squid service name (and /dev/shm prefix) of instance `name` of this installation.

        Squids started before the installation was hashed in keep their old
        segments until they stop (Squid removes them on a clean exit).
        """
        return squid_process.service_name(name, scope=self._installation)

    def _stop(self, name: str, meta: _Metadata | None) -> None:
        """SIGTERM, SIGKILL after a bound, then make sure no helper outlives Squid.

        Without metadata (a directory from before records were written first)
        there is no pid to signal, but the sweep below still finds Squid.
        """
        squid = self._squid(name, meta) if meta is not None else None
        if squid is not None:
            pid, started = squid
            try:
                squid_process.stop(pid, lambda: not _runs(pid, started), STOP_GRACE_SECONDS)
            except squid_process.SquidError as err:
                raise Transient(f"squid of local instance {name}: {err}") from err
        # Squid puts each helper in a session of its own, so no process-group
        # signal reaches them; they are found by the instance files they name.
        # They exit once Squid closes their pipes: only a stuck one is killed.
        directory = self._dir(name)
        if squid_process.wait_until(lambda: not processes_under(directory), STOP_GRACE_SECONDS):
            return
        for pid in processes_under(directory):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not squid_process.wait_until(lambda: not processes_under(directory), STOP_GRACE_SECONDS):
            raise Transient(f"processes of local instance {name} survive SIGKILL")


# -- helpers without provider state ------------------------------------------


def _reap() -> None:
    """Collect the exit status of Squids that exited, so none stays a zombie."""
    with _CHILDREN_LOCK:
        for pid, process in list(_CHILDREN.items()):
            if process.poll() is not None:
                del _CHILDREN[pid]


def _runs(pid: int, started: str) -> bool:
    """Whether the Squid started at `started` still runs as `pid` (reaping it if it exited)."""
    _reap()
    return start_time(pid) == started


def _recorded(meta: _Metadata, pid: int, started: str) -> _Metadata:
    return dataclasses.replace(meta, pid=pid, started=started)


def _unrecorded_squid(conf: Path, service: str) -> tuple[int, str] | None:
    """(pid, start time) of the Squid launched with `conf`, found by its command line.

    `_start` launches `<binary> -N -f <conf> -n <service>`; the tail is
    matched so a `squid -k parse -f <conf>` check never counts.
    """
    tail = [b"-N", b"-f", os.fsencode(conf), b"-n", service.encode()]
    for pid, args in command_lines():
        if args[-len(tail) :] == tail:
            started = start_time(pid)
            if started is not None:
                return pid, started
    return None


def _checked_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise Permanent(f"invalid local instance name {name!r}: must be a DNS label")
    return name


@contextlib.contextmanager
def _edge(action: str) -> Iterator[None]:
    """Raise only the taxonomy: OS errors by errno, anything else as Transient."""
    try:
        yield
    except ProviderError:
        raise
    except OSError as exc:
        message = f"{action}: {exc}"
        if exc.errno in _EXHAUSTED:
            raise QuotaExceeded(message, cause=exc) from exc
        if exc.errno in _DENIED:
            raise Permanent(message, cause=exc) from exc
        raise Transient(message, cause=exc) from exc
    except Exception as exc:
        raise Transient(f"{action}: {type(exc).__name__}: {exc}", cause=exc) from exc


def _account() -> tuple[int, int] | None:
    """Squid's user's (uid, gid) when it drops to that user; Permanent if it is missing."""
    try:
        return squid_process.squid_account()
    except squid_process.SquidError as err:
        raise Permanent(str(err)) from err


def _account_or_none() -> tuple[int, int] | None:
    """The same, or None where it is missing: then create says so, not the constructor."""
    with contextlib.suppress(squid_process.SquidError):
        return squid_process.squid_account()
    return None


def _read_tags(directory: Path) -> dict[str, str]:
    """The directory's tags; none at all for one this provider never made (or a mangled file).

    Never raises for its content: one odd directory must not make listing,
    and so orphan GC, fail for every instance.
    """
    try:
        tags = json.loads((directory / TAGS_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(tags, dict):
        return {}
    return {k: v for k, v in tags.items() if isinstance(k, str) and isinstance(v, str)}


def _vacated(directory: Path) -> bool:
    """Remove `directory` if it is empty, as a removal interrupted before its rmdir leaves it."""
    try:
        directory.rmdir()
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        if exc.errno == errno.ENOENT:
            return True
        raise
    return True
