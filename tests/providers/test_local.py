"""The local provider against real Squid processes and a real TLS origin.

Every Squid a test starts lives under a state_dir fixture whose finalizer
deletes all instances in it, so a failing test leaks no process.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from activities.probe import FORBIDDEN, PROXY_AUTH_REQUIRED, ProbeResult, probe_connect
from providers.base import CreateRequest, Instance, InstanceState
from providers.config import parse_config
from providers.errors import NotFound, Permanent, QuotaExceeded, Transient
from providers.local import (
    CONF_FILE,
    HTPASSWD_FILE,
    LOCK_FILE,
    METADATA_FILE,
    TAGS_FILE,
    LocalConfig,
    LocalProvider,
)
from providers.naming import NAMESPACE_KEY, owner_tags
from squid.conf import DEFAULT_DENIED_DESTINATIONS, NCSA_AUTH_HELPER, ProxySettings
from squid.process import RUNTIME_ROOT, SHM_DIR, service_name
from tests.helpers.config import CALLER_SECRETS, LOOPBACK_ORIGIN_DENIED, PASSWORD_ENV
from tests.helpers.network import raw_status
from tests.helpers.procfs import environment, processes_below, secrets_held
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import DEADLINE, wait_for, wait_until
from tests.helpers.xdist import local_ports

USERNAME = "probe"
PASSWORD = "local-test-password"
INSTALLATION = "test-local"
OWNER = "proxy-test-local"
# Away from the ranges other suites' and xdist workers' Squids use: 24100..24199,
# or under xdist a block of this worker's own in 24200..24999.
PORTS = local_ports(base=24200, block=50, blocks=16) or {"first_port": 24100, "last_port": 24199}
FIRST_PORT, LAST_PORT = PORTS["first_port"], PORTS["last_port"]
TAGS = owner_tags(INSTALLATION, OWNER, 0, {"suite": "test_local"})
SQUID = shutil.which("squid") or "/usr/sbin/squid"
# The Squids here have fixed names, and a name is machine-wide (/dev/shm):
# every test of this module runs on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_local")


def proxy_settings(origin: TlsOrigin, **changes: object) -> ProxySettings:
    settings = ProxySettings(
        port=3128,  # ignored: the provider allocates the port
        username=USERNAME,
        password=PASSWORD,
        allowed_cidrs=("127.0.0.1/32",),
        allowed_connect_ports=(origin.port,),
        denied_destinations=LOOPBACK_ORIGIN_DENIED,  # the origin is on loopback
    )
    return replace(settings, **changes)  # type: ignore[arg-type]


def request(
    name: str, origin: TlsOrigin, *, tags: dict[str, str] | None = None, **changes: object
) -> CreateRequest:
    return CreateRequest(
        name=name, proxy=proxy_settings(origin, **changes), tags=dict(tags or TAGS)
    )


def provider_for(
    state_dir: Path, installation: str = INSTALLATION, **changes: object
) -> LocalProvider:
    config = {"state_dir": str(state_dir), "first_port": FIRST_PORT, "last_port": LAST_PORT}
    config.update(changes)
    return LocalProvider(LocalConfig(**config), installation)  # type: ignore[arg-type]


def wrapper_binary(directory: Path, on_launch: str) -> str:
    """A `squid_binary` that runs `on_launch` (shell) before a launch, then the real Squid.

    `squid -k parse` checks pass through untouched; a launch is `squid -N ...`.
    """
    script = directory / "squid-wrapper"
    script.write_text(f'#!/bin/sh\ncase "$1" in -N) {on_launch} ;; esac\nexec {SQUID} "$@"\n')
    script.chmod(0o755)
    return str(script)


@contextlib.contextmanager
def fresh_state_dir() -> Iterator[Path]:
    """A state_dir the `proxy` user can traverse, emptied of Squids afterwards."""
    path = Path(tempfile.mkdtemp(prefix="local-provider-"))
    path.chmod(0o755)  # mkdtemp makes it 0700; Squid runs as `proxy`
    try:
        yield path
    finally:
        names = [entry.name for entry in path.iterdir() if entry.is_dir()]

        def delete(name: str) -> None:
            # Whatever a test left is stopped and removed, whoever's tags it carries.
            with contextlib.suppress(FileNotFoundError):
                (path / name / TAGS_FILE).write_text(json.dumps(TAGS))
            provider_for(path).delete(f"local/{name}")

        # Squid takes seconds to shut down: stop them all at once.
        with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
            list(pool.map(delete, names))
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    with fresh_state_dir() as path:
        yield path


def wait_for_state(
    provider: LocalProvider, provider_id: str, state: InstanceState, timeout: float = 15.0
) -> Instance:
    deadline = time.monotonic() + timeout
    while True:
        instance = provider.get(provider_id)
        if instance.state is state:
            return instance
        assert time.monotonic() < deadline, f"{provider_id} still {instance.state} after {timeout}s"
        time.sleep(0.02)


def squid_pid(state_dir: Path, name: str) -> int:
    pid: int = json.loads((state_dir / name / METADATA_FILE).read_text())["pid"]
    return pid


def live_processes_naming(path: Path) -> list[str]:
    """`ps` lines of live (non-zombie) processes whose arguments mention `path`."""
    out = subprocess.run(
        ["ps", "-ww", "-eo", "stat=,args="], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if f"{path}/" in line and not line.startswith("Z")]


def squids_running(conf: Path) -> list[int]:
    """Pids of live Squids running `conf` (ps's state column varies).

    A child Squid forks to start a helper carries the same command line until
    it execs; it is not a second Squid, so only those whose parent is not one
    of them count (a loaded machine widens that window).
    """
    out = subprocess.run(  # -ww: whole command lines, whatever COLUMNS says
        ["ps", "-ww", "-eo", "pid=,ppid=,stat=,args="],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    live = {
        int(pid): int(ppid)
        for pid, ppid, stat, args in rows
        if f"-f {conf} " in args and stat[0] != "Z"
    }
    return [pid for pid, ppid in live.items() if ppid not in live]


async def probe_origin(instance: Instance, origin: TlsOrigin) -> ProbeResult:
    """A CONNECT through the instance, with the fleet's credentials, to the TLS origin."""
    return await probe_connect(
        instance.ip,
        instance.port,
        USERNAME,
        PASSWORD,
        origin.url,
        ssl_context=origin.client_ssl_context,
    )


def shm_segments(name: str, installation: str = INSTALLATION) -> list[Path]:
    return list(SHM_DIR.glob(f"{service_name(name, scope=installation)}-*"))


def process_exists(pid: int) -> bool:
    """Running or a zombie: either way the pid is still taken."""
    return Path(f"/proc/{pid}").exists()


def assert_removed(directory: Path) -> None:
    """Nothing of the instance is left: files, processes, shm segments."""
    assert not directory.exists()
    assert live_processes_naming(directory) == []
    assert shm_segments(directory.name) == []


async def test_create_probe_delete(state_dir: Path, tls_origin: TlsOrigin) -> None:
    provider = provider_for(state_dir)
    created = provider.create(request("proxy-life", tls_origin))
    assert created.provider_id == "local/proxy-life"
    assert FIRST_PORT <= created.port <= LAST_PORT

    running = wait_for_state(provider, created.provider_id, InstanceState.RUNNING)
    assert running.ip == "127.0.0.1"
    assert running.port == created.port
    assert running.tags == TAGS
    assert running.created_at == created.created_at
    assert shm_segments("proxy-life"), "Squid's shm segments are not where cleanup looks"

    result = await probe_origin(running, tls_origin)
    assert result.ok, result
    assert result.status_code == 200

    pid = squid_pid(state_dir, "proxy-life")
    provider.delete(created.provider_id)

    with pytest.raises(NotFound):
        provider.get(created.provider_id)
    assert_removed(state_dir / "proxy-life")
    assert not process_exists(pid)  # exited, and reaped by the provider that started it
    provider.delete(created.provider_id)  # already gone: success


def test_files_are_shared_with_squid_but_keep_the_secret(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    provider = provider_for(state_dir)
    provider.create(request("proxy-files", tls_origin))
    directory = state_dir / "proxy-files"
    htpasswd = (directory / HTPASSWD_FILE).stat()
    assert not htpasswd.st_mode & stat.S_IROTH
    assert PASSWORD not in (directory / CONF_FILE).read_text()
    assert PASSWORD not in (directory / HTPASSWD_FILE).read_text()
    if os.geteuid() == 0:
        import grp

        proxy_gid = grp.getgrnam("proxy").gr_gid
        assert htpasswd.st_gid == proxy_gid
        assert directory.stat().st_gid == proxy_gid


def test_squid_and_its_helpers_get_no_secret_of_the_worker(
    state_dir: Path, tls_origin: TlsOrigin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's own environment: its Temporal key, cloud credentials, the
    # fleet's password. Squid's user may read a Squid's or helper's environment.
    secrets = {**CALLER_SECRETS, PASSWORD_ENV: PASSWORD}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    provider_for(state_dir).create(request("proxy-env", tls_origin))
    squid = squid_pid(state_dir, "proxy-env")
    processes: dict[int, str] = {}

    def helper_started() -> bool:
        processes.update(processes_below(squid))
        # Squid starts it as `(basic_ncsa_auth) <htpasswd>`.
        return any(f"({Path(NCSA_AUTH_HELPER).name})" in a for a in processes.values())

    wait_until(helper_started, DEADLINE, "Squid's auth helper")
    assert squid in processes
    assert all(environment(pid) for pid in processes), "an environment this test cannot read"
    assert secrets_held(processes, secrets) == {}, processes


def test_create_twice_adopts_one_process(state_dir: Path, tls_origin: TlsOrigin) -> None:
    provider = provider_for(state_dir)
    first = provider.create(request("proxy-twice", tls_origin))
    second = provider.create(request("proxy-twice", tls_origin))
    assert (second.provider_id, second.port, second.created_at) == (
        first.provider_id,
        first.port,
        first.created_at,
    )
    conf = state_dir / "proxy-twice" / CONF_FILE
    assert len(squids_running(conf)) == 1


def test_killed_squid_is_terminated_then_restarts_on_its_port(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    provider = provider_for(state_dir)
    created = provider.create(request("proxy-crash", tls_origin))
    wait_for_state(provider, created.provider_id, InstanceState.RUNNING)
    old_pid = squid_pid(state_dir, "proxy-crash")

    os.kill(old_pid, signal.SIGKILL)
    dead = wait_for_state(provider, created.provider_id, InstanceState.TERMINATED)
    assert dead.ip == ""
    # SIGKILL leaves Squid's shm segments behind; the restart must clear them.
    assert shm_segments("proxy-crash")

    restarted = provider.create(request("proxy-crash", tls_origin))
    running = wait_for_state(provider, restarted.provider_id, InstanceState.RUNNING)
    assert running.port == created.port
    assert running.created_at == created.created_at
    assert squid_pid(state_dir, "proxy-crash") != old_pid


@pytest.mark.slow  # no pid to signal: waits out the grace period, then SIGKILL
def test_delete_stops_a_squid_that_was_never_recorded(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    provider = provider_for(state_dir)
    created = provider.create(request("proxy-unrecorded", tls_origin))
    # As if the worker died between starting Squid and writing instance.json.
    (state_dir / "proxy-unrecorded" / METADATA_FILE).unlink()
    with pytest.raises(NotFound):
        provider.get(created.provider_id)
    provider.delete(created.provider_id)
    assert_removed(state_dir / "proxy-unrecorded")


def test_ports_are_distinct_skip_busy_ones_and_stay_reserved(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    provider = provider_for(state_dir)
    with socket.create_server(("127.0.0.1", FIRST_PORT)):  # someone else's listener
        a = provider.create(request("proxy-a", tls_origin))
        assert a.port != FIRST_PORT

        # While a is down its port stays reserved, so it can come back on it.
        os.kill(squid_pid(state_dir, "proxy-a"), signal.SIGKILL)
        wait_for_state(provider, a.provider_id, InstanceState.TERMINATED)
        b = provider.create(request("proxy-b", tls_origin))
        assert b.port not in (FIRST_PORT, a.port)

    c = provider.create(request("proxy-c", tls_origin))
    assert c.port == FIRST_PORT


def test_concurrent_creates_get_distinct_ports(state_dir: Path, tls_origin: TlsOrigin) -> None:
    provider = provider_for(state_dir)
    names = [f"proxy-concurrent-{i}" for i in range(3)]
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        instances = list(pool.map(lambda n: provider.create(request(n, tls_origin)), names))
    assert len({i.port for i in instances}) == len(names)


def test_no_free_port_is_quota_exceeded(state_dir: Path, tls_origin: TlsOrigin) -> None:
    provider = provider_for(state_dir, first_port=FIRST_PORT, last_port=FIRST_PORT)
    with (
        socket.create_server(("127.0.0.1", FIRST_PORT)),
        pytest.raises(QuotaExceeded, match="no free port"),
    ):
        provider.create(request("proxy-full", tls_origin))


def test_squid_survives_its_worker_and_a_new_provider_takes_over(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    worker_code = textwrap.dedent(
        f"""
        import sys
        from providers.base import CreateRequest
        from providers.local import LocalConfig
        from providers.local import LocalProvider
        from squid.conf import ProxySettings

        provider = LocalProvider(LocalConfig(
            state_dir={str(state_dir)!r}, first_port={FIRST_PORT}, last_port={LAST_PORT}),
            {INSTALLATION!r})
        settings = ProxySettings(3128, {USERNAME!r}, {PASSWORD!r}, ("127.0.0.1/32",),
                                 ({tls_origin.port},), {LOOPBACK_ORIGIN_DENIED!r})
        instance = provider.create(CreateRequest("proxy-orphan", settings, {TAGS!r}))
        print(instance.state.value, flush=True)
        sys.stdin.read()  # stay alive until killed
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", worker_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    ) as worker:
        try:
            assert worker.stdout is not None
            state = worker.stdout.readline().strip()
        finally:
            worker.kill()  # SIGKILL: the worker gets no chance to clean up
    assert state in ("RUNNING", "PROVISIONING")

    provider = provider_for(state_dir)
    found = provider.list_by_tag("label/suite", "test_local")
    assert [i.provider_id for i in found] == ["local/proxy-orphan"]
    wait_for_state(provider, "local/proxy-orphan", InstanceState.RUNNING)
    assert provider.list_by_tag("label/suite", "other") == []

    provider.delete("local/proxy-orphan")
    assert provider.list_by_tag("label/suite", "test_local") == []
    assert_removed(state_dir / "proxy-orphan")


def test_unknown_ids_and_bad_input(state_dir: Path, tls_origin: TlsOrigin) -> None:
    provider = provider_for(state_dir / "not-created-yet")
    with pytest.raises(NotFound):
        provider.get("local/proxy-missing")
    provider.delete("local/proxy-missing")
    assert provider.list_by_tag("label/suite", "test_local") == []
    with pytest.raises(Permanent):
        provider.get("zone-a/proxy-missing")
    with pytest.raises(Permanent):
        provider.create(request("../escape", tls_origin))
    with pytest.raises(Permanent, match="bind_address"):
        provider_for(state_dir, bind_address="localhost")
    with pytest.raises(Permanent, match="cannot render"):
        provider.create(request("proxy-nopassword", tls_origin, password=""))
    assert not (state_dir / "not-created-yet" / "proxy-nopassword").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="Squid only drops to `proxy` when started as root")
async def test_state_dir_the_proxy_user_cannot_reach_moves_to_the_runtime_dir(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    """A state_dir under a private directory (a checkout under /root) still serves.

    Squid's files go to a directory of the system's that its user reaches,
    the same one for every provider over that state_dir, and delete leaves
    nothing there.
    """
    private = state_dir / "private"
    private.mkdir()
    private.chmod(0o700)
    provider = provider_for(private / "proxies")
    moved = RUNTIME_ROOT / f"proxies-{hashlib.sha256(bytes(private / 'proxies')).hexdigest()[:16]}"
    try:
        created = provider.create(request("proxy-unreachable", tls_origin))
        running = wait_for_state(provider, created.provider_id, InstanceState.RUNNING)
        result = await probe_origin(running, tls_origin)
        assert result.ok, result
        assert (moved / "proxy-unreachable" / "access.log").exists()
        # Another provider object (a restarted worker) finds it again.
        again = provider_for(private / "proxies")
        assert [i.name for i in again.list_by_tag("managed-by", "proxy-operator")] == [
            "proxy-unreachable"
        ]
        again.delete(created.provider_id)
        assert_removed(moved / "proxy-unreachable")
    finally:
        with contextlib.suppress(Exception):
            provider.delete("local/proxy-unreachable")
        shutil.rmtree(moved, ignore_errors=True)


def test_missing_binary_is_permanent(state_dir: Path, tls_origin: TlsOrigin) -> None:
    provider = provider_for(state_dir, squid_binary="/nonexistent/squid")
    with pytest.raises(Permanent, match="/nonexistent/squid"):
        provider.create(request("proxy-nobinary", tls_origin))


def test_config_squid_rejects_is_permanent(state_dir: Path, tls_origin: TlsOrigin) -> None:
    provider = provider_for(state_dir)
    # Config validation allows ports up to 65535 only; Squid rejects this one.
    bad = request("proxy-badconf", tls_origin, allowed_connect_ports=(70000,))
    with pytest.raises(Permanent, match="squid rejected"):
        provider.create(bad)
    assert live_processes_naming(state_dir / "proxy-badconf") == []
    assert not (state_dir / "proxy-badconf").exists()


def test_from_config_uses_the_entry_block(tmp_path: Path) -> None:
    config = parse_config(
        {
            "installation": "test",
            "proxy": {"auth": {"password_env": "PW"}, "allowed_cidrs": ["127.0.0.0/8"]},
            "providers": [{"name": "here", "type": "local", "local": {"state_dir": str(tmp_path)}}],
        },
        environ={"PW": PASSWORD},
    )
    provider = LocalProvider.from_config(config.provider("here"), config)
    assert provider.list_by_tag("label/suite", "test_local") == []


# -- what the proxy refuses, on one shared Squid ------------------------------


@pytest.fixture(scope="module")
def guarded(tls_origin: TlsOrigin) -> Iterator[Instance]:
    """One running proxy allowing 127.0.0.1/32 and the origin's port only."""
    with fresh_state_dir() as path:
        provider = provider_for(path)
        created = provider.create(request("proxy-guarded", tls_origin))
        yield wait_for_state(provider, created.provider_id, InstanceState.RUNNING)


def connect_head(origin: TlsOrigin, password: str | None = PASSWORD) -> str:
    """A CONNECT to the origin, with basic auth unless `password` is None."""
    target = f"{origin.host}:{origin.port}"
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if password is not None:
        credentials = base64.b64encode(f"{USERNAME}:{password}".encode()).decode()
        head += f"Proxy-Authorization: Basic {credentials}\r\n"
    return head + "\r\n"


def test_connect_without_credentials_is_407(guarded: Instance, tls_origin: TlsOrigin) -> None:
    assert raw_status(guarded.ip, guarded.port, connect_head(tls_origin, password=None)) == 407


async def test_wrong_credentials_are_407(guarded: Instance, tls_origin: TlsOrigin) -> None:
    result = await probe_connect(
        guarded.ip, guarded.port, USERNAME, "wrong-password", tls_origin.url
    )
    assert (result.failure, result.status_code) == (PROXY_AUTH_REQUIRED, 407)
    assert "wrong-password" not in repr(result)


async def test_connect_to_a_port_not_allowed_is_403(
    guarded: Instance, tls_origin: TlsOrigin
) -> None:
    # Squid refuses before connecting anywhere, so nothing needs to listen there.
    not_allowed = f"https://{tls_origin.host}:443/"
    result = await probe_connect(guarded.ip, guarded.port, USERNAME, PASSWORD, not_allowed)
    assert (result.failure, result.status_code) == (FORBIDDEN, 403)


def test_plain_get_is_denied(guarded: Instance, tls_origin: TlsOrigin) -> None:
    # A valid CONNECT head turned into a GET for the same origin.
    head = (
        connect_head(tls_origin)
        .replace("CONNECT ", "GET http://", 1)
        .replace(" HTTP/1.1", "/ HTTP/1.1", 1)
    )
    assert head.startswith(f"GET http://{tls_origin.host}:{tls_origin.port}/ HTTP/1.1\r\n")
    assert raw_status(guarded.ip, guarded.port, head) == 403


def test_client_outside_the_allowlist_is_denied(guarded: Instance, tls_origin: TlsOrigin) -> None:
    head = connect_head(tls_origin)
    assert raw_status(guarded.ip, guarded.port, head) == 200  # fine from inside
    assert raw_status(guarded.ip, guarded.port, head, source="127.0.0.2") == 403


def test_every_ipv4_client_does_not_mean_ipv6_clients(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    # Squid reads 0.0.0.0/0 as `all`; the renderer must keep IPv6 clients out.
    provider = provider_for(state_dir, bind_address="::")
    created = provider.create(request("proxy-dual", tls_origin, allowed_cidrs=("0.0.0.0/0",)))
    running = wait_for_state(provider, created.provider_id, InstanceState.RUNNING)
    assert running.ip == "::1"  # a wildcard bind is published as loopback
    head = connect_head(tls_origin)
    assert raw_status("127.0.0.1", running.port, head) == 200
    assert raw_status("::1", running.port, head) == 403


async def test_by_default_a_proxy_refuses_loopback_even_with_credentials(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    provider = provider_for(state_dir)
    defaults = request(
        "proxy-defaults", tls_origin, denied_destinations=DEFAULT_DENIED_DESTINATIONS
    )
    running = wait_for_state(provider, provider.create(defaults).provider_id, InstanceState.RUNNING)
    # The origin listens on 127.0.0.1 and its port is allowed: only the
    # destination rule can refuse, and it does before Squid connects anywhere.
    assert raw_status(running.ip, running.port, connect_head(tls_origin)) == 403
    refusal = f"TCP_DENIED/403 .* CONNECT {tls_origin.host}:{tls_origin.port} - HIER_NONE/-"
    log = state_dir / "proxy-defaults" / "access.log"
    # HIER_NONE: Squid contacted nothing. It writes its log with a delay.
    await wait_for(
        lambda: re.search(refusal, log.read_text()) is not None, "the refusal's log line"
    )


# -- whose instances a provider acts on ------------------------------------------


def test_instances_of_another_installation_are_never_deleted_or_adopted(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    ours = provider_for(state_dir)
    created = ours.create(request("proxy-shared-name", tls_origin))
    pid = squid_pid(state_dir, "proxy-shared-name")
    staging = provider_for(state_dir, installation="staging")

    with pytest.raises(Permanent, match=r"installation='test-local' \(expected 'staging'\)"):
        staging.delete(created.provider_id)
    staging_tags = owner_tags("staging", OWNER, 0)
    with pytest.raises(Permanent, match="not this proxy's"):
        staging.create(request("proxy-shared-name", tls_origin, tags=staging_tags))
    # Another owner, generation or namespace of this installation cannot take it over either.
    ours_tagged = request("proxy-shared-name", tls_origin, tags=TAGS | {NAMESPACE_KEY: "prod"})
    wrong_namespace = request("proxy-shared-name", tls_origin, tags=TAGS | {NAMESPACE_KEY: "dev"})
    (state_dir / "proxy-shared-name" / TAGS_FILE).write_text(json.dumps(ours_tagged.tags))
    for other in [
        request("proxy-shared-name", tls_origin, tags=owner_tags(INSTALLATION, "proxy-x", 0)),
        request("proxy-shared-name", tls_origin, tags=owner_tags(INSTALLATION, OWNER, 1)),
        wrong_namespace,
    ]:
        with pytest.raises(Permanent, match=r"(owner|generation|namespace)=.* \(expected"):
            ours.create(other)
    assert ours.create(ours_tagged).provider_id == created.provider_id
    # A request that this installation could never find again is refused at once.
    with pytest.raises(Permanent, match="request's tags"):
        ours.create(request("proxy-foreign", tls_origin, tags=staging_tags))
    assert not (state_dir / "proxy-foreign").exists()

    assert squid_pid(state_dir, "proxy-shared-name") == pid
    assert ours.get(created.provider_id).state is InstanceState.RUNNING
    assert json.loads((state_dir / "proxy-shared-name" / TAGS_FILE).read_text()) == ours_tagged.tags
    ours.delete(created.provider_id)
    assert_removed(state_dir / "proxy-shared-name")


async def test_two_installations_on_one_machine_serve_a_proxy_of_the_same_name(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    """Service names and /dev/shm are machine-wide: each installation's are its own.

    The same instance name can be in two installations' state directories
    (a lifecycle whose names predate installation-scoped names, or two
    installations given the same owner id). Were Squid's service name the
    instance name alone, each start would remove the other's shm segments,
    and so would each delete.
    """
    name = "proxy-same-name"
    with fresh_state_dir() as other_dir:
        ours, theirs = provider_for(state_dir), provider_for(other_dir, installation="staging")
        created = [
            ours.create(request(name, tls_origin)),
            theirs.create(request(name, tls_origin, tags=owner_tags("staging", OWNER, 0))),
        ]
        for provider, instance in zip((ours, theirs), created, strict=True):
            running = wait_for_state(provider, instance.provider_id, InstanceState.RUNNING)
            result = await probe_origin(running, tls_origin)
            assert result.ok, result
        our_segments, their_segments = shm_segments(name), shm_segments(name, "staging")
        assert our_segments and their_segments
        assert not set(our_segments) & set(their_segments)

        ours.delete(created[0].provider_id)
        assert_removed(state_dir / name)
        assert shm_segments(name, "staging") == their_segments  # theirs kept
        result = await probe_origin(theirs.get(created[1].provider_id), tls_origin)
        assert result.ok, result
        theirs.delete(created[1].provider_id)
        assert shm_segments(name, "staging") == []


def test_a_directory_made_by_hand_is_not_deleted(state_dir: Path) -> None:
    hand_made = state_dir / "proxy-by-hand"
    hand_made.mkdir()
    (hand_made / "notes.txt").write_text("mine")
    with pytest.raises(Permanent, match="managed-by=None"):
        provider_for(state_dir).delete("local/proxy-by-hand")
    assert (hand_made / "notes.txt").read_text() == "mine"
    # Mangled tags are no tags: refused, and no reason for listing to fail.
    for mangled, content in (("proxy-truncated", '{"managed-by": "pro'), ("proxy-list", "[1]")):
        (state_dir / mangled).mkdir()
        (state_dir / mangled / TAGS_FILE).write_text(content)
        with pytest.raises(Permanent, match="managed-by=None"):
            provider_for(state_dir).delete(f"local/{mangled}")
    assert provider_for(state_dir).list_by_tag("managed-by", "proxy-operator") == []
    # What a removal interrupted before its rmdir leaves is just finished off.
    (hand_made / "notes.txt").unlink()
    provider_for(state_dir).delete("local/proxy-by-hand")
    assert not hand_made.exists()


# -- crashes and failures leave one Squid, or nothing --------------------------------


def test_a_worker_killed_between_launch_and_record_leaves_one_squid_that_is_adopted(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    # The launch kills the worker that made it, then becomes Squid: the
    # worker dies after the launch and before it could record the pid.
    binary = wrapper_binary(state_dir, "kill -KILL $PPID")
    worker_code = textwrap.dedent(
        f"""
        from providers.base import CreateRequest
        from providers.local import LocalConfig, LocalProvider
        from squid.conf import ProxySettings

        provider = LocalProvider(LocalConfig(
            state_dir={str(state_dir)!r}, first_port={FIRST_PORT}, last_port={LAST_PORT},
            squid_binary={binary!r}), {INSTALLATION!r})
        settings = ProxySettings(3128, {USERNAME!r}, {PASSWORD!r}, ("127.0.0.1/32",),
                                 ({tls_origin.port},), {LOOPBACK_ORIGIN_DENIED!r})
        provider.create(CreateRequest("proxy-window", settings, {TAGS!r}))
        """
    )
    worker = subprocess.run(
        [sys.executable, "-c", worker_code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert worker.returncode == -signal.SIGKILL, worker.stderr
    record = json.loads((state_dir / "proxy-window" / METADATA_FILE).read_text())
    assert record["pid"] is None, "the kill did not land between launch and record"
    conf = state_dir / "proxy-window" / CONF_FILE

    provider = provider_for(state_dir)  # the retry, in the next worker
    found = wait_for_state(provider, "local/proxy-window", InstanceState.RUNNING)
    assert found.port == record["port"]
    (squid,) = squids_running(conf)
    segments = shm_segments("proxy-window")
    assert segments

    retried = provider.create(request("proxy-window", tls_origin))
    assert retried.port == record["port"]
    assert squids_running(conf) == [squid]  # adopted, not started again
    assert shm_segments("proxy-window") == segments  # its shared memory kept
    assert squid_pid(state_dir, "proxy-window") == squid  # recorded now
    assert raw_status(retried.ip or "127.0.0.1", retried.port, connect_head(tls_origin)) == 200
    provider.delete(retried.provider_id)
    assert_removed(state_dir / "proxy-window")


def test_failed_creates_leave_nothing_in_the_state_dir(
    state_dir: Path, tls_origin: TlsOrigin
) -> None:
    def left() -> list[str]:
        return sorted(entry.name for entry in state_dir.iterdir())

    with pytest.raises(Permanent, match="squid rejected"):
        provider_for(state_dir).create(
            request("proxy-rejected", tls_origin, allowed_connect_ports=(70000,))
        )
    assert left() == [LOCK_FILE]

    dies = provider_for(state_dir, squid_binary=wrapper_binary(state_dir, "echo FATAL: no; exit 1"))
    with pytest.raises(Transient, match=r"exited while starting: .*FATAL: no"):
        dies.create(request("proxy-dies", tls_origin))
    assert left() == [LOCK_FILE, "squid-wrapper"]
    assert shm_segments("proxy-dies") == []

    with socket.create_server(("127.0.0.1", 0)) as taken, pytest.raises(QuotaExceeded):
        port = taken.getsockname()[1]
        full = provider_for(state_dir, first_port=port, last_port=port)
        full.create(request("proxy-noport", tls_origin))
    assert left() == [LOCK_FILE, "squid-wrapper"]
