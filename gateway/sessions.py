"""Which member a session key goes to, and which member carried its latest tunnel.

Squid cannot add a header to its own `200 Connection established` (Squid 5
writes that reply as a fixed string, and `reply_header_add` never touches
it), so a client learns which member serves a session from the control API
instead (`GET /v1/sessions/<key>`, and each member's `sessions` in
`GET /v1/members`).

The router picks a session's member with gateway/routing.py's
`userhash_member`, which the API calls on the members in rotation, at once:
that is the member the key goes to now. What it cannot see is a member the
router skips for now (connect failures): the router then takes the next highest.

The carrier is another question: the member, and the endpoint it was at,
that carried the session's latest tunnel, from the router's access log.
The router writes a session tunnel's line when its member grants it
(TUNNEL_OPENED), before the client sees the 200, so the carrier is known
while the tunnel is open, however long a crawler keeps it. A ban by
session names the carrier, not the member the key hashes to now: members
that joined or left since move keys, never the exit that served the banned
page, and a carrier that rotated since is not banned again for its old
instance's sins (the pool judges the endpoint the ban names). Each
member's `sessions` in `/v1/members` are the keys it carried last. The map
keeps the MAX_SESSIONS keys seen last.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from gateway.metrics import MemberNames
from proxy_operator.username import SESSION_INFIX, SESSION_KEY
from squid.gateway import TUNNEL_OPENED, Route

MAX_SESSIONS = 100_000
# A router log line's fields (squid.gateway.GATEWAY_LOG_FORMAT): status, kind, peer
# name, peer address and port, and the username last.
_STATUS, _KIND, _PEER, _ADDRESS, _PORT, _USER = 2, 3, 4, 5, 6, 9


@dataclass(frozen=True)
class Carrier:
    """The member that carried a session's latest tunnel, the endpoint it was at, and the
    username it came with (which may carry routing filters)."""

    member: str
    endpoint: str
    username: str


class SessionMap:
    """Session key -> Carrier, bounded; written by the log follower, read by the API."""

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
        self._limit = limit
        self._carriers: OrderedDict[str, Carrier] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, key: str, carrier: Carrier) -> None:
        with self._lock:
            self._carriers[key] = carrier
            self._carriers.move_to_end(key)
            while len(self._carriers) > self._limit:
                self._carriers.popitem(last=False)

    def get(self, key: str) -> Carrier | None:
        with self._lock:
            return self._carriers.get(key)

    def by_member(self) -> dict[str, list[str]]:
        """Member -> the session keys whose latest tunnel it carried."""
        found: dict[str, list[str]] = {}
        with self._lock:
            for key, carrier in self._carriers.items():
                found.setdefault(carrier.member, []).append(key)
        return found


def session_key(username: str) -> str | None:
    """The session key in a gateway username, or None if it names no session.

    The first `-session-` starts the key (a key may hold more; no filter value can).
    """
    _, infix, key = username.partition(SESSION_INFIX)
    return key if infix and SESSION_KEY.fullmatch(key) else None


def record_router_line(line: str, names: MemberNames, sessions: SessionMap) -> None:
    """Note the member that carried a session's tunnel, from one router log line.

    A session route's tunnel is noted when granted, its line at the end
    skipped: an older tunnel of the key that closes after a newer one opened
    does not make its member the carrier again. A pinned username with a
    session key gets the one line at the end.
    """
    fields = line.split()
    if len(fields) <= _USER or fields[_STATUS] != "200" or fields[_PEER] == "-":
        return
    member, route = names.get(fields[_PEER])
    if (route == Route.SESSION) != (fields[_KIND] == TUNNEL_OPENED):
        return
    key = session_key(fields[_USER])
    if member and key:
        address = fields[_ADDRESS]
        host = f"[{address}]" if ":" in address else address  # as the pool writes endpoints
        sessions.record(key, Carrier(member, f"{host}:{fields[_PORT]}", fields[_USER]))
