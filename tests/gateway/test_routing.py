"""The router's member index (gateway/routing.py): rotation, filters, pins and sessions."""

from __future__ import annotations

import random

from gateway.routing import MAX_CHANGES_REMEMBERED, STAND_IN, Members, userhash_member
from proxy_operator.username import parse_gateway_username
from squid.gateway import GatewayMember

USER = "proxy"


def member(n: int, zone: str = "europe-west1-b", provider: str = "gcp") -> GatewayMember:
    return GatewayMember(f"pool/{n}", f"10.0.0.{n}", 3128, zone, zone[:-2], provider)


def order(members: Members, username: str) -> list[str]:
    parsed = parse_gateway_username(username, USER)
    assert parsed is not None, username
    return [m.member for m in members.order(username, parsed)]


def test_rotation_starts_one_further_each_request_and_goes_round() -> None:
    members = Members([member(n) for n in range(4)])
    firsts = [order(members, USER)[0] for _ in range(8)]
    assert firsts == [f"pool/{n % 4}" for n in range(8)]
    # A request whose first member fails goes on round the list, each once.
    assert sorted(order(members, USER)) == [f"pool/{n}" for n in range(4)]


def test_filters_admit_only_the_members_whose_values_they_name() -> None:
    members = Members(
        [member(0), member(1, zone="us-east1-c"), member(2, zone="us-east1-c", provider="aws")]
    )
    assert set(order(members, f"{USER}-zone-us-east1-c")) == {"pool/1", "pool/2"}
    assert order(members, f"{USER}-region-us-east1-provider-aws") == ["pool/2"]
    assert order(members, f"{USER}-zone-asia-east1-a") == []
    assert order(members, f"{USER}-zone-us-east1-c-session-k")[0] in {"pool/1", "pool/2"}


def test_a_pin_has_its_member_alone_and_only_if_the_filters_admit_it() -> None:
    members = Members([member(0), member(1, zone="us-east1-c")])
    assert order(members, f"{USER}-proxy-pool/1") == ["pool/1"]
    assert order(members, f"{USER}-zone-us-east1-c-proxy-pool/1") == ["pool/1"]
    assert order(members, f"{USER}-zone-europe-west1-b-proxy-pool/1") == []
    assert order(members, f"{USER}-proxy-pool/9") == []


def test_a_session_goes_first_where_the_control_api_says() -> None:
    members = Members([member(n) for n in range(50)])
    ids = [m.member for m in members.members]
    for key in range(200):
        username = f"{USER}-session-k{key}"
        assert order(members, username)[0] == userhash_member(username, ids)


def test_a_member_leaving_moves_only_its_own_sessions_and_about_1_in_n() -> None:
    n = 100
    before = Members([member(k) for k in range(n)])
    after = Members([member(k) for k in range(n) if k != 7])
    usernames = [f"{USER}-session-k{key}" for key in range(5_000)]
    moved = [u for u in usernames if order(before, u)[0] != order(after, u)[0]]
    assert all(order(before, u)[0] == "pool/7" for u in moved)
    # Rendezvous hashing: the leaver's share, 1/n, give or take chance.
    assert 0.3 / n < len(moved) / len(usernames) < 3 / n
    # ... and it goes to the key's next choice, as if the leaver had failed.
    assert all(order(after, u)[0] == order(before, u)[1] for u in moved)


def test_an_index_is_rebuilt_whole_so_a_change_leaves_no_stale_choice() -> None:
    first = Members([member(0), member(1)])
    username = f"{USER}-session-sticky"
    chosen = order(first, username)[0]
    rest = [m for m in first.members if m.member != chosen]
    assert order(Members(rest), username) == [rest[0].member]
    assert order(Members([]), USER) == []


def stand_in(pool: str, zone: str | None, provider: str | None) -> GatewayMember:
    region = zone[:-2] if zone else None
    return GatewayMember(f"{STAND_IN}{pool}", "127.0.0.1", 4000, zone, region, provider)


def test_a_stand_in_takes_only_what_no_member_is_admitted_for_first_pool_first() -> None:
    members = Members(
        [
            member(0),
            stand_in("pool-us", "us-east1-c", "aws"),
            stand_in("pool-ap", None, "gcp"),
            stand_in("pool-any", None, None),
        ]
    )
    # A member can serve it: served, no stand-in tried (nobody woken).
    assert order(members, USER) == ["pool/0"]
    assert order(members, f"{USER}-provider-gcp-session-k") == ["pool/0"]
    # Only a pool at zero can: its stand-in alone.
    assert order(members, f"{USER}-zone-us-east1-c") == [f"{STAND_IN}pool-us"]
    assert order(members, f"{USER}-region-us-east1-provider-aws") == [f"{STAND_IN}pool-us"]
    # A value a stand-in does not fix (its pool's zone) admits it for no filter on it.
    assert order(members, f"{USER}-zone-asia-east1-a") == []
    assert order(members, f"{USER}-zone-asia-east1-a-provider-gcp") == []
    # Never pinned, even by its own id.
    assert order(members, f"{USER}-proxy-{STAND_IN}pool-us") == []


def test_with_every_pool_at_zero_a_plain_request_goes_to_the_first_pool_given() -> None:
    members = Members(
        [stand_in("pool-eu", "europe-west1-b", "gcp"), stand_in("pool-us", None, "aws")]
    )
    assert [order(members, USER)[0] for _ in range(3)] == [f"{STAND_IN}pool-eu"] * 3
    assert order(members, f"{USER}-session-k")[0] == f"{STAND_IN}pool-eu"
    assert order(members, f"{USER}-provider-aws") == [f"{STAND_IN}pool-us"]


ZONES = ("europe-west1-b", "europe-west1-c", "us-east1-c")
FILTERS = ({}, {"zone": "us-east1-c"}, {"region": "europe-west1"}, {"provider": "aws"})


def usernames() -> list[str]:
    """Every route the index answers: rotation, session keys and pins, with filters."""
    forms = ["", "-zone-us-east1-c", "-region-europe-west1", "-provider-aws"]
    found = [f"{USER}{form}-session-k{key}" for form in forms for key in range(12)]
    return found + [f"{USER}-proxy-pool/{n}" for n in range(0, 90, 7)]


def test_an_index_changed_in_place_is_the_index_built_from_scratch() -> None:
    """Any sequence of changes, and of requests between them, leaves the index a build
    over the same members in the same order gives: each filter set's admitted list, each
    session key's members by score (remembered across changes, some across many), pins
    and stand-ins."""
    rng = random.Random(45)
    routed: dict[str, GatewayMember] = {}  # membership order: who entered last, last
    stand_ins: list[GatewayMember] = []
    index = Members([])
    names = usernames()
    often = names[1::3] + names[2::3]

    def drawn(n: int) -> GatewayMember:
        zone = rng.choice(ZONES)
        provider = rng.choice(("gcp", "aws"))
        return GatewayMember(
            f"pool/{n}", f"10.0.{n}.{rng.randrange(256)}", 3128, zone, zone[:-2], provider
        )

    for step in range(MAX_CHANGES_REMEMBERED + 100):
        leaving = rng.sample(sorted(routed), k=min(len(routed), rng.randrange(4)))
        entering = [drawn(rng.randrange(90)) for _ in range(rng.randrange(4))]
        changed = None
        if rng.random() < 0.1:
            pools = rng.sample(["pool-eu", "pool-us", "pool-any"], k=rng.randrange(4))
            changed = [stand_in(pool, rng.choice((*ZONES, None)), "gcp") for pool in pools]
            stand_ins = changed
        index.change(entering, leaving, changed)
        entering_ids = {m.member for m in entering}
        for member in leaving:
            if member not in entering_ids:
                del routed[member]
        for member in entering:
            routed.pop(member.member, None)
            routed[member.member] = member

        built = Members([*routed.values(), *stand_ins])
        assert index.members == built.members, step
        assert index.stand_ins == built.stand_ins, step
        for filters in FILTERS:
            assert index.admitted(filters) == built.admitted(filters), (step, filters)
        # Keys asked after most changes, or some; a few only twice, more changes apart
        # than a choice is remembered across (MAX_CHANGES_REMEMBERED).
        asked = rng.sample(often, k=len(often) // 2) if step % 50 else often
        if step in (0, MAX_CHANGES_REMEMBERED + 50):
            asked = names
        for username in asked:
            assert order(index, username) == order(built, username), (step, username)
