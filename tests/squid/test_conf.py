"""The shared Squid renderer: real Squid accepts its output, and it is never an open proxy.

The tests that send requests through a real Squid give it a parent proxy on
loopback (tests/helpers/loopback_peer.py) and forbid direct connections, so
a CONNECT it lets through to a public or private address reaches 127.0.0.1
and nothing else, even when the rule under test were broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
import shutil
import string
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from squid.conf import (
    NCSA_AUTH_HELPER,
    ProxySettings,
    RenderedSquid,
    SquidPaths,
    render,
    render_gateway_front,
)
from squid.htpasswd import SHA512_CRYPT_ROUNDS, sha512_crypt
from tests.helpers.loopback_peer import LoopbackPeer, connect_status, loopback_peer
from tests.helpers.network import free_port
from tests.helpers.squid_upstream import LocalSquid, SquidUpstreams

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
    (("0.0.0.0/0.0.0.0", "10.0.0.0/255.0.0.0"), (443,), None, None),
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


def test_only_a_squid_that_never_goes_direct_may_skip_auth() -> None:
    with pytest.raises(ValueError, match="parent"):
        render(BASE, authenticate=False)
    with pytest.raises(ValueError, match="parent"):
        render(BASE, authenticate=False, routing=["cache_peer 127.0.0.1 parent 3128 0"])

    front = render_gateway_front(BASE, SquidPaths(), 4001).squid_conf.splitlines()
    # The rules a client meets at the gateway, in order; credentials are the router's to check.
    assert [line for line in front if line.startswith("http_access")] == [
        "http_access deny !allowed_clients",
        "http_access deny !CONNECT",
        "http_access deny CONNECT !allowed_ports",
        "http_access deny denied_destinations",
        "http_access allow CONNECT allowed_ports",
        "http_access deny all",
    ]
    assert "never_direct allow all" in front
    assert not [line for line in front if line.startswith("auth_param")]
    peers = [line for line in front if line.startswith("cache_peer ")]
    assert len(peers) == 1 and "parent 4001 " in peers[0] and "login=PASSTHRU" in peers[0]


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
    rng = random.Random(seed)
    settings = random_settings(rng)
    if rng.random() < 0.2:
        settings = replace(settings, denied_destinations=())
    if rng.random() < 0.2:
        exceptions = tuple(
            (str(ipaddress.IPv4Address(rng.getrandbits(32))), rng.randint(1, 65535))
            for _ in range(rng.randint(1, 3))
        )
        settings = replace(settings, destination_exceptions=exceptions)
    rendered = render(settings)
    lines = rendered.squid_conf.splitlines()

    # The access rules, in order: only authenticated CONNECTs from the
    # allowlist to allowed ports and destinations (or to an exception) are
    # let through, everything else is denied; denied destinations before
    # credentials.
    unless = " !destination_exceptions" if settings.destination_exceptions else ""
    destination_rule = [f"http_access deny denied_destinations{unless}"]
    exception_rule = ["http_access allow CONNECT destination_exceptions authenticated"]
    assert [line for line in lines if line.startswith("http_access")] == [
        "http_access deny !allowed_clients",
        "http_access deny !CONNECT",
        f"http_access deny CONNECT !allowed_ports{unless}",
        *(destination_rule if settings.denied_destinations else []),
        "http_access allow CONNECT allowed_ports authenticated",
        *(exception_rule if settings.destination_exceptions else []),
        "http_access deny all",
    ]
    for n, (address, port) in enumerate(settings.destination_exceptions):
        assert f"acl destination_exception_{n}_host dstdomain -n {address}" in lines
        assert f"acl destination_exception_{n}_port port {port}" in lines
    (clients,) = [line.split()[3:] for line in lines if line.startswith("acl allowed_clients")]
    assert covered(clients) == covered(settings.allowed_cidrs)
    assert "0.0.0.0/0" not in clients  # Squid would widen it to IPv6 clients too
    denied = [line.split()[3:] for line in lines if line.startswith("acl denied_destinations")]
    assert [covered(d) for d in denied] == (
        [covered(settings.denied_destinations)] if settings.denied_destinations else []
    )
    ports = " ".join(str(p) for p in settings.allowed_connect_ports)
    assert f"acl allowed_ports port {ports}" in lines
    assert "acl authenticated proxy_auth REQUIRED" in lines
    assert "auth_param basic casesensitive on" in lines
    assert "cache deny all" in lines

    # The secret is only in the htpasswd, and only as a salted slow hash.
    assert settings.password not in rendered.squid_conf
    user, hashed = rendered.htpasswd.rstrip("\n").split(":", 1)
    assert user == settings.username
    assert hashed.startswith(f"$6$rounds={SHA512_CRYPT_ROUNDS}$")
    assert settings.password not in rendered.htpasswd


def test_every_ipv4_network_of_prefix_zero_is_split_whatever_its_spelling() -> None:
    # Squid reads any IPv4 network of prefix 0 as `all`, IPv6 clients included.
    for spelling in ("0.0.0.0/0", "0.0.0.0/0.0.0.0"):
        conf = render(replace(BASE, allowed_cidrs=(spelling,))).squid_conf
        assert "acl allowed_clients src 0.0.0.0/1 128.0.0.0/1\n" in conf
    masked = render(replace(BASE, allowed_cidrs=("10.0.0.0/255.0.0.0",))).squid_conf
    assert "acl allowed_clients src 10.0.0.0/8\n" in masked
    with pytest.raises(ValueError):
        render(replace(BASE, allowed_cidrs=("10.0.0.1/8",)))
    with pytest.raises(ValueError):
        render(replace(BASE, denied_destinations=("not-a-network",)))


# From the specification's own test vectors (https://www.akkadia.org/drepper/SHA-crypt.txt);
# glibc's and libxcrypt's crypt(3) produce the same.
SHA512_CRYPT_VECTORS = [
    (
        "$6$saltstring",
        "Hello world!",
        "$6$saltstring$svn8UoSVapNtMuq1ukKS4tPQd8iKwSMHWjl/O817G3uBnIFNjnQJuesI68u4OTLiBFdcbYEdFCoEOfaS35inz1",
    ),
    (
        "$6$rounds=10000$saltstringsaltstring",
        "Hello world!",
        "$6$rounds=10000$saltstringsaltst$OW1/O6BYHV6BcXZu8QVeXbDWra3Oeqh0sbHbbMCVNSnCM/UrjmM0Dp8vOuZeHBy/YTBmSK6H9qs/y3RnOaw5v.",
    ),
    (
        "$6$rounds=5000$toolongsaltstring",
        "This is just a test",
        "$6$rounds=5000$toolongsaltstrin$lQ8jolhgVRVhY4b5pZKaysCLi0QBxGoNeKQzQ3glMhwllF7oGDZxUhx1yxdYcz/e1JSbq3y6JMxxl8audkUEm0",
    ),
    (
        "$6$rounds=1400$anotherlongsaltstring",
        "a very much longer text to encrypt.  This one even stretches over morethan one line.",
        "$6$rounds=1400$anotherlongsalts$POfYwTEok97VWcjxIiSOjiykti.o/pQs.wPvMxQ6Fm7I6IoYN3CmLs66x9t0oSwbtEW7o7UmJEiDwGqd8p4ur1",
    ),
    (
        "$6$rounds=77777$short",
        "we have a short salt string but not a short password",
        "$6$rounds=77777$short$WuQyW2YR.hBNpjjRhpYD/ifIw05xdfeEyQoMxIXbkvr0gge1a1x3yRULJ5CCaUeOxFmtlcGZelFl5CxtgfiAc0",
    ),
    (
        "$6$rounds=123456$asaltof16chars..",
        "a short string",
        "$6$rounds=123456$asaltof16chars..$BtCwjqMJGx5hrJhZywWvt0RLE8uZ4oPwcelCjmw2kSYu.Ec6ycULevoBK25fs2xXgMNrCzIMVcgEJAstJeonj1",
    ),
]


@pytest.mark.parametrize(("setting", "password", "expected"), SHA512_CRYPT_VECTORS)
def test_sha512_crypt_matches_the_specification(setting: str, password: str, expected: str) -> None:
    assert sha512_crypt(password, setting) == expected
    # A whole hash as the setting re-derives it, the way crypt(3) verifies.
    assert sha512_crypt(password, expected) == expected
    assert sha512_crypt(password + "x", expected) != expected


def test_each_hash_has_a_fresh_salt_and_bad_settings_are_refused() -> None:
    first, second = sha512_crypt(BASE.password), sha512_crypt(BASE.password)
    assert first != second
    assert sha512_crypt(BASE.password, first) == first
    for setting in ("$1$saltsalt", "$6$rounds=999$salt", "$6$rounds=many$salt"):
        with pytest.raises(ValueError):
            sha512_crypt("x", setting)


def test_squids_auth_helper_accepts_the_htpasswd(tmp_path: Path) -> None:
    htpasswd = tmp_path / "htpasswd"
    password = "s3cret-pass-of-20-ch"
    htpasswd.write_text(render(replace(BASE, password=password)).htpasswd)
    result = subprocess.run(
        [NCSA_AUTH_HELPER, str(htpasswd)],
        # The helper reads URL-escaped "user password" lines from Squid.
        input=f"proxy {password}\nproxy {password[:-1]}\nproxy {password}x\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["OK", "ERR", "ERR"]


# -- what a real Squid lets through ----------------------------------------------

StartSquid = Callable[[ProxySettings], Awaitable[tuple[LocalSquid, LoopbackPeer]]]


@pytest.fixture
async def start_squid() -> AsyncIterator[StartSquid]:
    """Run a rendered config, its only way out a parent proxy on loopback."""
    upstreams = SquidUpstreams()
    peers = contextlib.ExitStack()

    async def start(settings: ProxySettings) -> tuple[LocalSquid, LoopbackPeer]:
        peer = peers.enter_context(loopback_peer())
        port = free_port()
        rendered = render(replace(settings, port=port))
        squid = await upstreams.start(
            rendered.squid_conf + peer.squid_conf(),
            {SquidPaths().htpasswd: rendered.htpasswd},
            port=port,
        )
        return squid, peer

    with peers:
        try:
            yield start
        finally:
            upstreams.close()


SQUID_SETTINGS = ProxySettings(
    port=3128,
    username="proxy",
    # What the helper protocol escapes (space, %, +) and what it could split on.
    password="right pass:wörd%20+of-24",
    allowed_cidrs=("127.0.0.0/8",),
    allowed_connect_ports=(443, 8443),
)
RIGHT = (SQUID_SETTINGS.username, SQUID_SETTINGS.password)
DENIED_BY_DEFAULT = [
    "127.0.0.1:443",
    "127.8.9.10:8443",
    "localhost:443",  # a name that resolves to loopback (/etc/hosts)
    "0.0.0.0:443",
    "10.1.2.3:443",
    "172.16.0.1:443",
    "192.168.1.1:443",
    "100.64.0.1:443",
    "169.254.169.254:443",  # the cloud metadata server
    "[::1]:443",
    "[::]:443",
    "[fe80::1]:443",
    "[fd00:ec2::254]:443",
    "[::ffff:10.0.0.1]:443",  # IPv4-mapped: still 10.0.0.1
    "[::ffff:127.0.0.1]:443",
]
PUBLIC = ["1.1.1.1:443", "8.8.8.8:8443", "[2606:4700:4700::1111]:443"]


async def statuses(
    squid: LocalSquid, targets: list[str], credentials: tuple[str, str] | None = RIGHT
) -> dict[str, int]:
    return {
        target: await asyncio.to_thread(connect_status, squid.port, target, credentials)
        for target in targets
    }


@pytest.mark.slow
async def test_private_destinations_are_refused_before_credentials_count(
    start_squid: StartSquid,
) -> None:
    squid, peer = await start_squid(SQUID_SETTINGS)
    assert await statuses(squid, DENIED_BY_DEFAULT) == {t: 403 for t in DENIED_BY_DEFAULT}
    # Refused before auth: no 407 challenge without credentials either.
    assert await statuses(squid, DENIED_BY_DEFAULT[:3], None) == {
        t: 403 for t in DENIED_BY_DEFAULT[:3]
    }
    assert peer.requests == []  # nothing was forwarded, let alone connected

    # Public destinations pass this rule: Squid forwards them (to the loopback peer).
    assert await statuses(squid, PUBLIC) == {t: 200 for t in PUBLIC}
    assert peer.requests == [f"CONNECT {t} HTTP/1.1" for t in PUBLIC]
    assert await statuses(squid, PUBLIC[:1], None) == {PUBLIC[0]: 407}


@pytest.mark.slow
async def test_the_configured_list_replaces_the_default(start_squid: StartSquid) -> None:
    squid, peer = await start_squid(replace(SQUID_SETTINGS, denied_destinations=("1.1.1.0/24",)))
    assert await statuses(squid, ["1.1.1.1:443", "10.1.2.3:443"]) == {
        "1.1.1.1:443": 403,
        "10.1.2.3:443": 200,
    }
    assert peer.requests == ["CONNECT 10.1.2.3:443 HTTP/1.1"]


@pytest.mark.slow
async def test_a_destination_exception_opens_that_address_and_port_only(
    start_squid: StartSquid,
) -> None:
    demo_site = "127.0.0.1:8443"  # make run's demo site, on a port not otherwise allowed
    settings = replace(
        SQUID_SETTINGS, allowed_connect_ports=(443,), destination_exceptions=(("127.0.0.1", 8443),)
    )
    squid, peer = await start_squid(settings)
    still_denied = [
        "127.0.0.1:443",  # the address on another port
        "127.0.0.1:8444",
        "127.0.0.2:8443",  # the port on another loopback address
        "localhost:8443",  # a name that resolves to the address
        "[::1]:8443",
        "8.8.8.8:8443",  # the port elsewhere: still not an allowed port
    ]
    # Squid reads an IPv4-mapped address as the IPv4 one: the same destination.
    mapped = "[::ffff:127.0.0.1]:8443"
    assert await statuses(squid, [demo_site, mapped, *still_denied]) == {
        demo_site: 200,
        mapped: 200,
        **{t: 403 for t in still_denied},
    }
    assert await statuses(squid, [demo_site], None) == {demo_site: 407}
    assert peer.requests == [f"CONNECT {demo_site} HTTP/1.1"] * 2


@pytest.mark.slow
async def test_squid_checks_the_password_and_the_username_as_written(
    start_squid: StartSquid,
) -> None:
    squid, peer = await start_squid(replace(SQUID_SETTINGS, username="Fleet.User"))
    password = SQUID_SETTINGS.password
    target = PUBLIC[0]
    assert await statuses(squid, [target], ("Fleet.User", password)) == {target: 200}
    for wrong in [
        ("Fleet.User", password[:-1]),
        ("Fleet.User", password + "x"),
        ("fleet.user", password),  # Squid would lowercase it by default
        ("FLEET.USER", password),
    ]:
        assert await statuses(squid, [target], wrong) == {target: 407}, wrong
    assert peer.requests == [f"CONNECT {target} HTTP/1.1"]
