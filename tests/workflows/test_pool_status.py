"""The pool's `status` answer (workflows/pool_status.py): a page of members, bounded.

A query's answer is one payload. At the pool's maximum size with every
string at its cap it must stay under 1 MiB, whichever page is asked for,
and paging must list every member once. No server: the payload is what the
SDK's default converter makes of the answer. The query itself, paged and
refused, is tested on a running pool in test_pool.py and
test_hostile_handlers.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.worst_pool import pages, payload_size, worst_member
from workflows.inputs import parse_model
from workflows.pool_input import DEFAULT_PAGE, MAX_PAGE, MAX_REPLICAS, StatusRequest
from workflows.pool_status import member_page, member_status

ONE_MIB = 1024 * 1024


def test_every_page_of_the_largest_pool_with_every_string_at_its_cap_is_under_1_mib() -> None:
    members = [worst_member(n) for n in range(MAX_REPLICAS)]
    whole = [member_status(m) for m in members]
    assert payload_size(whole) > 16 * ONE_MIB, "the worst case is a real one: unpaged, uncut"
    for limit in (DEFAULT_PAGE, MAX_PAGE):
        sizes = [payload_size(status) for status in pages(members, limit)]
        assert max(sizes) < ONE_MIB, f"limit {limit}: {max(sizes)} bytes"


def test_paging_lists_every_member_once_in_order_and_says_how_many() -> None:
    members = [worst_member(n) for n in range(0, 2 * MAX_REPLICAS, 2)]  # gaps, as after removals
    listed = pages(members, DEFAULT_PAGE)
    assert [len(p.members) for p in listed] == [DEFAULT_PAGE] * (MAX_REPLICAS // DEFAULT_PAGE)
    assert [m.member for p in listed for m in p.members] == [m.member for m in members]
    assert {p.members_total for p in listed} == {MAX_REPLICAS}
    assert listed[-1].next_page is None and listed[0].next_page == {
        "after": members[DEFAULT_PAGE - 1].index,
        "limit": DEFAULT_PAGE,
    }


def test_a_pool_no_larger_than_a_page_answers_whole_and_uncut() -> None:
    members = [worst_member(n) for n in range(3)]
    page, next_page = member_page(members, StatusRequest())
    assert next_page is None
    assert page == [member_status(m) for m in members]


def test_texts_over_the_page_budget_are_cut_marked_and_keep_their_start() -> None:
    members = [worst_member(n) for n in range(MAX_PAGE)]
    page, _ = member_page(members, StatusRequest(limit=MAX_PAGE))
    for cut, whole in zip(page, members, strict=True):
        assert cut.last_error and whole.last_error
        assert cut.last_error.endswith("…") and whole.last_error.startswith(cut.last_error[:-1])
        assert (cut.member, cut.endpoint, cut.generation) == (
            whole.member,
            whole.verified,
            whole.generation,
        )


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": MAX_PAGE + 1}, "limit"),
        ({"limit": True}, "limit"),
        ({"limit": 1.5}, "limit"),
        ({"after": "pool/3"}, "after"),
        ({"after": -2}, "after"),
        ({"page": 2}, "page: unknown field"),
        ("next", "input: expected a JSON object"),
    ],
)
def test_a_bad_page_request_is_refused_naming_the_field(raw: Any, named: str) -> None:
    request, problems = parse_model(StatusRequest, raw, "(the status request)")
    assert request is None
    assert any(p.startswith(named) for p in problems), problems
