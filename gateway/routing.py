"""Which members a gateway username may go to, in the order the router tries them.

    USER                      rotate: the next member in turn, per CONNECT
    USER-session-<key>        session: the member the key hashes to (userhash)
    USER-proxy-<member>       pin: that member alone
    USER-zone-<z>-...         filters first: only members whose values they name

A stand-in (`STAND_IN`, an id no pool member has: gateway/wake.py's holder
for a pool at zero) is tried only when no member in rotation is admitted,
and never pinned: a request some member can serve wakes nobody. Stand-ins
are tried in the order given (the pools' order), so a request several pools
at zero could serve goes to the first of them alone.

A pure index over the members in rotation, rebuilt whole at each membership
change (`Members`), so a choice costs the same at 10 members as at 10,000:
the members a set of filters admits are listed once per change and kept,
rotation is a counter per such list, a pin is a dictionary lookup, and a
session's member is remembered per key until the next change.

Sessions use the algorithm of Squid's `userhash` (src/peer_userhash.cc): a
32-bit hash of the username mixed with each allowed member's name hash, the
highest wins. It is a rendezvous hash:
removing a member moves only the keys it held (about 1/N of them), adding
one takes about 1/N, and every gateway with the same members maps a key to
the same member, with nothing shared but the member ids. The control API
names a session's member with the same function (gateway/sessions.py).

Standard library only: the router runs it as Squid's user, from a copy.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

from proxy_operator.username import GatewayUsername
from squid.gateway import GatewayMember, Route, peer_name

# The id of a pool's stand-in is this and the pool's id; a member's is `<pool>/<n>`.
STAND_IN = "wake-hold:"
# The members a session is tried on, best first, before it fails.
FIRST_TRIES = 10
_MASK = 0xFFFFFFFF
_MIX = 0x62531965
# The session choices remembered between membership changes: a crawl reuses a
# few keys often, and each first choice scores every allowed member.
MAX_REMEMBERED_SESSIONS = 100_000


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


def member_hash(member: str) -> int:
    """A member's userhash weight-free hash: of its session peer name (`peer_name`), a
    function of the member id alone, so a key maps to the same member in every gateway,
    across restarts and the member's own rotations."""
    return _mixed(_string_hash(peer_name(member, Route.SESSION)))


def session_scores(username: str, hashes: Sequence[int]) -> list[int]:
    """Each member's userhash score for `username` (0 never wins)."""
    user_hash = _string_hash(username)
    return [_mixed(user_hash ^ peer) for peer in hashes]


def userhash_member(username: str, members: Sequence[str]) -> str | None:
    """The member userhash sends `username` to, of `members` (all up), or None.

    As Squid: the first of equal scores, and never a score of 0.
    """
    best, high = None, 0
    for member, score in zip(
        members, session_scores(username, [member_hash(m) for m in members]), strict=True
    ):
        if score > high:
            best, high = member, score
    return best


def is_stand_in(member: str) -> bool:
    """Whether `member` is a pool's stand-in while it is at zero, not a member."""
    return member.startswith(STAND_IN)


class Members:
    """The members in rotation, indexed for each request's choice; replaced at each change."""

    def __init__(self, members: Sequence[GatewayMember]) -> None:
        """`members`: the members in rotation and the stand-ins, told apart by their ids."""
        self.members = tuple(m for m in members if not is_stand_in(m.member))
        self.stand_ins = tuple(m for m in members if is_stand_in(m.member))
        self.by_id = {member.member: member for member in self.members}
        self._hashes = {member.member: member_hash(member.member) for member in self.members}
        self._admitted: dict[tuple[tuple[str, str], ...], tuple[GatewayMember, ...]] = {}
        self._turns: dict[tuple[tuple[str, str], ...], itertools.count[int]] = {}
        self._sessions: dict[str, tuple[GatewayMember, ...]] = {}

    def admitted(self, filters: dict[str, str]) -> tuple[GatewayMember, ...]:
        """The members whose values `filters` name, in membership order (kept until a change)."""
        key = tuple(sorted(filters.items()))
        found = self._admitted.get(key)
        if found is None:
            found = tuple(m for m in self.members if m.matches(filters))
            self._admitted[key] = found
        return found

    def order(self, username: str, parsed: GatewayUsername) -> Iterator[GatewayMember]:
        """The members `username` may go to, the one to try first first.

        Rotation starts each CONNECT one further along its list and then goes
        round it; a session tries its key's members by falling score; a pin
        has its member alone, if its filters admit it. No member admitted:
        the stand-ins the filters admit, in order. Empty: no member may
        take the request, which then goes nowhere.
        """
        if parsed.pin is not None:
            member = self.by_id.get(parsed.pin)
            if member is not None and member.matches(parsed.filters):
                yield member
            return
        admitted = self.admitted(parsed.filters)
        if not admitted:
            yield from (m for m in self.stand_ins if m.matches(parsed.filters))
            return
        if parsed.session is not None:
            yield from self._by_score(username, admitted)
            return
        key = tuple(sorted(parsed.filters.items()))
        start = next(self._turns.setdefault(key, itertools.count())) % len(admitted)
        for step in range(len(admitted)):
            yield admitted[(start + step) % len(admitted)]

    def _by_score(
        self, username: str, admitted: tuple[GatewayMember, ...]
    ) -> Iterator[GatewayMember]:
        ranked = self._sessions.get(username)
        if ranked is None:
            scores = session_scores(username, [self._hashes[m.member] for m in admitted])
            # Highest first, equal scores in membership order (Squid's first wins);
            # only the first few are ever tried.
            best = heapq.nsmallest(FIRST_TRIES, range(len(admitted)), key=lambda i: -scores[i])
            ranked = tuple(admitted[i] for i in best if scores[i])
            if len(self._sessions) >= MAX_REMEMBERED_SESSIONS:
                self._sessions.clear()
            self._sessions[username] = ranked
        yield from ranked
