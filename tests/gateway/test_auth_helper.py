"""Squid's basic-auth helper for the gateway (gateway/auth_helper.py), run as Squid runs it.

The helper reads `username password` lines and answers each with one line;
the fleet's own username goes on to Squid's real `basic_ncsa_auth`. Whether
a users-file account exists must not show in how a refusal is answered nor
in what it costs: how long that takes is measured by `python -m bench.auth`,
here the work itself is seen, as scrypt's memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.users import SCRYPT_N, SCRYPT_R, hash_password
from tests.helpers.auth_helper import AuthHelper, auth_helper
from tests.helpers.config import PASSWORD, USERNAME
from tests.helpers.procfs import status_value
from tests.helpers.squid_upstream import requires_squid

pytestmark = requires_squid

ALICE, CAROL = ("alice", "alice-password-1"), ("carol", "carol password 3")
# What one scrypt check of hash_password's cost holds in memory (128 * N * r bytes), in KiB.
SCRYPT_KIB = 128 * SCRYPT_N * SCRYPT_R // 1024


@pytest.fixture
def helper() -> Iterator[AuthHelper]:
    users = (
        f"{ALICE[0]}:{hash_password(ALICE[1])}\n{CAROL[0]}:{hash_password(CAROL[1])} zones=eu-b\n"
    )
    with auth_helper(users) as running:
        yield running


def test_each_kind_of_username_gets_its_answer(helper: AuthHelper) -> None:
    assert helper.ask(*ALICE) == "OK"
    assert helper.ask(f"{ALICE[0]}-session-s1", ALICE[1]) == "OK"
    assert helper.ask(ALICE[0], "wrong") == "ERR wrong password"
    assert helper.ask(USERNAME, PASSWORD).startswith("OK")
    assert helper.ask(USERNAME, "wrong").startswith("ERR")
    # Names of no account, and forms no account has, are refused alike.
    assert helper.ask("zed", ALICE[1]) == "ERR unknown user"
    assert helper.ask("zed-session-s1", "anything") == "ERR unknown user"
    assert helper.ask(f"{ALICE[0]}-nonsense", ALICE[1]) == "ERR unknown user"


def test_a_zone_limit_is_told_only_to_the_right_password(helper: AuthHelper) -> None:
    assert helper.ask(CAROL[0], "wrong") == "ERR wrong password"
    assert helper.ask(*CAROL) == "ERR this user must name one of its zones (-zone-<zone>)"
    assert helper.ask(f"{CAROL[0]}-zone-eu-b", CAROL[1]) == "OK"


def test_an_unknown_name_costs_the_scrypt_check_a_known_one_does(helper: AuthHelper) -> None:
    # An empty password is refused before any check: the helper is up, nothing hashed yet.
    assert helper.ask("zed", "") == "ERR unknown user"
    before = status_value(helper.process.pid, "VmHWM")

    assert helper.ask("zed", "a guess") == "ERR unknown user"

    # Most of it: pages the process had resident already (a few KiB of the
    # allocator's) are no new peak. Without the check it grows by nothing.
    assert status_value(helper.process.pid, "VmHWM") - before >= SCRYPT_KIB * 3 // 4
