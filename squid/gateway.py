"""The gateway's Squid and what its router agrees with it on (docs/architecture.md, "The gateway").

Clients talk to the gateway's Squid (squid/conf.py, `render_gateway_front`),
which sends every request to the router on loopback; the router picks a
pool member by username (gateway/router.py). Both, and the gateway's
metrics, read the names here: the access log's format, the peer names
members go by, the limits on connecting to a member, and the pages the
router refuses with. The router runs from a copy of its sources as
Squid's user, so this module imports the standard library alone.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from enum import StrEnum

# The realm a 407 of the router's, or of a wake holder's, asks for credentials in.
REALM = "proxy-operator"
# What the gateway's workers write per request: what its metrics, and which
# member carried each session (gateway/sessions.py), are read from.
GATEWAY_LOG_FORMAT = "gateway"
GATEWAY_LOG_FIELDS = "%ts.%03tu %tr %>Hs %Ss/%Sh %<A %<a %<p %rm %ru %un"
# The kind (the fourth field) of the router's line for a session's tunnel a member
# granted, written before the client sees the 200: a ban by session names the
# member that carried it at once, not only once the tunnel closes. Not a request.
TUNNEL_OPENED = "TCP_TUNNEL_OPENED/FIRSTUP_PARENT"
# A member the router fails to connect to this many times in a row is skipped
# until its probe (a TCP connect a second) sees it answer again; a connect
# that hangs gives up after MEMBER_CONNECT_TIMEOUT seconds and the request
# goes to the next member (gateway/router.py).
MEMBER_CONNECT_FAIL_LIMIT = 10
MEMBER_CONNECT_TIMEOUT = 3
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
# The router's answer to a membership change it did not apply (made from other
# members than it has, or unreadable): the gateway then sends the members whole.
ROUTER_RESYNC = "resync"


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
        """Its value for routing filter `name` (one of proxy_operator.username.FILTERS)."""
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


def fleet_login(user: str, password: str) -> str:
    """The Proxy-Authorization value of the fleet's credentials.

    What the router sends every member a CONNECT with, and so the only one a
    pool's wake holder (gateway/wake.py), a stand-in member on loopback,
    takes: both build it here, so they cannot disagree.
    """
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
