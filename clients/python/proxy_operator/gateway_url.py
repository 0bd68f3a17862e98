"""Gateway proxy URLs: the username that routes a request, built and checked before it is sent.

The gateway routes by username (docs/operations.md, "Usernames"): `USER`
rotates, `USER-session-<key>` keeps one member per key, `USER-proxy-<member>`
pins one member, and routing filters before either (`-zone-<zone>`,
`-region-<region>`, `-provider-<name>`) keep to the members that match them.
The gateway answers any username it cannot parse with a
bare 407, which says nothing of what was wrong; built here, a bad field is
named before the first request. The grammar's pieces (username.py) are the
ones the gateway's router parses with, so client and gateway cannot drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypedDict, Unpack
from urllib.parse import quote, urlsplit

from proxy_operator.username import (
    FILTER_VALUE,
    FILTERS,
    PIN_INFIX,
    PINNABLE_MEMBER,
    PROXY_USERNAME,
    SESSION_INFIX,
    SESSION_KEY,
)

ACCOUNT = re.compile(PROXY_USERNAME)
GATEWAY_SCHEME = "http"


class InvalidProxySetting(ValueError):
    """A proxy URL part that the gateway would refuse; the message names the part."""


class Routing(TypedDict, total=False):
    """How a username routes: a session or a pin, after any of the filters (None: not given)."""

    session: str | None
    member: str | None
    zone: str | None
    region: str | None
    provider: str | None


ROUTING_FIELDS = frozenset(Routing.__annotations__)


@dataclass(frozen=True)
class GatewayProxy:
    """Where a client sends its requests and how it logs in: the parts Playwright wants apart.

    `__repr__` leaves the password out, so logging this object leaks nothing.
    """

    server: str  # http://host:port, no credentials
    username: str
    password: str

    def url(self) -> str:
        """`http://username:password@host:port`, both %-encoded (a member id's `/` is `%2F`)."""
        parts = urlsplit(self.server)
        userinfo = f"{quote(self.username, safe='')}:{quote(self.password, safe='')}"
        return f"{parts.scheme}://{userinfo}@{parts.netloc}"

    def __repr__(self) -> str:
        return f"GatewayProxy(server={self.server!r}, username={self.username!r}, password=***)"


def gateway_username(user: str, **routing: Unpack[Routing]) -> str:
    """The username that routes as asked: `user`, its filters, then a session key or a pin.

    A filter value is 1 to 64 of `A-Z a-z 0-9 . _ ~ + =` in words joined by
    `-`, none of the grammar's keywords before a `-`; a session key is 1 to
    128 of `A-Z a-z 0-9 . _ ~ + = -`; a member is a pool member id
    (`<pool>/<n>`) as the pool's `endpoints` and the API's `/v1/members` name
    it. A session and a pin exclude each other: a pin already decides the member.
    """
    unknown = sorted(set(routing) - ROUTING_FIELDS)
    if unknown:
        raise InvalidProxySetting(
            f"{unknown[0]}: not a routing field ({', '.join(Routing.__annotations__)})"
        )
    if not ACCOUNT.fullmatch(user):
        raise InvalidProxySetting(
            f"user: {user!r} is not a proxy username (1 to 64 of A-Z a-z 0-9 . _ -)"
        )
    session, member = routing.get("session"), routing.get("member")
    if session is not None and member is not None:
        raise InvalidProxySetting("session and member: give one, a pin already picks the member")
    username = user
    for name in FILTERS:
        value = routing.get(name)
        if value is not None:
            username += f"-{name}-{_checked_filter(name, value)}"
    if session is not None:
        return f"{username}{SESSION_INFIX}{checked_session(session)}"
    if member is not None:
        return f"{username}{PIN_INFIX}{checked_member(member)}"
    return username


def _checked_filter(name: str, value: object) -> str:
    if not isinstance(value, str) or not FILTER_VALUE.fullmatch(value):
        raise InvalidProxySetting(
            f"{name}: {value!r} is not 1 to 64 of A-Z a-z 0-9 . _ ~ + = in words joined by -"
            " (none of zone, region, provider, session, proxy before a -)"
        )
    return value


def checked_session(key: str) -> str:
    """`key` if the gateway takes it as a session key, else a clear error."""
    if not isinstance(key, str) or not SESSION_KEY.fullmatch(key):
        raise InvalidProxySetting(f"session: {key!r} is not 1 to 128 of A-Z a-z 0-9 . _ ~ + = -")
    return key


def checked_member(member: str) -> str:
    """`member` if it can be a pool member id (`<pool>/<n>`), else a clear error."""
    if not isinstance(member, str) or not PINNABLE_MEMBER.fullmatch(member):
        raise InvalidProxySetting(f"member: {member!r} is not a pool member id")
    return member


def gateway_server(gateway: str) -> str:
    """`gateway` (`host:port` or `http://host:port`) as `http://host:port`, or a clear error."""
    parts = urlsplit(gateway if "://" in gateway else f"{GATEWAY_SCHEME}://{gateway}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.username is not None or parts.password is not None:
        raise InvalidProxySetting("gateway: give the credentials apart, not in the address")
    if parts.scheme != GATEWAY_SCHEME or not parts.hostname or port is None:
        raise InvalidProxySetting(f"gateway: {gateway!r} is not host:port or http://host:port")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidProxySetting(f"gateway: {gateway!r} has more than host:port")
    return f"{GATEWAY_SCHEME}://{parts.netloc}"


def gateway_proxy(
    gateway: str, user: str, password: str, **routing: Unpack[Routing]
) -> GatewayProxy:
    """The gateway at `gateway`, logged in as `user` routed as `routing` says."""
    if not password:
        raise InvalidProxySetting("password: empty; the gateway takes the proxies' password")
    return GatewayProxy(gateway_server(gateway), gateway_username(user, **routing), password)


def proxy_url(gateway: str, user: str, password: str, **routing: Unpack[Routing]) -> str:
    """`http://USER[-zone-..][-region-..][-provider-..][-session-..|-proxy-..]:password@host:port`.

    %-encoded: a member id's `/` is `%2F`, and the password's reserved characters too.
    """
    return gateway_proxy(gateway, user, password, **routing).url()
