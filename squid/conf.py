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
holds a salted SHA-512-crypt hash (squid/htpasswd.py) that Squid's
`basic_ncsa_auth` verifies.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

from squid.gateway import GATEWAY_LOG_FIELDS, GATEWAY_LOG_FORMAT
from squid.htpasswd import sha512_crypt

NCSA_AUTH_HELPER = "/usr/lib/squid/basic_ncsa_auth"
SQUID_USER = "proxy"
# Every request of the gateway's Squid goes to its router, never to the origin.
NEVER_DIRECT = "never_direct allow all"

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


def _format_name(definition: str | None) -> str:
    return definition.split()[1] if definition else "squid"


# ---- the gateway's Squid (docs/architecture.md, "The gateway") ----------------

# The gateway's Squid never marks its router dead: it relays members' and
# origins' errors, which Squid would count against it.
ROUTER_CONNECT_FAIL_LIMIT = 1_000_000
# Section 15 (neighbors) at level 2 logs each probe of a peer that answers
# ("TCP connection to <peer> succeeded") or not ("... dead"): the gateway
# waits at start for its Squid's probe of the router.
GATEWAY_DEBUG = "debug_options ALL,1 15,2"


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
        log_format=f"logformat {GATEWAY_LOG_FORMAT} {GATEWAY_LOG_FIELDS}",
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
