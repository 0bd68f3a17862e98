"""The GCP startup script: its template, and a first boot run by bash against stub commands.

A real first boot is where images differ: unattended-upgrades holds the dpkg
lock for minutes, a third-party apt repository on the image fails `apt-get
update`, a step fails. The script is run here as it is shipped, with
`apt-get`, `curl` (the metadata server), `systemctl`, `squid`, `install` and
`sleep` replaced by stubs on PATH that log their arguments, and /etc/squid
moved into a temporary directory. What it reports through the guest
attribute is what the provider's `get` reads (tests/providers/test_gcp.py).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from providers.gcp import STARTUP_READY, STARTUP_STATE_ATTRIBUTE, startup_script
from providers.gcp.startup import TEMPLATE, TEMPLATE_FILE
from squid.conf import ProxySettings
from squid.htpasswd import sha512_crypt
from tests.helpers.network import free_port

BASH = shutil.which("bash") or "/bin/bash"
REPO = Path(__file__).resolve().parents[2]
PASSWORD = "correct horse battery staple"

# Each stub appends "<name> <args>" to $STUB_LOG; behaviour is steered by
# environment variables, counters live in $STUB_STATE.
STUBS = {
    "apt-get": r"""
echo "apt-get $*" >> "$STUB_LOG"
case " $* " in
  *" update "*)
    if [ -n "${APT_UPDATE_FAILS:-}" ]; then
      echo "E: The repository 'https://packages.example.com/apt stable Release'" \
        "no longer has a Release file." >&2
      exit 100
    fi ;;
  *" install "*)
    n=$(cat "$STUB_STATE/installs" 2>/dev/null || echo 0); n=$((n + 1))
    echo "$n" > "$STUB_STATE/installs"
    if [ "$n" -le "${APT_INSTALL_FAILURES:-0}" ]; then
      echo "E: Could not get lock /var/lib/dpkg/lock-frontend." \
        "It is held by process 812 (unattended-upgr)" >&2
      exit 100
    fi
    cp "$STUB_DIR/squid.stub" "$STUB_DIR/squid" && chmod +x "$STUB_DIR/squid" ;;
esac
""",
    "curl": r"""
echo "curl $*" >> "$STUB_LOG"
while [ $# -gt 0 ]; do
  case "$1" in
    --data) echo "$2" >> "$STUB_STATE/reports"; shift ;;
    http://*) echo "$1" >> "$STUB_STATE/urls" ;;
  esac
  shift
done
""",
    "systemctl": r"""echo "systemctl $*" >> "$STUB_LOG" """,
    "sleep": r"""echo "sleep $*" >> "$STUB_LOG" """,
    "install": r"""
echo "install $*" >> "$STUB_LOG"
if [ "$1" = "-d" ]; then mkdir -p "${@: -1}"; else : > "${@: -1}"; fi
""",
    "squid.stub": r"""
echo "squid $*" >> "$STUB_LOG"
[ -z "${SQUID_PARSE_FAILS:-}" ] || { echo "FATAL: Bungled squid.conf line 3" >&2; exit 1; }
""",
}


@dataclass
class Boot:
    """One run of the script: its exit code, what it reported, what it ran."""

    returncode: int
    reports: list[str]
    calls: list[str]
    urls: list[str]
    etc: Path
    stderr: str


@pytest.fixture
def listener() -> Iterator[int]:
    """A port something listens on, standing in for the Squid the script started."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def boot(tmp_path: Path, port: int, *, squid_installed: bool = False, **env: str) -> Boot:
    bin_dir, state, etc = tmp_path / "bin", tmp_path / "state", tmp_path / "etc-squid"
    for directory in (bin_dir, state):
        directory.mkdir()
    for name, body in STUBS.items():
        stub = bin_dir / name
        stub.write_text(f"#!{BASH}\n{body}")
        stub.chmod(0o755)
    if squid_installed:
        shutil.copy(bin_dir / "squid.stub", bin_dir / "squid")
    proxy = ProxySettings(
        port=port,
        username="proxy",
        password=PASSWORD,
        allowed_cidrs=("192.0.2.0/24",),
        allowed_connect_ports=(443,),
    )
    script = tmp_path / "startup.sh"
    script.write_text(startup_script(proxy).replace("/etc/squid", str(etc)))
    log = tmp_path / "calls.log"
    done = subprocess.run(
        [BASH, str(script)],
        env={
            # No /usr/sbin: the machine's own Squid must not count as installed.
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "STUB_DIR": str(bin_dir),
            "STUB_LOG": str(log),
            "STUB_STATE": str(state),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )

    def lines(path: Path) -> list[str]:
        return path.read_text().splitlines() if path.exists() else []

    return Boot(
        done.returncode,
        lines(state / "reports"),
        lines(log),
        lines(state / "urls"),
        etc,
        done.stderr,
    )


def test_a_held_apt_lock_and_a_broken_repository_still_end_ready(
    tmp_path: Path, listener: int
) -> None:
    run = boot(tmp_path, listener, APT_UPDATE_FAILS="1", APT_INSTALL_FAILURES="2")

    assert run.returncode == 0, run.stderr
    assert run.reports == ["installing", STARTUP_READY]
    installs = [c for c in run.calls if c.startswith("apt-get") and " install " in c]
    assert len(installs) == 3
    # apt itself waits for the lock unattended-upgrades holds, before failing.
    assert all("-o DPkg::Lock::Timeout=120" in c for c in installs)
    assert f"squid -k parse -f {run.etc}/squid.conf" in run.calls
    assert "systemctl restart squid" in run.calls
    assert (run.etc / "squid.conf").read_text().startswith("# Rendered by proxy-operator")
    assert (
        run.urls
        == [
            "http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes/"
            + STARTUP_STATE_ATTRIBUTE
        ]
        * 2
    )


def test_an_install_that_never_succeeds_is_reported(tmp_path: Path, listener: int) -> None:
    run = boot(tmp_path, listener, APT_INSTALL_FAILURES="99")

    assert run.returncode == 1
    assert run.reports == ["installing", "failed: apt-get could not install squid in 5 attempts"]
    assert not (run.etc / "squid.conf").exists()


def test_a_failing_step_reports_which(tmp_path: Path, listener: int) -> None:
    run = boot(tmp_path, listener, squid_installed=True, SQUID_PARSE_FAILS="1")

    assert run.returncode != 0
    (report,) = run.reports
    assert report.startswith("failed: line ")
    assert f"squid -k parse -f {run.etc}/squid.conf (exit 1)" in report
    assert "systemctl restart squid" not in run.calls


def test_squid_that_never_listens_is_reported(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there

    run = boot(tmp_path, port, squid_installed=True)

    assert run.returncode == 1
    assert run.reports == [f"failed: squid is not listening on port {port}"]


def test_a_later_boot_reconfigures_without_apt(tmp_path: Path, listener: int) -> None:
    run = boot(tmp_path, listener, squid_installed=True)

    assert run.returncode == 0, run.stderr
    assert run.reports == [STARTUP_READY]
    assert not [c for c in run.calls if c.startswith("apt-get")]


# -- the template ----------------------------------------------------------------


def proxy(port: int = 3128) -> ProxySettings:
    return ProxySettings(
        port=port,
        username="proxy",
        password=PASSWORD,
        allowed_cidrs=("192.0.2.0/24", "10.0.0.0/8"),
        allowed_connect_ports=(443, 8443),
    )


def test_every_placeholder_is_filled_and_bash_accepts_the_script(tmp_path: Path) -> None:
    placeholders = TEMPLATE.get_identifiers()
    assert {"PORT", "SQUID_CONF_TEXT", "HTPASSWD_TEXT"} <= set(placeholders)

    script = startup_script(proxy(port=3999))

    assert not re.findall(r"@[A-Z][A-Z_]*@", script)
    assert "/dev/tcp/127.0.0.1/3999" in script
    assert "squid is not listening on port 3999" in script
    path = tmp_path / "startup.sh"
    path.write_text(script)
    parsed = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True, check=False)
    assert parsed.returncode == 0, parsed.stderr


def test_the_script_carries_the_password_hashed_and_nothing_else_secret() -> None:
    script = startup_script(proxy())

    assert PASSWORD not in script
    # The one credential is the htpasswd line, whose hash checks the password.
    (line,) = [line for line in script.splitlines() if "$6$" in line]
    username, _, hashed = line.partition(":")
    assert username == "proxy"
    assert hashed == sha512_crypt(PASSWORD, hashed)


def test_the_template_ships_with_the_package() -> None:
    # pip install (-e or a wheel) copies only the package data pyproject names.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    assert "providers.gcp" in setuptools["packages"]
    assert TEMPLATE_FILE in setuptools["package-data"]["providers.gcp"]
    assert (REPO / "providers" / "gcp" / TEMPLATE_FILE).is_file()
