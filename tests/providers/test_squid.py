"""The shared Squid renderer: real Squid accepts its output, and it is never an open proxy."""

from __future__ import annotations

import ipaddress
import random
import shutil
import string
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from providers.squid import (
    NCSA_AUTH_HELPER,
    ProxySettings,
    RenderedSquid,
    SquidPaths,
    md5_crypt,
    render,
)

SQUID = shutil.which("squid") or "/usr/sbin/squid"

BASE = ProxySettings(
    port=3128,
    username="proxy",
    password="correct horse battery staple",
    allowed_cidrs=("10.0.0.0/8",),
    allowed_connect_ports=(443,),
)

# Every CIDR shape, port set, privilege mode and listen address at least once.
PARSE_TABLE = [
    (("127.0.0.1/32",), (443,), "proxy", None),
    (("10.0.0.0/8", "192.168.0.0/16", "172.16.0.0/12"), (443, 8443), "proxy", "127.0.0.1"),
    (("::1/128",), (443,), None, "::1"),
    (("2001:db8::/32", "10.0.0.0/8"), (1, 443, 65535), None, None),
    (("0.0.0.0/0",), (443,), "proxy", "0.0.0.0"),
    (("0.0.0.0/0", "::/0"), (443,), None, None),
    (("100.64.0.0/10", "fd00::/8"), (22, 443), None, "127.0.0.1"),
]


@pytest.fixture
def conf_dir(tmp_path: Path) -> Iterator[Path]:
    tmp_path.chmod(0o755)
    yield tmp_path


def write(rendered: RenderedSquid, directory: Path) -> Path:
    (directory / "htpasswd").write_text(rendered.htpasswd)
    conf = directory / "squid.conf"
    conf.write_text(rendered.squid_conf)
    return conf


def paths_in(directory: Path, effective_user: str | None, address: str | None) -> SquidPaths:
    return SquidPaths(
        htpasswd=str(directory / "htpasswd"),
        pid_file=str(directory / "squid.pid"),
        access_log=f"stdio:{directory / 'access.log'}",
        cache_log=str(directory / "cache.log"),
        coredump_dir=str(directory),
        effective_user=effective_user,
        http_address=address,
    )


@pytest.mark.parametrize(("cidrs", "ports", "effective_user", "address"), PARSE_TABLE)
def test_squid_accepts_every_rendering(
    conf_dir: Path,
    cidrs: tuple[str, ...],
    ports: tuple[int, ...],
    effective_user: str | None,
    address: str | None,
) -> None:
    settings = replace(BASE, allowed_cidrs=cidrs, allowed_connect_ports=ports)
    conf = write(render(settings, paths_in(conf_dir, effective_user, address)), conf_dir)
    result = subprocess.run(
        [SQUID, "-k", "parse", "-f", str(conf)], capture_output=True, text=True, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "FATAL" not in output and "ERROR" not in output, output


def test_listen_address_is_bracketed_for_ipv6() -> None:
    assert "http_port 3128\n" in render(BASE).squid_conf
    on_v4 = render(BASE, SquidPaths(http_address="127.0.0.1")).squid_conf
    assert "http_port 127.0.0.1:3128\n" in on_v4
    assert "http_port [::1]:3128\n" in render(BASE, SquidPaths(http_address="::1")).squid_conf


@pytest.mark.parametrize(
    "unsafe",
    [
        replace(BASE, allowed_cidrs=()),
        replace(BASE, allowed_connect_ports=()),
        replace(BASE, password=""),
        replace(BASE, username=""),
        replace(BASE, username="user:name"),
    ],
)
def test_settings_that_could_open_the_proxy_are_refused(unsafe: ProxySettings) -> None:
    with pytest.raises(ValueError):
        render(unsafe)


def random_settings(rng: random.Random) -> ProxySettings:
    def network() -> str:
        if rng.random() < 0.1:
            return rng.choice(["0.0.0.0/0", "::/0"])
        if rng.random() < 0.5:
            return str(ipaddress.IPv4Network((rng.getrandbits(32), rng.randint(0, 32)), False))
        return str(ipaddress.IPv6Network((rng.getrandbits(128), rng.randint(0, 128)), False))

    return ProxySettings(
        port=rng.randint(1, 65535),
        username="".join(rng.choices(string.ascii_letters + string.digits + "._-", k=8)),
        # Long enough that finding it in the output can only mean a leak.
        password="".join(rng.choices(string.printable.strip() + " éß€", k=rng.randint(16, 40))),
        allowed_cidrs=tuple(network() for _ in range(rng.randint(1, 5))),
        allowed_connect_ports=tuple(rng.randint(1, 65535) for _ in range(rng.randint(1, 4))),
    )


def covered(cidrs: Iterable[str]) -> set[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The addresses a list of CIDRs admits, in a canonical form."""
    networks = [ipaddress.ip_network(c) for c in cidrs]
    v4 = [n for n in networks if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in networks if isinstance(n, ipaddress.IPv6Network)]
    return {*ipaddress.collapse_addresses(v4), *ipaddress.collapse_addresses(v6)}


@pytest.mark.parametrize("seed", range(200))
def test_no_rendering_is_an_open_proxy(seed: int) -> None:
    settings = random_settings(random.Random(seed))
    rendered = render(settings)
    lines = rendered.squid_conf.splitlines()

    # The access rules, in order: only authenticated CONNECTs from the
    # allowlist to allowed ports are let through, everything else is denied.
    assert [line for line in lines if line.startswith("http_access")] == [
        "http_access deny !allowed_clients",
        "http_access deny !CONNECT",
        "http_access deny CONNECT !allowed_ports",
        "http_access allow CONNECT allowed_ports authenticated",
        "http_access deny all",
    ]
    (clients,) = [line.split()[3:] for line in lines if line.startswith("acl allowed_clients")]
    assert covered(clients) == covered(settings.allowed_cidrs)
    assert "0.0.0.0/0" not in clients  # Squid would widen it to IPv6 clients too
    ports = " ".join(str(p) for p in settings.allowed_connect_ports)
    assert f"acl allowed_ports port {ports}" in lines
    assert "acl authenticated proxy_auth REQUIRED" in lines
    assert "cache deny all" in lines

    # The secret is only in the htpasswd, and only as a hash that verifies.
    assert settings.password not in rendered.squid_conf
    user, hashed = rendered.htpasswd.rstrip("\n").split(":", 1)
    assert user == settings.username
    salt = hashed.split("$")[2]
    assert md5_crypt(settings.password, salt) == hashed
    assert settings.password not in rendered.htpasswd


def test_md5_crypt_matches_openssl() -> None:
    # `openssl passwd -1 -salt saltsalt password`
    assert md5_crypt("password", "saltsalt") == "$1$saltsalt$qjXMvbEw8oaL.CzflDtaK/"


def test_squids_auth_helper_accepts_the_htpasswd(tmp_path: Path) -> None:
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(render(replace(BASE, password="s3cret-pass")).htpasswd)
    result = subprocess.run(
        [NCSA_AUTH_HELPER, str(htpasswd)],
        input="proxy s3cret-pass\nproxy wrong-pass\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["OK", "ERR"]
