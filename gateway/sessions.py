"""Which member carried each session key: read from the back workers' access logs.

Squid cannot add a header to its own `200 Connection established` (Squid 5
writes that reply as a fixed string, tunnel.cc, and `reply_header_add` never
sees it), so a client learns which member served a session from the control
API instead (`GET /v1/sessions/<key>`, and each member's `sessions` in
`GET /v1/members`). The backs log the username (`%un`) next to the peer that
carried each CONNECT; the session key is the part after `-session-`. The map
holds the member that carried the latest tunnel of each key, and the endpoint
it was at (a ban names it, so a member that rotated since is not banned for
its old instance's sins). It keeps the MAX_SESSIONS keys seen last.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from gateway.metrics import MemberNames
from providers.squid import SESSION_INFIX, SESSION_KEY

MAX_SESSIONS = 100_000
# A back log line's fields (providers.squid.GATEWAY_LOG_FORMAT): status, peer
# name, peer address and port, and the username last.
_STATUS, _PEER, _ADDRESS, _PORT, _USER = 2, 4, 5, 6, 9


@dataclass(frozen=True)
class Carrier:
    """The member that carried a session's latest tunnel, and the endpoint it was at."""

    member: str
    endpoint: str


class SessionMap:
    """Session key -> Carrier, bounded; written by the log follower's thread, read by the API."""

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
    """The session key in a gateway username, or None if it names no session."""
    _, infix, key = username.rpartition(SESSION_INFIX)
    return key if infix and SESSION_KEY.fullmatch(key) else None


def record_back_line(line: str, names: MemberNames, sessions: SessionMap) -> None:
    """Note the member that carried a session's tunnel, from one back log line."""
    fields = line.split()
    if len(fields) <= _USER or fields[_STATUS] != "200" or fields[_PEER] == "-":
        return
    member, _ = names.get(fields[_PEER])
    key = session_key(fields[_USER])
    if member and key:
        address = fields[_ADDRESS]
        host = f"[{address}]" if ":" in address else address  # as the pool writes endpoints
        sessions.record(key, Carrier(member, f"{host}:{fields[_PORT]}"))
