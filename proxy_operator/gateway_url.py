"""Gateway proxy URLs: the username that routes a request, built and checked before it is sent.

The gateway routes by username (docs/operations.md, "The gateway"): `USER`
rotates, `USER-session-<key>` keeps one member per key, `USER-proxy-<member>`
pins one member. The gateway answers any username it cannot parse with a
bare 407, which says nothing of what was wrong; built here, a bad field is
named before the first request. The grammar's pieces are the gateway's own
(providers/squid.py), so client and gateway cannot drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from providers.squid import PIN_INFIX, PINNABLE_MEMBER, PROXY_USERNAME, SESSION_INFIX, SESSION_KEY

ACCOUNT = re.compile(PROXY_USERNAME)
GATEWAY_SCHEME = "http"


class InvalidProxySetting(ValueError):
    """A proxy URL part that the gateway would refuse; the message names the part."""


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


def gateway_username(user: str, *, session: str | None = None, member: str | None = None) -> str:
    """The username that routes as asked: `user`, then a session key or a member pin.

    A session key is 1 to 128 of `A-Z a-z 0-9 . _ ~ + = -`; a member is a
    pool member id (`<pool>/<n>`) as the pool's `endpoints` and the API's
    `/v1/members` name it. A session and a pin exclude each other: a pin
    already decides the member.
    """
    if not ACCOUNT.fullmatch(user):
        raise InvalidProxySetting(
            f"user: {user!r} is not a proxy username (1 to 64 of A-Z a-z 0-9 . _ -)"
        )
    if session is not None and member is not None:
        raise InvalidProxySetting("session and member: give one, a pin already picks the member")
    if session is not None:
        return f"{user}{SESSION_INFIX}{checked_session(session)}"
    if member is not None:
        return f"{user}{PIN_INFIX}{checked_member(member)}"
    return user


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
    gateway: str,
    user: str,
    password: str,
    *,
    session: str | None = None,
    member: str | None = None,
) -> GatewayProxy:
    """The gateway at `gateway`, logged in as `user` routed by `session` or `member`."""
    if not password:
        raise InvalidProxySetting("password: empty; the gateway takes the proxies' password")
    return GatewayProxy(
        gateway_server(gateway), gateway_username(user, session=session, member=member), password
    )


def proxy_url(
    gateway: str,
    user: str,
    password: str,
    *,
    session: str | None = None,
    member: str | None = None,
) -> str:
    """`http://user[-session-<key>|-proxy-<member>]:password@host:port`, %-encoded."""
    return gateway_proxy(gateway, user, password, session=session, member=member).url()
