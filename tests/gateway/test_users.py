"""The users file and `python -m gateway.users hash`: hashes that verify, bad lines named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.users import (
    MAX_TUNNELS,
    SCRYPT_N,
    SCRYPT_R,
    Checker,
    UsersFileError,
    Verdict,
    hash_password,
    parse_users,
    unknown_user_hash,
    verify,
)

ROOT = Path(__file__).resolve().parents[2]
HASH = hash_password("pw")


def test_the_cli_prints_a_line_whose_hash_verifies_the_password() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.users", "hash", "alice"],
        input="s3cret pass\n",
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    line = result.stdout.strip()
    assert "s3cret" not in line
    users = parse_users(line, "users", "proxy")
    assert verify("s3cret pass", users["alice"].hash)
    assert not verify("s3cret pass ", users["alice"].hash)
    assert not verify("", users["alice"].hash)
    assert users["alice"].zones is None


@pytest.mark.parametrize(
    ("argv", "stdin", "expected"),
    [
        (["hash"], "", "usage"),
        (["hash", "al-ice"], "pw\n", "NAME: 'al-ice'"),
        (["hash", "alice"], "\n", "the password must be 1 to"),
    ],
)
def test_the_cli_names_what_is_wrong(argv: list[str], stdin: str, expected: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.users", *argv],
        input=stdin,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and expected in result.stderr
    assert "Traceback" not in result.stderr


def test_two_hashes_of_one_password_differ() -> None:
    assert hash_password("pw") != hash_password("pw")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("alice\n", "line 1: not `name:hash`"),
        ("al-ice:x\n", "line 1: not `name:hash`"),
        ("proxy:" + "x" * 10 + "\n", "line 1: 'proxy' is (the start of) the fleet's username"),
        ("alice:plain-password\n", "line 1: the hash is not one"),
        ("alice:\n", "line 1: the hash is not one"),
        (f"alice:{HASH} country=fr\n", "line 1: 'country' is not a limit"),
        (f"alice:{HASH} zones=\n", "line 1: zones= takes zone names"),
        (f"alice:{HASH} zones=a,,b\n", "line 1: zones= takes zone names"),
        (f"alice:{HASH} zones=a zones=b\n", "line 1: zones= given twice"),
        *(
            (f"alice:{HASH} tunnels={value}\n", "line 1: tunnels= takes a whole number")
            # Nothing, zero, negative, signed, not whole, not decimal, over MAX_TUNNELS,
            # huge, what int() alone would take (underscores, another script's digits).
            for value in [
                *("", "0", "-1", "+3", "1.5", "2e3", "0x10", "two", "100001"),
                *("9" * 40, "1_000", "\u0663", "000000"),
            ]
        ),
        (f"alice:{HASH} tunnels=2 tunnels=3\n", "line 1: tunnels= given twice"),
        ("alice:scrypt$1073741824$8$1$00112233445566778899aabbccddeeff$" + "00" * 32, "line 1"),
    ],
)
def test_bad_lines_are_named_without_their_text(text: str, expected: str) -> None:
    with pytest.raises(UsersFileError) as caught:
        parse_users(f"# ok\n\n{text}".replace("line 1", "line 3"), "users", "proxy")
    assert expected.replace("line 1", "line 3") in str(caught.value)
    assert "plain-password" not in str(caught.value)


def test_a_repeated_name_is_named() -> None:
    line = f"alice:{hash_password('pw')}"
    with pytest.raises(UsersFileError, match="line 2: 'alice' again"):
        parse_users(f"{line}\n{line}\n", "users", "proxy")


def test_a_zones_limit_is_read() -> None:
    users = parse_users(f"alice:{HASH}  zones=europe-west1-b,us-east1-c\n", "users", "proxy")
    assert users["alice"].zones == {"europe-west1-b", "us-east1-c"}


def test_a_tunnels_limit_is_read_beside_zones() -> None:
    users = parse_users(
        f"alice:{HASH} tunnels=1 zones=eu-b\nbob:{HASH} tunnels={MAX_TUNNELS}\ncarol:{HASH}\n",
        "users",
        "proxy",
    )
    assert (users["alice"].tunnels, users["alice"].zones) == (1, {"eu-b"})
    assert users["bob"].tunnels == MAX_TUNNELS
    assert users["carol"].tunnels is None


def test_the_unknown_users_hash_costs_what_hash_password_costs_and_matches_nothing() -> None:
    made = hash_password("pw").split("$")
    unknown = unknown_user_hash(()).split("$")
    # The scheme, N, r and p, and a salt and key of the same lengths.
    assert unknown[:4] == made[:4]
    assert [len(f) for f in unknown[4:]] == [len(f) for f in made[4:]]
    assert not any(verify(guess, "$".join(unknown)) for guess in ("", "pw", "password"))


def test_the_unknown_users_hash_costs_what_most_of_the_files_hashes_cost() -> None:
    cheaper = "scrypt$1024$8$1$00112233445566778899aabbccddeeff$" + "00" * 32
    users = parse_users(f"a:{cheaper}\nb:{cheaper}\nc:{HASH}\n", "users", "proxy")
    assert unknown_user_hash(users.values()).split("$")[1:4] == ["1024", "8", "1"]


ALICE, CAROL = ("alice", "alice-password-1"), ("carol", "carol password 3")


@pytest.fixture
def checker(tmp_path: Path) -> Checker:
    users = tmp_path / "users"
    users.write_text(
        f"{ALICE[0]}:{hash_password(ALICE[1])}\n{CAROL[0]}:{hash_password(CAROL[1])} zones=eu-b\n"
    )
    return Checker("fleet", "fleet-password", str(users))


def test_each_kind_of_username_gets_its_verdict(checker: Checker) -> None:
    assert checker.check("fleet-session-s1", "fleet-password") == Verdict("fleet")
    assert checker.check("fleet", "wrong") == Verdict(None, refusal="wrong password")
    assert checker.check(*ALICE) == Verdict("alice")
    assert checker.check(f"{ALICE[0]}-session-s1", ALICE[1]) == Verdict("alice")
    assert checker.check(ALICE[0], "wrong") == Verdict(None, refusal="wrong password")
    # Names of no account, and forms no account has, are no user's: the router refuses them.
    assert checker.check("zed", ALICE[1]) is None
    assert checker.check("zed-session-s1", "anything") is None
    assert checker.check(f"{ALICE[0]}-nonsense", ALICE[1]) is None


def test_a_zone_limit_is_told_only_to_the_right_password(checker: Checker) -> None:
    assert checker.check(CAROL[0], "wrong") == Verdict(None, refusal="wrong password")
    zones = "this user must name one of its zones (-zone-<zone>)"
    assert checker.check(*CAROL) == Verdict(None, refusal=zones)
    assert checker.check(f"{CAROL[0]}-zone-eu-b", CAROL[1]) == Verdict("carol")


def test_an_unknown_name_costs_the_scrypt_check_a_known_one_does(tmp_path: Path) -> None:
    """Seen as scrypt's memory in a process of its own: how long it takes is bench.auth's."""
    users = tmp_path / "users"
    users.write_text(f"{ALICE[0]}:{hash_password(ALICE[1])}\n")
    # The checker hashes the fleet's password at start: the peak is reset after
    # (writing 5 to clear_refs, Linux 4.0 on) so the refusal's own shows.
    probe = (
        "import sys; from gateway.users import Checker; from tests.helpers.procfs import "
        "status_value; import os; c = Checker('fleet', 'pw', sys.argv[1]); c.check('zed', ''); "
        "open('/proc/self/clear_refs', 'w').write('5'); "
        "before = status_value(os.getpid(), 'VmHWM'); c.check('zed', 'a guess'); "
        "print(status_value(os.getpid(), 'VmHWM') - before)"
    )
    grown = subprocess.run(
        [sys.executable, "-c", probe, str(users)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    # Most of it: pages the process had resident already are no new peak.
    assert int(grown) >= 128 * SCRYPT_N * SCRYPT_R // 1024 * 3 // 4
