"""One renderer for every provider's `squid.conf` and htpasswd.

See docs/architecture.md, "The proxy itself".

The local provider writes the result to files, Kubernetes mounts it from a
Secret, GCP ships it in a startup script: all three get the same access rules,
so no provider can produce an open proxy. The rules, in order:

1. clients outside `allowed_cidrs` are denied before anything else;
2. anything that is not CONNECT (plain GET, POST, ...) is denied;
3. CONNECT to a port outside `allowed_connect_ports` is denied;
4. without valid basic-auth credentials the answer is 407;
5. everything else is denied.

Nothing is cached. The password never appears in `squid.conf`; the htpasswd
holds a salted MD5-crypt hash that Squid's `basic_ncsa_auth` verifies.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field

NCSA_AUTH_HELPER = "/usr/lib/squid/basic_ncsa_auth"
SQUID_USER = "proxy"


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
    ports, an empty password): config validation rejects those earlier, this
    is the last guard.
    """
    paths = paths or SquidPaths()
    if not settings.allowed_cidrs:
        raise ValueError("allowed_cidrs must not be empty")
    if not settings.allowed_connect_ports:
        raise ValueError("allowed_connect_ports must not be empty")
    if not settings.password or not settings.username or ":" in settings.username:
        raise ValueError("a username without ':' and a non-empty password are required")

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
        "",
        f"acl allowed_clients src {' '.join(_squid_cidr(c) for c in settings.allowed_cidrs)}",
        f"acl allowed_ports port {' '.join(str(p) for p in settings.allowed_connect_ports)}",
        "acl CONNECT method CONNECT",
        "acl authenticated proxy_auth REQUIRED",
        "",
        "http_access deny !allowed_clients",
        "http_access deny !CONNECT",
        "http_access deny CONNECT !allowed_ports",
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
    htpasswd = f"{settings.username}:{md5_crypt(settings.password)}\n"
    return RenderedSquid(squid_conf="\n".join(lines), htpasswd=htpasswd)


def _squid_cidr(cidr: str) -> str:
    # Squid rewrites 0.0.0.0/0 to `all`, which admits IPv6 clients as well;
    # its two halves admit exactly every IPv4 client.
    return "0.0.0.0/1 128.0.0.0/1" if cidr == "0.0.0.0/0" else cidr


def _listen_on(address: str | None, port: int) -> str:
    if address is None:
        return str(port)
    # IPv6 literals need brackets, or Squid reads the last group as the port.
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


_ITOA64 = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def md5_crypt(password: str, salt: str | None = None) -> str:
    """FreeBSD MD5-crypt (`$1$`), the salted hash `basic_ncsa_auth` understands.

    Written out here because Python's `crypt` module is deprecated and gone in
    3.13, and every Squid build verifies `$1$` through its own crypt_md5.
    """
    magic = b"$1$"
    pw = password.encode()
    salt_b = (salt or "".join(secrets.choice(_ITOA64) for _ in range(8))).encode()[:8]

    alternate = hashlib.md5(pw + salt_b + pw).digest()
    ctx = pw + magic + salt_b
    for remaining in range(len(pw), 0, -16):
        ctx += alternate[: min(16, remaining)]
    i = len(pw)
    while i:
        ctx += b"\x00" if i & 1 else pw[:1]
        i >>= 1
    final = hashlib.md5(ctx).digest()

    for rnd in range(1000):
        step = pw if rnd & 1 else final
        if rnd % 3:
            step += salt_b
        if rnd % 7:
            step += pw
        step += final if rnd & 1 else pw
        final = hashlib.md5(step).digest()

    def to64(value: int, count: int) -> str:
        out = ""
        for _ in range(count):
            out += _ITOA64[value & 0x3F]
            value >>= 6
        return out

    encoded = "".join(
        to64((final[a] << 16) | (final[b] << 8) | final[c], 4)
        for a, b, c in ((0, 6, 12), (1, 7, 13), (2, 8, 14), (3, 9, 15), (4, 10, 5))
    )
    encoded += to64(final[11], 2)
    return f"$1${salt_b.decode()}${encoded}"
