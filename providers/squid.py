"""One renderer for every provider's `squid.conf` and htpasswd.

See docs/architecture.md, "The proxy itself".

The local provider writes the result to files, Kubernetes mounts it from a
Secret, GCP ships it in a startup script: all three get the same access rules,
so no provider can produce an open proxy. The rules, in order:

1. clients outside `allowed_cidrs` are denied before anything else;
2. anything that is not CONNECT (plain GET, POST, ...) is denied;
3. CONNECT to a port outside `allowed_connect_ports` is denied;
4. CONNECT to an address in `denied_destinations` (loopback, link-local with
   the cloud metadata server, private ranges by default) is denied, also when
   the name asked for resolves there, with or without credentials;
5. without valid basic-auth credentials the answer is 407;
6. everything else is denied.

Nothing is cached. The password never appears in `squid.conf`; the htpasswd
holds a salted SHA-512-crypt hash that Squid's `basic_ncsa_auth` verifies.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from dataclasses import dataclass, field

NCSA_AUTH_HELPER = "/usr/lib/squid/basic_ncsa_auth"
SQUID_USER = "proxy"

# Where a proxy must not tunnel to unless the config says otherwise: a proxy
# user would otherwise reach what only the proxy host can, such as services on
# its loopback, the cloud metadata server (169.254.169.254, with the VM's
# service account token), the cluster's or the VPC's private addresses.
DEFAULT_DENIED_DESTINATIONS: tuple[str, ...] = (
    "0.0.0.0/8",  # "this network": a connect to 0.0.0.0 reaches the host itself
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local, with the cloud metadata server
    "10.0.0.0/8",  # RFC 1918
    "172.16.0.0/12",  # RFC 1918
    "192.168.0.0/16",  # RFC 1918
    "100.64.0.0/10",  # carrier-grade NAT (RFC 6598), also used for cluster networks
    "::/128",  # unspecified: the host itself, like 0.0.0.0
    "::1/128",  # loopback
    "fe80::/10",  # link-local
    "fc00::/7",  # unique local addresses, with AWS's fd00:ec2::254 metadata server
)


@dataclass(frozen=True)
class ProxySettings:
    """Who may use a proxy and where it may tunnel to.

    Built by the worker from its config; the password never leaves the worker
    (it is excluded from repr so it cannot slip into a log line).
    """

    port: int
    username: str
    password: str = field(repr=False)
    allowed_cidrs: tuple[str, ...]
    allowed_connect_ports: tuple[int, ...]
    # Destinations CONNECT is refused for, whoever asks; () refuses none.
    denied_destinations: tuple[str, ...] = DEFAULT_DENIED_DESTINATIONS


@dataclass(frozen=True)
class SquidPaths:
    """Where the rendered config points Squid at; differs per provider."""

    htpasswd: str = "/etc/squid/passwords"
    pid_file: str = "/run/squid.pid"
    access_log: str = "daemon:/var/log/squid/access.log"
    cache_log: str = "/var/log/squid/cache.log"
    coredump_dir: str = "/var/spool/squid"
    # Squid started as root drops to this user; None when it starts unprivileged.
    effective_user: str | None = SQUID_USER
    # The address `http_port` binds; None binds every interface (containers,
    # VMs). A local proxy must stay on the address its provider was given.
    http_address: str | None = None


@dataclass(frozen=True)
class RenderedSquid:
    squid_conf: str
    htpasswd: str = field(repr=False)


def render(settings: ProxySettings, paths: SquidPaths | None = None) -> RenderedSquid:
    """Render `squid.conf` and the htpasswd for one proxy.

    Raises ValueError for settings that could open the proxy (no CIDRs, no
    ports, an empty password, a CIDR that is not one): config validation
    rejects those earlier, this is the last guard.
    """
    paths = paths or SquidPaths()
    if not settings.allowed_cidrs:
        raise ValueError("allowed_cidrs must not be empty")
    if not settings.allowed_connect_ports:
        raise ValueError("allowed_connect_ports must not be empty")
    if not settings.password or not settings.username or ":" in settings.username:
        raise ValueError("a username without ':' and a non-empty password are required")
    clients = " ".join(_squid_cidr(c) for c in settings.allowed_cidrs)

    lines = [
        "# Rendered by proxy-operator; edits are overwritten.",
        f"http_port {_listen_on(paths.http_address, settings.port)}",
        f"pid_filename {paths.pid_file}",
        # A connection closed before any request (a TCP readiness probe, a
        # load balancer's health check) is not a transaction worth a line;
        # Squid would log it as error:transaction-end-before-headers.
        "acl has_request has request",
        f"access_log {paths.access_log} logformat=squid has_request",
        f"cache_log {paths.cache_log}",
        f"coredump_dir {paths.coredump_dir}",
    ]
    if paths.effective_user:
        lines.append(f"cache_effective_user {paths.effective_user}")
    lines += [
        "",
        f"auth_param basic program {NCSA_AUTH_HELPER} {paths.htpasswd}",
        "auth_param basic children 5 startup=1 idle=1",
        "auth_param basic realm proxy-operator",
        "auth_param basic credentialsttl 1 hour",
        # Squid lowercases usernames before its helper sees them unless told
        # not to: `Proxy` in the htpasswd would then never match.
        "auth_param basic casesensitive on",
        "",
        f"acl allowed_clients src {clients}",
        f"acl allowed_ports port {' '.join(str(p) for p in settings.allowed_connect_ports)}",
        "acl CONNECT method CONNECT",
        "acl authenticated proxy_auth REQUIRED",
    ]
    if settings.denied_destinations:
        # `dst` resolves a name and matches when any of its addresses is in
        # the list; the tunnel then connects to the addresses it checked.
        denied = " ".join(_squid_cidr(c) for c in settings.denied_destinations)
        lines.append(f"acl denied_destinations dst {denied}")
    lines += [
        "",
        "http_access deny !allowed_clients",
        "http_access deny !CONNECT",
        "http_access deny CONNECT !allowed_ports",
    ]
    if settings.denied_destinations:
        # Before auth: no credentials, not even the right ones, open these.
        lines.append("http_access deny denied_destinations")
    lines += [
        "http_access allow CONNECT allowed_ports authenticated",
        "http_access deny all",
        "",
        "# A forward proxy for tunnels only: no cache, no identifying headers.",
        "cache deny all",
        "cache_mem 8 MB",
        "# No ICMP pinger: nothing here uses it, and it is a setuid helper in a",
        "# session of its own that lingers after Squid exits.",
        "pinger_enable off",
        "forwarded_for delete",
        "via off",
        "httpd_suppress_version_string on",
        "# Stop quickly: deletion and replacement should not wait on open tunnels.",
        "shutdown_lifetime 1 seconds",
        "",
    ]
    htpasswd = f"{settings.username}:{sha512_crypt(settings.password)}\n"
    return RenderedSquid(squid_conf="\n".join(lines), htpasswd=htpasswd)


def _squid_cidr(cidr: str) -> str:
    """`cidr` in the canonical prefix form Squid reads as written.

    Squid rewrites every IPv4 network of prefix 0 (`0.0.0.0/0`, but also
    `0.0.0.0/0.0.0.0`) to `all`, which admits IPv6 clients as well; its two
    halves admit exactly every IPv4 address. Raises ValueError for a string
    that is not a network, so no malformed entry reaches Squid.
    """
    network = ipaddress.ip_network(cidr, strict=True)
    if network.version == 4 and network.prefixlen == 0:
        return "0.0.0.0/1 128.0.0.0/1"
    return network.with_prefixlen


def _listen_on(address: str | None, port: int) -> str:
    if address is None:
        return str(port)
    # IPv6 literals need brackets, or Squid reads the last group as the port.
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


_ITOA64 = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
SHA512_CRYPT_ROUNDS = 20_000
# What a setting without `rounds=` means.
SHA512_CRYPT_DEFAULT_ROUNDS = 5000
_SALT_CHARS = 16
# The order in which SHA-crypt's spec spreads the 64 digest bytes over the
# 86 output characters: 21 groups of three, rotated by one each time, then byte 63.
_SHA512_ORDER = [(i, i + 21, i + 42)[i % 3 :] + (i, i + 21, i + 42)[: i % 3] for i in range(21)]


def sha512_crypt(password: str, setting: str | None = None) -> str:
    """SHA-512-crypt (`$6$`), as specified at https://www.akkadia.org/drepper/SHA-crypt.txt.

    `basic_ncsa_auth` hands the hash to crypt(3), which on Debian and Ubuntu
    (glibc, libxcrypt) verifies `$6$`. Written out here because Python's
    `crypt` module is deprecated and gone in 3.13; the spec's test vectors
    hold it to the C implementation (tests/providers/test_squid.py).

    Like crypt(3), `setting` is `$6$[rounds=N$]salt`, or a whole hash to check
    a password against (`sha512_crypt(pw, hashed) == hashed`); None draws a
    fresh 16-character salt and SHA512_CRYPT_ROUNDS. Each round is a SHA-512
    pass: 20,000 is four times glibc's default, and costs Squid's helper a few
    milliseconds once per credentials TTL.
    """
    if setting is None:
        salt = "".join(secrets.choice(_ITOA64) for _ in range(_SALT_CHARS))
        rounds: int | None = SHA512_CRYPT_ROUNDS
    else:
        salt, rounds = _parse_setting(setting)
    pw = password.encode()
    salt_b = salt.encode()[:_SALT_CHARS]

    def repeated(block: bytes, length: int) -> bytes:
        return (block * (length // len(block) + 1))[:length]

    alternate = hashlib.sha512(pw + salt_b + pw).digest()
    ctx = hashlib.sha512(pw + salt_b + repeated(alternate, len(pw)))
    n = len(pw)
    while n:
        ctx.update(alternate if n & 1 else pw)
        n >>= 1
    digest = ctx.digest()
    p_bytes = repeated(hashlib.sha512(pw * len(pw)).digest(), len(pw))
    s_bytes = repeated(hashlib.sha512(salt_b * (16 + digest[0])).digest(), len(salt_b))

    for rnd in range(rounds or SHA512_CRYPT_DEFAULT_ROUNDS):
        step = p_bytes if rnd & 1 else digest
        if rnd % 3:
            step += s_bytes
        if rnd % 7:
            step += p_bytes
        step += digest if rnd & 1 else p_bytes
        digest = hashlib.sha512(step).digest()

    encoded = "".join(
        _to64((digest[a] << 16) | (digest[b] << 8) | digest[c], 4) for a, b, c in _SHA512_ORDER
    )
    encoded += _to64(digest[63], 2)
    # A setting without `rounds=` gets a hash without it, as in crypt(3).
    spec = "" if rounds is None else f"rounds={rounds}$"
    return f"$6${spec}{salt_b.decode()}${encoded}"


def _parse_setting(setting: str) -> tuple[str, int | None]:
    """The salt and rounds (None: not given, the default) of `$6$[rounds=N$]salt[$hash]`."""
    if not setting.startswith("$6$"):
        raise ValueError("a sha512-crypt setting starts with $6$")
    rest = setting.removeprefix("$6$")
    if not rest.startswith("rounds="):
        return rest.partition("$")[0], None
    count, _, rest = rest.removeprefix("rounds=").partition("$")
    if not count.isdigit() or not 1000 <= int(count) <= 999_999_999:
        raise ValueError(f"sha512-crypt rounds must be 1000..999999999, not {count!r}")
    return rest.partition("$")[0], int(count)


def _to64(value: int, count: int) -> str:
    out = ""
    for _ in range(count):
        out += _ITOA64[value & 0x3F]
        value >>= 6
    return out
