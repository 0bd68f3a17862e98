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
   `destination_exceptions` (address and port, asked for by that address)
   escape this rule and rule 3, and nothing else does;
5. without valid basic-auth credentials the answer is 407 (the gateway's
   Squid passes credentials on to its router, which checks them);
6. everything else is denied.

Nothing is cached. The password never appears in `squid.conf`; the htpasswd
holds a salted SHA-512-crypt hash that Squid's `basic_ncsa_auth` verifies.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

NCSA_AUTH_HELPER = "/usr/lib/squid/basic_ncsa_auth"
SQUID_USER = "proxy"

# How long a client connection may go without asking (`_client_limits`):
# its first byte, its whole request head, the next request on a kept connection.
REQUEST_START_TIMEOUT = "5 seconds"
REQUEST_TIMEOUT = "10 seconds"
CLIENT_IDLE_TIMEOUT = "10 seconds"

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
    # (IPv4 address, port) pairs rules 3 and 4 let through.
    destination_exceptions: tuple[tuple[str, int], ...] = ()


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
    log_format: str | None = None,
    routing: Sequence[str] = (),
    authenticate: bool = True,
    client_connections: int | None = None,
    password_setting: str | None = None,
) -> RenderedSquid:
    """Render `squid.conf` and the htpasswd for one proxy.

    The keyword arguments are for the gateway's Squid (`render_gateway_front`),
    which keeps every rule above and adds to them: `log_format` a logformat
    definition for the access log, `routing` the lines that send requests to
    parents. `authenticate=False` drops rule 5 for the gateway, which passes
    credentials on to its router that checks them; it is refused unless
    `routing` forbids going direct.
    `client_connections` caps the connections one client address holds at
    once (the gateway's front, where every client arrives); None, no cap.
    `password_setting` is the htpasswd hash's `$6$rounds=N$salt`, for a
    render that must be the same every time (EC2's user data); None draws
    a fresh salt.

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
    if not authenticate and NEVER_DIRECT not in routing:
        raise ValueError("only a Squid whose every request goes to a parent may skip auth")
    clients = " ".join(_squid_cidr(c) for c in settings.allowed_cidrs)

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
    auth = [
        "",
        f"auth_param basic program {NCSA_AUTH_HELPER} {paths.htpasswd}",
        "auth_param basic children 5 startup=1 idle=1",
        "auth_param basic realm proxy-operator",
        "auth_param basic credentialsttl 1 hour",
        # Squid lowercases usernames before its helper sees them unless told
        # not to: `Proxy` in the htpasswd would then never match.
        "auth_param basic casesensitive on",
    ]
    lines += [
        *(auth if authenticate else []),
        "",
        f"acl allowed_clients src {clients}",
        f"acl allowed_ports port {' '.join(str(p) for p in settings.allowed_connect_ports)}",
        "acl CONNECT method CONNECT",
    ]
    if authenticate:
        lines.append("acl authenticated proxy_auth REQUIRED")
    if settings.denied_destinations:
        # `dst` resolves a name and matches when any of its addresses is in
        # the list; the tunnel then connects to the addresses it checked.
        denied = " ".join(_squid_cidr(c) for c in settings.denied_destinations)
        lines.append(f"acl denied_destinations dst {denied}")
    lines += _exception_acls(settings.destination_exceptions)
    unless = " !destination_exceptions" if settings.destination_exceptions else ""
    lines += [
        "",
        "http_access deny !allowed_clients",
        "http_access deny !CONNECT",
        f"http_access deny CONNECT !allowed_ports{unless}",
    ]
    if settings.denied_destinations:
        # Before auth: no credentials, not even the right ones, open these.
        lines.append(f"http_access deny denied_destinations{unless}")
    allowed = ["allowed_ports", *(["destination_exceptions"] if unless else [])]
    lines += [
        *(
            f"http_access allow CONNECT {acl}{' authenticated' if authenticate else ''}"
            for acl in allowed
        ),
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
        *_client_limits(client_connections),
        "# Stop quickly: deletion and replacement should not wait on open tunnels.",
        "shutdown_lifetime 1 seconds",
        "",
        *routing,
    ]
    htpasswd = f"{settings.username}:{sha512_crypt(settings.password, password_setting)}\n"
    return RenderedSquid(squid_conf="\n".join(lines), htpasswd=htpasswd)


def _exception_acls(exceptions: Sequence[tuple[str, int]]) -> list[str]:
    """The `destination_exceptions` ACL: any of the pairs, each its address and its port.

    The address is matched as the CONNECT writes its host (`dstdomain -n`:
    no lookup; Squid reads `[::ffff:a.b.c.d]` as a.b.c.d), so only that
    address is reached; a name resolving to it is still a denied destination.
    """
    lines, pairs = [], []
    for n, (address, port) in enumerate(exceptions):
        lines += [
            f"acl destination_exception_{n}_host dstdomain -n {address}",
            f"acl destination_exception_{n}_port port {port}",
            f"acl destination_exception_{n} all-of "
            f"destination_exception_{n}_host destination_exception_{n}_port",
        ]
        pairs.append(f"destination_exception_{n}")
    if pairs:
        lines.append(f"acl destination_exceptions any-of {' '.join(pairs)}")
    return lines


def _client_limits(client_connections: int | None) -> list[str]:
    """How long a client may take to ask, and how many connections one address may hold.

    A connection that has not sent a whole request head within
    REQUEST_TIMEOUT (its first byte within REQUEST_START_TIMEOUT) is cut,
    as is one left idle between requests for CLIENT_IDLE_TIMEOUT: a client
    without credentials costs a socket for seconds, not Squid's default
    minutes. Open tunnels are not requests waiting and are never cut.
    """
    lines = [
        "# A client that does not ask is cut within seconds, whoever it is.",
        f"request_start_timeout {REQUEST_START_TIMEOUT}",
        f"request_timeout {REQUEST_TIMEOUT}",
        f"client_idle_pconn_timeout {CLIENT_IDLE_TIMEOUT}",
    ]
    if client_connections is None:
        return [
            *lines,
            "# No per-client-address statistics (cachemgr's client_list): nothing reads",
            "# them, and keeping them is about a tenth of a gateway Squid's CPU per CONNECT.",
            "client_db off",
        ]
    # Squid drops a connection when the address already holds *more* than the
    # limit (TcpAcceptor), so it is set one below the connections allowed.
    return [
        *lines,
        f"# One client address holds at most {client_connections} connections (client_db",
        "# counts them).",
        "client_db on",
        f"client_ip_max_connections {client_connections - 1}",
    ]


# ---- the gateway (docs/architecture.md, "The gateway") ---------------------------

# What the gateway's workers write per request: what its metrics, and which
# member carried each session (gateway/sessions.py), are read from.
GATEWAY_LOG_FORMAT = "gateway"
_GATEWAY_LOG_FIELDS = "%ts.%03tu %tr %>Hs %Ss/%Sh %<A %<a %<p %rm %ru %un"
# A member the router fails to connect to this many times in a row is skipped
# until its probe (a TCP connect a second) sees it answer again; a connect
# that hangs gives up after MEMBER_CONNECT_TIMEOUT seconds and the request
# goes to the next member (gateway/router.py).
MEMBER_CONNECT_FAIL_LIMIT = 10
MEMBER_CONNECT_TIMEOUT = 3
# The gateway's Squid never marks its router dead: it relays members' and
# origins' errors, which Squid would count against it.
ROUTER_CONNECT_FAIL_LIMIT = 1_000_000
# Section 15 (neighbors) at level 2 logs each probe of a peer that answers
# ("TCP connection to <peer> succeeded") or not ("... dead"): the gateway
# waits at start for its Squid's probe of the router.
GATEWAY_DEBUG = "debug_options ALL,1 15,2"
# Every request of the gateway's Squid goes to its router, never to the origin.
NEVER_DIRECT = "never_direct allow all"
# A username no member admits (its filters match none, or it pins one not in
# the pool) is answered this, with this page, by the router: never sent elsewhere.
NO_MEMBER_STATUS = 503
NO_MEMBER_TEMPLATE = "ERR_GATEWAY_NO_MEMBER"
NO_MEMBER_PAGE = (
    "No member of the pool matches this username: its routing filters "
    "(-zone-, -region-, -provider-) match none of the members in rotation, or "
    "the member it pins (-proxy-) is not one of them. The request was sent "
    "nowhere else.\n"
)

# A users-file user with `tunnels=N` (gateway/users.py) holds at most N open
# tunnels, counted by the router; past that, a CONNECT is answered
# TUNNEL_LIMIT_STATUS, named TUNNEL_LIMIT_TEMPLATE in its X-Squid-Error.
TUNNEL_LIMIT_STATUS = 429
TUNNEL_LIMIT_TEMPLATE = "ERR_GATEWAY_TUNNEL_LIMIT"
TUNNEL_LIMIT_PAGE = (
    "This user already holds as many open tunnels as its limit allows (%o). "
    "The request was sent nowhere. Close a tunnel, or ask for a higher tunnels= "
    "in the gateway's users file.\n"
)
# The refusal's reason, in a header: Squid relays a parent's refusal's
# status and headers to the client, not its page.
TUNNEL_REFUSED_HEADER = "X-Gateway-Refused"


class Route(StrEnum):
    """How a username picks a member (gateway/routing.py); it names the member in logs."""

    ROTATE = "rotate"  # USER: round-robin per CONNECT
    SESSION = "session"  # USER-session-<key>: Squid's userhash, a consistent hash
    PIN = "pin"  # USER-proxy-<member>: that member only


@dataclass(frozen=True)
class GatewayMember:
    """A pool member the gateway forwards to: its workflow id, where it listens, and what
    a username's routing filters match it by (None: it has no such attribute)."""

    member: str
    host: str
    port: int
    zone: str | None = None
    region: str | None = None
    provider: str | None = None
    # Where its traffic leaves from, as the pool confirmed it (metrics only).
    exit_address: str | None = None

    def attribute(self, name: str) -> str | None:
        """Its value for routing filter `name` (one of FILTERS)."""
        value: str | None = getattr(self, name)
        return value

    def matches(self, filters: dict[str, str]) -> bool:
        """Whether every one of a username's routing filters names this member's value."""
        return all(self.attribute(name) == value for name, value in filters.items())


def peer_name(member: str, route: Route) -> str:
    """The name the router's access log gives `member` for `route`.

    A function of the member id alone, so every gateway of a pool, across
    membership changes and the member's own rotations, hashes a session key
    to the same member: sessions hash this name (gateway/routing.py).
    """
    return f"{route}-{hashlib.sha256(member.encode()).hexdigest()[:16]}"


def _format_name(definition: str | None) -> str:
    return definition.split()[1] if definition else "squid"


def render_gateway_front(
    settings: ProxySettings,
    paths: SquidPaths,
    router_port: int,
    client_connections: int | None = None,
) -> RenderedSquid:
    """The gateway's Squid, which clients talk to: the proxies' rules, then the router.

    It does not check credentials: every request goes to the router
    (`never_direct`) with the client's credentials passed on
    (`login=PASSTHRU`), and the router checks them, since it routes by them;
    a client without the password gets its 407. The router is never counted
    dead (it relays members' and origins' errors, which Squid would count
    against it). Every client arrives here, so `client_connections`
    (connections one address may hold) is set here alone.
    """
    lines = [
        "# The router: it checks credentials and picks the member (gateway/router.py).",
        GATEWAY_DEBUG,
        NEVER_DIRECT,
        f"cache_peer 127.0.0.1 parent {router_port} 0 no-query no-digest no-netdb-exchange "
        f"name=router login=PASSTHRU connect-fail-limit={ROUTER_CONNECT_FAIL_LIMIT} "
        "connect-timeout=2",
    ]
    return render(
        settings,
        paths,
        log_format=f"logformat {GATEWAY_LOG_FORMAT} {_GATEWAY_LOG_FIELDS}",
        routing=[*lines, ""],
        authenticate=False,
        client_connections=client_connections,
    )


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
