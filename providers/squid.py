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
   front passes credentials on to back workers, which check them);
6. everything else is denied.

Nothing is cached. The password never appears in `squid.conf`; the htpasswd
holds a salted SHA-512-crypt hash that Squid's `basic_ncsa_auth` verifies.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from urllib.parse import quote

NCSA_AUTH_HELPER = "/usr/lib/squid/basic_ncsa_auth"
SQUID_USER = "proxy"
# The proxies' username (`proxy.auth.username`): what gateway usernames start with.
PROXY_USERNAME = r"^[A-Za-z0-9._-]{1,64}$"

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
    auth_wrapper: Sequence[str] = (),
    log_format: str | None = None,
    routing: Sequence[str] = (),
    authenticate: bool = True,
    access: Sequence[str] = (),
    credentials_ttl: str = "1 hour",
    client_connections: int | None = None,
    password_setting: str | None = None,
) -> RenderedSquid:
    """Render `squid.conf` and the htpasswd for one proxy.

    The keyword arguments are for the gateway's workers (`render_gateway_front`,
    `render_gateway_back`), which keep every rule above and add to them:
    `auth_wrapper` is a helper command `basic_ncsa_auth` runs under,
    `log_format` a logformat definition for the access log, `routing` the
    lines that send requests to parents, `access` lines that deny more just
    before rule 5 allows, `credentials_ttl` how long Squid trusts a checked
    username and password before it asks its helper again. `authenticate=False` drops rule 5
    for the gateway's front, which passes credentials on to back workers
    that check them; it is refused unless `routing` forbids going direct.
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
        f"auth_param basic program {' '.join([*auth_wrapper, NCSA_AUTH_HELPER, paths.htpasswd])}",
        "auth_param basic children 5 startup=1 idle=1",
        "auth_param basic realm proxy-operator",
        f"auth_param basic credentialsttl {credentials_ttl}",
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
        *access,
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
# A member id that can be written into squid.conf and typed as a username.
PINNABLE_MEMBER = re.compile(r"^[A-Za-z0-9._~/:@+=-]{1,200}$")
# A session key: anything a client can put in a username without escaping.
SESSION_KEY = re.compile(r"^[A-Za-z0-9._~+=-]{1,128}$")
SESSION_INFIX = "-session-"
PIN_INFIX = "-proxy-"
# Routing filters a username may carry before its session or pin, in this
# order, each at most once: `USER-zone-<zone>-region-<region>-provider-<name>`.
FILTERS = ("zone", "region", "provider")
# A filter's value: dash-separated words, none of them a keyword of the grammar
# followed by a dash (so `-session-` always starts the session key).
_WORD = r"[A-Za-z0-9._~+=]+"
_KEYWORDS = "|".join([*FILTERS, "session", "proxy"])
_VALUE = rf"{_WORD}(?:-(?!(?:{_KEYWORDS})-){_WORD})*"
FILTER_VALUE = re.compile(rf"^(?=.{{1,64}}$){_VALUE}$")
_SUFFIX = re.compile(
    "".join(rf"(?:-{name}-(?P<{name}>{_VALUE}))?" for name in FILTERS)
    + rf"(?:{SESSION_INFIX}(?P<session>.+)|{PIN_INFIX}(?P<pin>.+))?"
)
# A member that fails this many times in a row is skipped until Squid's own
# probe (a TCP connect, at most once a second) sees it answer again; a
# connect that hangs gives up after MEMBER_CONNECT_TIMEOUT seconds and the
# request goes to the next member. Squid 5 counts every non-200 answer to a
# CONNECT as a failure of that parent, an unreachable origin's 503 included,
# so the limit is not 1.
MEMBER_CONNECT_FAIL_LIMIT = 10
MEMBER_CONNECT_TIMEOUT = 3
# The front never marks the backs dead: they relay members' and origins'
# errors, which Squid would count against them.
BACK_CONNECT_FAIL_LIMIT = 1_000_000
# Section 15 (neighbors) at level 2 logs each probe of a peer that answers
# ("TCP connection to <peer> succeeded") or not ("... dead"): the gateway
# waits on those lines.
GATEWAY_DEBUG = "debug_options ALL,1 15,2"
# Every request of a gateway worker goes to a parent, never to the origin.
NEVER_DIRECT = "never_direct allow all"
# Members (or back workers) one request may be tried on before it fails.
FORWARD_MAX_TRIES = 10
# A username no member admits (its filters match none, or it pins one not in
# the pool) is answered this, with this page, by the backs: never sent elsewhere.
ROUTABLE = "gateway_routable"
UNROUTABLE = "gateway_unroutable"
NO_MEMBER_STATUS = 503
NO_MEMBER_TEMPLATE = "ERR_GATEWAY_NO_MEMBER"
NO_MEMBER_PAGE = (
    "No member of the pool matches this username: its routing filters "
    "(-zone-, -region-, -provider-) match none of the members in rotation, or "
    "the member it pins (-proxy-) is not one of them. The request was sent "
    "nowhere else.\n"
)

# A users-file user with `tunnels=N` (gateway/users.py): the auth helper
# annotates its requests with TUNNEL_LIMIT_NOTE, and for those alone the backs
# ask the tunnel helper (gateway/tunnel_helper.py) at each CONNECT; at the
# limit, the CONNECT is answered TUNNEL_LIMIT_STATUS with TUNNEL_LIMIT_TEMPLATE.
TUNNEL_LIMIT_NOTE = "gateway_tunnel_limit"
TUNNEL_LIMIT_STATUS = 429
TUNNEL_LIMIT_TEMPLATE = "ERR_GATEWAY_TUNNEL_LIMIT"
TUNNEL_LIMIT_PAGE = (
    "This user already holds as many open tunnels as its limit allows (%o). "
    "The request was sent nowhere. Close a tunnel, or ask for a higher tunnels= "
    "in the gateway's users file.\n"
)
# The helper's reason for a refusal, which the backs put in this header (the
# front relays a refusal's status and headers, not its page).
TUNNEL_REFUSED_NOTE = "gateway_refused"
TUNNEL_REFUSED_HEADER = "X-Gateway-Refused"
# The helper's input: the username, the client's (the front's) end of the
# connection and the back's; asked at every CONNECT (no cached answers).
TUNNEL_HELPER_FORMAT = "%ul %>a %>p %>la %>lp"
# A burst of CONNECTs waits in a long queue: past queue-size, "the acl is
# ignored" (squid.conf.documented, external_acl_type), not what a limit wants.
TUNNEL_HELPER_OPTIONS = (
    "ttl=0 negative_ttl=0 children-max=5 children-startup=1 children-idle=1 queue-size=1024"
)


class Route(StrEnum):
    """How a username picks a member; each member is one cache_peer per route."""

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
    """The cache_peer name of `member` for `route`.

    A function of the member id alone, so every gateway of a pool, before and
    after a reload, and across the member's own rotations, hashes a session
    key to the same member: Squid's userhash hashes peer names.
    """
    return f"{route}-{hashlib.sha256(member.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class GatewayUsername:
    """A gateway username taken apart: the account, its routing filters, session or pin."""

    account: str
    filters: dict[str, str]
    session: str | None = None
    pin: str | None = None


def parse_gateway_username(username: str, user: str) -> GatewayUsername | None:
    """`username` as one of the gateway's forms for account `user`, or None if it is none.

        USER[-zone-<zone>][-region-<region>][-provider-<name>][-session-<key> | -proxy-<member>]

    Filters come in that order, each at most once, each 1 to 64 characters
    of dash-separated words (no word a keyword of the grammar followed by a
    dash); a session key is 1 to 128 of A-Z a-z 0-9 . _ ~ + = - and a member
    id 1 to 200 of those and / : @.
    """
    if not username.startswith(user):
        return None
    match = _SUFFIX.fullmatch(username[len(user) :])
    if match is None:
        return None
    filters = {name: match[name] for name in FILTERS if match[name] is not None}
    if any(not FILTER_VALUE.fullmatch(value) for value in filters.values()):
        return None
    session, pin = match["session"], match["pin"]
    if session is not None and not SESSION_KEY.fullmatch(session):
        return None
    if pin is not None and not PINNABLE_MEMBER.fullmatch(pin):
        return None
    return GatewayUsername(user, filters, session, pin)


def gateway_account(username: str, user: str) -> str | None:
    """The account a gateway username authenticates as, or None if it is not one of its forms.

    Every form (`parse_gateway_username`) checks `user`'s password; the suffix
    only chooses the member.
    """
    parsed = parse_gateway_username(username, user)
    return parsed.account if parsed is not None else None


def _ere(text: str) -> str:
    """`text` as a POSIX extended regular expression matching it literally.

    Usernames, member ids and filter values are checked to letters, digits
    and `. _ ~ + = - / : @` before they reach a config; `.` and `+` are the
    special ones among those, the rest are escaped for safety.
    """
    return re.sub(r"([.+*?^$()\[\]{}|\\])", r"\\\1", text)


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
    error_directory: str,
    credentials_ttl: str = "1 hour",
    tunnel_helper: Sequence[str] = (),
) -> RenderedSquid:
    """The back workers' config: they route by username to the pool's members.

    Only the front worker reaches them (they listen on loopback and admit
    loopback clients only); they apply the proxies' own rules again, then
    send every request to a member (`never_direct`), logging in
    GATEWAY_LOG_FORMAT. Each member is declared once per `Route`, and
    `cache_peer_access` on the username decides which declarations a request
    may use. When the chosen member fails to connect, Squid retries the other
    members the same route allows, so a dead member costs a client nothing
    but a retry; a pinned request has only its member.

    Each declaration's ACL is a regular expression over the whole username
    that admits the member's own routing filter values only
    (`^USER(-zone-Z)?(-region-R)?(-provider-P)?<route>$`): a username whose
    filters another member's values would need never reaches this one, so a
    filter nothing matches finds no member, never a fallback: such a username
    (or a pin of a member not in the pool) is answered NO_MEMBER_STATUS with
    the error page NO_MEMBER_TEMPLATE, which `error_directory` holds next to
    copies of Squid's own templates. The front relays the status and Squid's
    `X-Squid-Error: 503:ERR_GATEWAY_NO_MEMBER 0` header, not the page.

    With a `tunnel_helper` command, a CONNECT annotated TUNNEL_LIMIT_NOTE by
    the auth helper is admitted only if that helper finds its user a slot.
    """
    # The fleet's user, or a users-file user (gateway/users.py: no dash in the
    # name); which account, and its password, the auth helper checked.
    user = f"({_ere(settings.username)}|[A-Za-z0-9._]+)"
    # Every username some member admits; the rest are answered NO_MEMBER_STATUS.
    access = [f"acl {UNROUTABLE} src 127.0.0.1/32"]  # always true: the backs admit no other
    lines = [
        "# The pool's members, one cache_peer per member and route. A member that",
        "# cannot be connected to is retried on the next; its error answers (an",
        "# origin that is down) are the client's to see, not retried.",
        GATEWAY_DEBUG,
        NEVER_DIRECT,
        f"forward_max_tries {FORWARD_MAX_TRIES}",
    ]
    common = (
        f"no-query no-digest no-netdb-exchange login={_login(settings)} "
        f"connect-fail-limit={MEMBER_CONNECT_FAIL_LIMIT} connect-timeout={MEMBER_CONNECT_TIMEOUT}"
    )
    options = {Route.ROTATE: "round-robin", Route.SESSION: "userhash", Route.PIN: ""}
    for m in sorted(members, key=lambda m: m.member):
        filters = "".join(
            f"(-{name}-{_ere(value)})?"
            for name in FILTERS
            if (value := m.attribute(name)) is not None and FILTER_VALUE.fullmatch(value)
        )
        routes = {
            Route.ROTATE: "$",
            Route.SESSION: SESSION_INFIX,
            Route.PIN: f"{PIN_INFIX}{_ere(m.member)}$",
        }
        for route in Route:
            if route is Route.PIN and not PINNABLE_MEMBER.fullmatch(m.member):
                continue  # cannot be named in a username; rotation and sessions still reach it
            name = peer_name(m.member, route)
            acl = f"gateway_{name}"
            pattern = f"^{user}{filters}{routes[route]}"
            access.append(f"acl {ROUTABLE} proxy_auth_regex {pattern}")
            lines += [
                f"acl {acl} proxy_auth_regex {pattern}",
                f"cache_peer {m.host} parent {m.port} 0 {options[route]} name={name} {common}",
                f"cache_peer_access {name} allow {acl}",
                f"cache_peer_access {name} deny all",
            ]
    # No member: no username is routable (and ROUTABLE, never defined, cannot be named).
    routable = f"!{ROUTABLE} " if len(access) > 1 else ""
    access += [
        f"http_access deny CONNECT {routable}{UNROUTABLE}",
        f"error_directory {error_directory}",
        f"deny_info {NO_MEMBER_STATUS}:{NO_MEMBER_TEMPLATE} {UNROUTABLE}",
    ]
    if tunnel_helper:
        access += [
            f"external_acl_type gateway_tunnels {TUNNEL_HELPER_OPTIONS} {TUNNEL_HELPER_FORMAT} "
            + " ".join(tunnel_helper),
            f"acl gateway_tunnel_limited note {TUNNEL_LIMIT_NOTE}",
            "acl gateway_tunnel_slot external gateway_tunnels",
            # The note comes with the credentials: `authenticated` checks them first.
            "http_access deny CONNECT authenticated gateway_tunnel_limited !gateway_tunnel_slot",
            f"deny_info {TUNNEL_LIMIT_STATUS}:{TUNNEL_LIMIT_TEMPLATE} gateway_tunnel_slot",
            # The front relays a back's refusal's status and headers, not its page:
            # the helper's reason goes in a header too (raw: it is the helper's words).
            f"acl gateway_tunnel_refused note {TUNNEL_REFUSED_NOTE}",
            f'reply_header_add {TUNNEL_REFUSED_HEADER} "%\'{{{TUNNEL_REFUSED_NOTE}}}note" '
            "gateway_tunnel_refused",
        ]
    loopback = replace(settings, allowed_cidrs=("127.0.0.1/32",))
    return _render_gateway_squid(
        loopback, paths, lines, auth_wrapper, access=access, credentials_ttl=credentials_ttl
    )


def render_gateway_front(
    settings: ProxySettings,
    paths: SquidPaths,
    back_ports: Sequence[int],
    client_connections: int | None = None,
) -> RenderedSquid:
    """The worker clients talk to: the proxies' rules, then one of the back workers.

    It does not check credentials: every request goes to a back worker
    (`never_direct`), with the credentials passed on (`login=PASSTHRU`),
    and the backs check them, since they route by username; a client
    without the password gets their 407.

    Its config never changes while it runs: membership changes reload the
    back workers one at a time, and a CONNECT a back fails while its new
    peers are being probed is tried again on the other back. Every client
    arrives here, so `client_connections` (connections one address may hold)
    is set here alone: the backs' and the members' one client is the gateway.
    """
    if len(back_ports) < 2:
        raise ValueError("the front needs two back workers, so one serves while the other reloads")
    lines = [
        "# The back workers: they route to the members, and reload in turn.",
        GATEWAY_DEBUG,
        NEVER_DIRECT,
        f"forward_max_tries {FORWARD_MAX_TRIES}",
    ]
    for i, port in enumerate(back_ports):
        lines.append(
            f"cache_peer 127.0.0.1 parent {port} 0 round-robin name=back-{i} "
            "no-query no-digest no-netdb-exchange login=PASSTHRU "
            f"connect-fail-limit={BACK_CONNECT_FAIL_LIMIT} connect-timeout=2"
        )
    return _render_gateway_squid(
        settings, paths, lines, authenticate=False, client_connections=client_connections
    )


def _render_gateway_squid(
    settings: ProxySettings,
    paths: SquidPaths,
    routing: list[str],
    auth_wrapper: Sequence[str] = (),
    authenticate: bool = True,
    access: Sequence[str] = (),
    credentials_ttl: str = "1 hour",
    client_connections: int | None = None,
) -> RenderedSquid:
    """A gateway worker's config: the proxies' rules, GATEWAY_LOG_FORMAT, then `routing`."""
    return render(
        settings,
        paths,
        auth_wrapper=auth_wrapper,
        log_format=f"logformat {GATEWAY_LOG_FORMAT} {_GATEWAY_LOG_FIELDS}",
        routing=[*routing, ""],
        authenticate=authenticate,
        access=access,
        credentials_ttl=credentials_ttl,
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
