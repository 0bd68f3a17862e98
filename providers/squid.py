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
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from urllib.parse import quote

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


def render(
    settings: ProxySettings,
    paths: SquidPaths | None = None,
    *,
    auth_wrapper: Sequence[str] = (),
    log_format: str | None = None,
    routing: Sequence[str] = (),
) -> RenderedSquid:
    """Render `squid.conf` and the htpasswd for one proxy.

    The keyword arguments are for the gateway's Squids (`render_gateway_front`,
    `render_gateway_back`), which keep every rule above and add to them:
    `auth_wrapper` is a helper command `basic_ncsa_auth` runs under,
    `log_format` a logformat definition for the access log, `routing` the
    lines that send requests to parents.

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
        *([log_format] if log_format else []),
        f"access_log {paths.access_log} logformat={_format_name(log_format)} has_request",
        f"cache_log {paths.cache_log}",
        f"coredump_dir {paths.coredump_dir}",
    ]
    if paths.effective_user:
        lines.append(f"cache_effective_user {paths.effective_user}")
    lines += [
        "",
        f"auth_param basic program {' '.join([*auth_wrapper, NCSA_AUTH_HELPER, paths.htpasswd])}",
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
        *routing,
    ]
    htpasswd = f"{settings.username}:{md5_crypt(settings.password)}\n"
    return RenderedSquid(squid_conf="\n".join(lines), htpasswd=htpasswd)


# ---- the gateway (docs/architecture.md, "The gateway") ---------------------------

# What the gateway's Squids write per request: what its metrics are read from.
GATEWAY_LOG_FORMAT = "gateway"
_GATEWAY_LOG_FIELDS = "%ts.%03tu %tr %>Hs %Ss/%Sh %<A %<a %<p %rm %ru"
# A member id that can be written into squid.conf and typed as a username.
PINNABLE_MEMBER = re.compile(r"^[A-Za-z0-9._~/:@+=-]{1,200}$")
# A session key: anything a client can put in a username without escaping.
SESSION_KEY = re.compile(r"^[A-Za-z0-9._~+=-]{1,128}$")
SESSION_INFIX = "-session-"
PIN_INFIX = "-proxy-"
# A member that fails this many times in a row is skipped until Squid's own
# probe (a TCP connect, at most once a second) sees it answer again; a
# connect that hangs gives up after MEMBER_CONNECT_TIMEOUT seconds and the
# request goes to the next member. Squid 5 counts every non-200 answer to a
# CONNECT as a failure of that parent, an unreachable origin's 503 included,
# so the limit is not 1.
MEMBER_CONNECT_FAIL_LIMIT = 10
MEMBER_CONNECT_TIMEOUT = 3
# The front never marks a back dead: a back relays members' and origins'
# errors, which Squid would count against it, and a back that is reloading
# refuses at once, so the front simply tries the other one.
BACK_CONNECT_FAIL_LIMIT = 1_000_000
# Members (or back Squids) one request may be tried on before it fails.
FORWARD_MAX_TRIES = 10


class Route(StrEnum):
    """How a username picks a member; each member is one cache_peer per route."""

    ROTATE = "rotate"  # USER: round-robin per CONNECT
    SESSION = "session"  # USER-session-<key>: Squid's userhash, a consistent hash
    PIN = "pin"  # USER-proxy-<member>: that member only


@dataclass(frozen=True)
class GatewayMember:
    """A pool member the gateway forwards to: its workflow id and where it listens."""

    member: str
    host: str
    port: int


def peer_name(member: str, route: Route) -> str:
    """The cache_peer name of `member` for `route`.

    A function of the member id alone, so every gateway of a pool, before and
    after a reload, and across the member's own rotations, hashes a session
    key to the same member: Squid's userhash hashes peer names.
    """
    return f"{route}-{hashlib.sha256(member.encode()).hexdigest()[:16]}"


def gateway_account(username: str, user: str) -> str | None:
    """The account a gateway username authenticates as, or None if it is not one of its forms.

    `user` itself, `user-session-<key>` and `user-proxy-<member>` all check
    `user`'s password; the suffix only chooses the member.
    """
    if username == user:
        return user
    rest = username.removeprefix(user)
    if rest == username:
        return None
    if rest.startswith(SESSION_INFIX) and SESSION_KEY.fullmatch(rest[len(SESSION_INFIX) :]):
        return user
    if rest.startswith(PIN_INFIX) and PINNABLE_MEMBER.fullmatch(rest[len(PIN_INFIX) :]):
        return user
    return None


def _gateway_log_format() -> str:
    return f"logformat {GATEWAY_LOG_FORMAT} {_GATEWAY_LOG_FIELDS}"


def _format_name(definition: str | None) -> str:
    return definition.split()[1] if definition else "squid"


def _login(settings: ProxySettings) -> str:
    # Squid %-unescapes login= once at parse time; escaping every byte but
    # letters and digits keeps spaces, `#` and quotes out of the config syntax.
    return f"{quote(settings.username, safe='')}:{quote(settings.password, safe='')}"


def render_gateway_back(
    settings: ProxySettings,
    paths: SquidPaths,
    members: Sequence[GatewayMember],
    auth_wrapper: Sequence[str],
) -> RenderedSquid:
    """The Squid that routes by username to the pool's members.

    Only the front Squid reaches it (it listens on loopback and admits
    loopback clients only); it applies the proxies' own rules again, then
    sends every request to a member (`never_direct`), logging in
    GATEWAY_LOG_FORMAT. Each member is declared once per `Route`, and
    `cache_peer_access` on the username decides which declarations a request
    may use. When the chosen member fails to connect, Squid retries the other
    members the same route allows, so a dead member costs a client nothing
    but a retry; a pinned request has only its member.
    """
    user = settings.username
    session_pattern = "^" + user.replace(".", "\\.") + SESSION_INFIX
    lines = [
        "# The pool's members, one cache_peer per member and route. A member that",
        "# cannot be connected to is retried on the next; its error answers (an",
        "# origin that is down) are the client's to see, not retried.",
        "never_direct allow all",
        f"forward_max_tries {FORWARD_MAX_TRIES}",
        f"acl gateway_{Route.ROTATE} proxy_auth {user}",
        f"acl gateway_{Route.SESSION} proxy_auth_regex {session_pattern}",
    ]
    common = (
        f"no-query no-digest no-netdb-exchange login={_login(settings)} "
        f"connect-fail-limit={MEMBER_CONNECT_FAIL_LIMIT} connect-timeout={MEMBER_CONNECT_TIMEOUT}"
    )
    options = {Route.ROTATE: "round-robin", Route.SESSION: "userhash", Route.PIN: ""}
    for m in sorted(members, key=lambda m: m.member):
        for route in Route:
            if route is Route.PIN and not PINNABLE_MEMBER.fullmatch(m.member):
                continue  # cannot be named in a username; rotation and sessions still reach it
            name = peer_name(m.member, route)
            acl = f"gateway_{route}"
            if route is Route.PIN:
                acl = f"gateway_{name}"
                lines.append(f"acl {acl} proxy_auth {user}{PIN_INFIX}{m.member}")
            lines += [
                f"cache_peer {m.host} parent {m.port} 0 {options[route]} name={name} {common}",
                f"cache_peer_access {name} allow {acl}",
                f"cache_peer_access {name} deny all",
            ]
    loopback = replace(settings, allowed_cidrs=("127.0.0.1/32",))
    return render(
        loopback,
        paths,
        auth_wrapper=auth_wrapper,
        log_format=_gateway_log_format(),
        routing=[*lines, ""],
    )


def render_gateway_front(
    settings: ProxySettings,
    paths: SquidPaths,
    back_ports: Sequence[int],
    auth_wrapper: Sequence[str],
) -> RenderedSquid:
    """The Squid clients talk to: the proxies' rules, then one of the back Squids.

    Its config never changes while it runs, so its listening socket never
    closes: membership changes reload the back Squids one at a time (a
    reload closes a Squid's listener for a moment), and a CONNECT that finds
    one back reloading is retried on the other. Credentials are passed on
    (`login=PASSTHRU`) because the back routes by username.
    """
    if len(back_ports) < 2:
        raise ValueError("the front needs two back Squids, so one serves while the other reloads")
    lines = [
        "# The back Squids: they route to the members, and reload in turn.",
        "never_direct allow all",
        f"forward_max_tries {FORWARD_MAX_TRIES}",
    ]
    for i, port in enumerate(back_ports):
        lines.append(
            f"cache_peer 127.0.0.1 parent {port} 0 round-robin name=back-{i} "
            "no-query no-digest no-netdb-exchange login=PASSTHRU "
            f"connect-fail-limit={BACK_CONNECT_FAIL_LIMIT} connect-timeout=2"
        )
    return render(
        settings,
        paths,
        auth_wrapper=auth_wrapper,
        log_format=_gateway_log_format(),
        routing=[*lines, ""],
    )


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
