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

A pure index over the members in rotation (`Members`), so a choice costs the
same at 10 members as at 10,000: the members a set of filters admits are
kept per set, rotation is a counter per such list, a pin is a dictionary
lookup, and a session's members are remembered per key. A membership change
is applied in place and costs what it touches (one member in, one out: the
same at 10,000 members as at 10), since the router applies it on the event
loop that serves every request; the index it leaves is the one a build from
scratch over the same members in the same order would give, remembered
session choices included.

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
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

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
# Changes a remembered session choice is brought up to date across at its next
# use; a key unused for longer is scored anew.
MAX_CHANGES_REMEMBERED = 256
# Filter sets whose admitted members are kept across changes (each change looks
# at each touched member once per set): usernames choose them, so past this many
# all are dropped and listed anew at their next use.
MAX_FILTER_SETS = 1_000

# A username's routing filters, sorted: the key of what they admit.
FilterKey = tuple[tuple[str, str], ...]


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
    return _scores(_string_hash(username), hashes)


def _scores(user_hash: int, hashes: Sequence[int]) -> list[int]:
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


@dataclass(slots=True)
class _Ranked:
    """A session key's members to try, best first, as the index stood at `generation`."""

    user_hash: int
    ids: tuple[str, ...]
    scores: tuple[int, ...]
    generation: int


class Members:
    """The members in rotation, indexed for each request's choice and changed in place.

    Membership order is the order members entered in: a member that enters,
    or whose fields change, goes to its end. A change costs what it touches,
    not what stays: each member's hash is computed once, when it enters; the
    members each filter set admits are kept per set and changed member by
    member (one `matches` per set and member touched); the lists rotation
    walks are made again at their next use from those (a copy of references,
    no Python per member); and a remembered session choice is brought up to
    date at its next use from the members touched since (`_up_to_date`).
    """

    def __init__(self, members: Sequence[GatewayMember] = ()) -> None:
        """`members`: the members in rotation and the stand-ins, told apart by their ids."""
        self.by_id: dict[str, GatewayMember] = {}
        self.stand_ins: tuple[GatewayMember, ...] = ()
        # Changes applied since this index was built.
        self.generation = 0
        self._hashes: dict[str, int] = {}
        # Each member's place in membership order: ties between equal session scores.
        self._places: dict[str, int] = {}
        self._next_place = 0
        self._admitted: dict[FilterKey, dict[str, GatewayMember]] = {}
        self._listed: dict[FilterKey, tuple[GatewayMember, ...]] = {}
        self._turns: dict[FilterKey, itertools.count[int]] = {}
        self._sessions: dict[str, _Ranked] = {}
        # The ids each of the latest changes touched, the latest last.
        self._touched: deque[frozenset[str]] = deque(maxlen=MAX_CHANGES_REMEMBERED)
        self._enter(
            [m for m in members if not is_stand_in(m.member)],
            (),
            [m for m in members if is_stand_in(m.member)],
        )

    @property
    def members(self) -> tuple[GatewayMember, ...]:
        """The members in rotation, in membership order."""
        return self.admitted({})

    def change(
        self,
        entering: Sequence[GatewayMember],
        leaving: Iterable[str],
        stand_ins: Sequence[GatewayMember] | None = None,
    ) -> None:
        """One membership change, in place: `entering` members are new or have new fields
        (by id), `leaving` ids go, and `stand_ins` (in order), if given, replace the
        stand-ins whole."""
        touched = self._enter(entering, leaving, stand_ins)
        self.generation += 1
        if self._sessions:
            self._touched.append(touched)
        else:
            self._touched.clear()  # no remembered choice is older than this change

    def _enter(
        self,
        entering: Sequence[GatewayMember],
        leaving: Iterable[str],
        stand_ins: Sequence[GatewayMember] | None,
    ) -> frozenset[str]:
        """Apply a change to every part of the index; the ids it touched."""
        entering_ids = {member.member for member in entering}
        touched: dict[str, None] = {}  # in order: leavers, then members entering as they enter
        for member_id in leaving:
            if member_id not in entering_ids and self.by_id.pop(member_id, None) is not None:
                touched[member_id] = None
                del self._hashes[member_id], self._places[member_id]
        for member in entering:
            member_id = member.member
            self.by_id.pop(member_id, None)
            self.by_id[member_id] = member
            touched.pop(member_id, None)
            touched[member_id] = None
            if member_id not in self._hashes:
                self._hashes[member_id] = member_hash(member_id)
            self._places[member_id] = self._next_place
            self._next_place += 1
        for key, admitted in self._admitted.items():
            filters = dict(key)
            for member_id in touched:
                admitted.pop(member_id, None)
                found = self.by_id.get(member_id)
                if found is not None and found.matches(filters):
                    admitted[member_id] = found
        if touched:
            self._listed.clear()
        if stand_ins is not None:
            self.stand_ins = tuple(stand_ins)
        return frozenset(touched)

    def admitted(self, filters: dict[str, str]) -> tuple[GatewayMember, ...]:
        """The members whose values `filters` name, in membership order."""
        key = tuple(sorted(filters.items()))
        listed = self._listed.get(key)
        if listed is None:
            listed = tuple(self._admitted_by_id(key).values())
            self._listed[key] = listed
        return listed

    def _admitted_by_id(self, key: FilterKey) -> dict[str, GatewayMember]:
        """The members filter set `key` admits, by id in membership order, kept across
        changes (at most MAX_FILTER_SETS sets: past that all are listed anew)."""
        if not key:
            return self.by_id
        found = self._admitted.get(key)
        if found is None:
            if len(self._admitted) >= MAX_FILTER_SETS:
                self._admitted.clear()
                self._listed.clear()
                self._turns.clear()
            filters = dict(key)
            found = {i: m for i, m in self.by_id.items() if m.matches(filters)}
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
        key = tuple(sorted(parsed.filters.items()))
        if parsed.session is not None:
            yield from (self.by_id[i] for i in self._ranked(username, key, admitted).ids)
            return
        start = next(self._turns.setdefault(key, itertools.count())) % len(admitted)
        for step in range(len(admitted)):
            yield admitted[(start + step) % len(admitted)]

    def _ranked(
        self, username: str, key: FilterKey, admitted: tuple[GatewayMember, ...]
    ) -> _Ranked:
        """`username`'s members to try, remembered and brought up to date, or scored."""
        ranked = self._sessions.get(username)
        if ranked is not None and ranked.generation != self.generation:
            ranked = self._up_to_date(ranked, key)
            if ranked is not None:
                self._sessions[username] = ranked
        if ranked is None:
            user_hash = _string_hash(username)
            scores = _scores(user_hash, [self._hashes[m.member] for m in admitted])
            # Highest first, equal scores in membership order (Squid's first wins);
            # only the first few are ever tried.
            best = heapq.nsmallest(FIRST_TRIES, range(len(admitted)), key=lambda i: -scores[i])
            kept = [i for i in best if scores[i]]
            ranked = _Ranked(
                user_hash,
                tuple(admitted[i].member for i in kept),
                tuple(scores[i] for i in kept),
                self.generation,
            )
            if len(self._sessions) >= MAX_REMEMBERED_SESSIONS:
                self._sessions.clear()
            self._sessions[username] = ranked
        return ranked

    def _up_to_date(self, ranked: _Ranked, key: FilterKey) -> _Ranked | None:
        """`ranked` as scoring the members admitted now would rank them, from the members
        touched since it was made; None when only scoring them all can tell.

        A member it ranks that was touched (left, or changed) may leave a place
        that only the whole list can fill. Otherwise its members stay, each at
        its score and place, and a member touched since can only be one more
        candidate: scored, it is ranked among them if admitted and high enough.
        """
        behind = self.generation - ranked.generation
        if behind > len(self._touched):
            return None
        touched = frozenset().union(*itertools.islice(reversed(self._touched), behind))
        if not touched.isdisjoint(ranked.ids):
            return None
        admitted = self._admitted_by_id(key)
        places = self._places
        entries = [
            (-score, places[i], i) for i, score in zip(ranked.ids, ranked.scores, strict=True)
        ]
        for member_id in touched:
            if member_id in admitted:
                score = _mixed(ranked.user_hash ^ self._hashes[member_id])
                if score:
                    entries.append((-score, places[member_id], member_id))
        best = heapq.nsmallest(FIRST_TRIES, entries)
        return _Ranked(
            ranked.user_hash,
            tuple(i for _, _, i in best),
            tuple(-score for score, _, _ in best),
            self.generation,
        )
