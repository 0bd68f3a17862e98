"""The gateway username's grammar: what routes a request, checked the same on both sides.

The gateway routes by username (docs/operations.md, "Usernames"):

    USER[-zone-<zone>][-region-<region>][-provider-<name>][-session-<key> | -proxy-<member>]

The client builds these (gateway_url.py) and the gateway's router parses
them (gateway/router.py, gateway/users.py); both read this one module, so
they cannot drift apart. It sits in the client package, the lowest layer,
because a scraper installs the client alone: standard library only, and
nothing of the operator, which imports it from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The proxies' username (`proxy.auth.username`): what gateway usernames start with.
PROXY_USERNAME = r"^[A-Za-z0-9._-]{1,64}$"
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
