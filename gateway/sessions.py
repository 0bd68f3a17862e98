"""Which member a session key goes to: Squid's own choice, computed, and what its logs saw.

Squid cannot add a header to its own `200 Connection established` (Squid 5
writes that reply as a fixed string, and `reply_header_add` never touches
it), so a client learns which member serves a session from the control API
instead (`GET /v1/sessions/<key>`, and each member's `sessions` in
`GET /v1/members`).

The backs pick a session's member with Squid's `userhash`
(src/peer_userhash.cc): a 32-bit hash of the username mixed with each
allowed peer's name hash, the highest wins. Every session peer has the same
weight, so every load multiplier is 1 and the score is the mixed hash alone:
`userhash_member` computes the same choice from the members in rotation, at
once, while the session's tunnel is still open (Squid logs a CONNECT only
when its tunnel closes). What it cannot see is a member Squid counts down
for now (connect failures): Squid then takes the next highest, as this does
for the members it is given.

The backs' access logs (`%un` next to the peer that carried each CONNECT)
add the endpoint a session's latest tunnel went to, so a ban names the
instance the client saw (a member that rotated since is not banned again
for its old instance's sins), and the session keys each member carried, for
`/v1/members`. The map keeps the MAX_SESSIONS keys seen last.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.metrics import MemberNames
from providers.squid import SESSION_INFIX, SESSION_KEY, Route, peer_name

MAX_SESSIONS = 100_000
# A back log line's fields (providers.squid.GATEWAY_LOG_FORMAT): status, peer
# name, peer address and port, and the username last.
_STATUS, _PEER, _ADDRESS, _PORT, _USER = 2, 4, 5, 6, 9


_MASK = 0xFFFFFFFF
_MIX = 0x62531965


@dataclass(frozen=True)
class Carrier:
    """The member that carried a session's latest tunnel, the endpoint it was at, and the
    username it came with (which may carry routing filters)."""

    member: str
    endpoint: str
    username: str


def _rotate_left(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (32 - bits))) & _MASK


def _string_hash(text: str) -> int:
    """Squid's `h += ROTATE_LEFT(h, 19) + c` over a string's bytes, in 32 bits."""
    value = 0
    for byte in text.encode():
        value = (value + _rotate_left(value, 19) + byte) & _MASK
    return value


def _mixed(value: int) -> int:
    return _rotate_left((value + value * _MIX) & _MASK, 21)


def userhash_member(username: str, members: Sequence[str]) -> str | None:
    """The member Squid's userhash sends `username` to, of `members` (all up), or None."""
    user_hash = _string_hash(username)
    best, high = None, 0
    for member in members:
        peer_hash = _mixed(_string_hash(peer_name(member, Route.SESSION)))
        score = _mixed(user_hash ^ peer_hash)
        if score > high:  # as Squid: the first of equal scores, and never a score of 0
            best, high = member, score
    return best


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
    """The session key in a gateway username, or None if it names no session.

    The first `-session-` starts the key (a key may hold more; no filter value can).
    """
    _, infix, key = username.partition(SESSION_INFIX)
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
        sessions.record(key, Carrier(member, f"{host}:{fields[_PORT]}", fields[_USER]))
