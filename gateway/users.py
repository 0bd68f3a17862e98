"""The gateway's client credentials beyond the fleet's own: a users file of hashed passwords.

    # one user a line: name:hash (from `python -m gateway.users hash NAME`),
    # then optional limits: zones=<zone>,<zone> (each username must name one),
    # tunnels=<n> (at most n tunnels open at once, counted by gateway/router.py)
    alice:scrypt$16384$8$1$<salt, hex>$<key, hex>
    carol:scrypt$16384$8$1$<salt, hex>$<key, hex> zones=europe-west1-b tunnels=20

A name is 1 to 64 of `A-Z a-z 0-9 . _` (no `-`: the routing grammar's
separator) and not the fleet's own username, which keeps working beside
them. Each user's username forms are the fleet user's (`alice`,
`alice-session-<key>`, `alice-zone-<zone>-proxy-<member>`, ...), checked
against alice's hash. Passwords are hashed with scrypt (hashlib, a salt of
SALT_BYTES per user, SCRYPT_N/R/P); a check compares in constant time, and
a name that is none of the file's is checked against a hash as costly
(`unknown_user_hash`), so how long a refusal takes does not say whether
an account exists.

The gateway reads the file at start and follows it (its copy in the state
directory is what the router reads, at each check: `Checker`).
Standard library only: the router imports this module under Squid's user,
with whatever python3 the system has.
"""

from __future__ import annotations

import getpass
import hashlib
import hmac
import os
import re
import secrets
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from proxy_operator.username import parse_gateway_username

SCHEME = "scrypt"
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
# The bounds a hash in the file may ask for: a line must not make a check cost
# more than this (memory is 128 * N * R bytes) nor be too weak to mean anything.
MAX_N, MIN_N = 2**17, 2**10
SALT_BYTES = 16
KEY_BYTES = 32
NAME = re.compile(r"^[A-Za-z0-9._]{1,64}$")
ZONE = re.compile(r"^[A-Za-z0-9._~+=-]{1,64}$")
MAX_PASSWORD = 1024
# The most tunnels= may allow: more than a gateway holds, less than would
# make a typo (an extra digit or two) pass for a limit.
MAX_TUNNELS = 100_000
TUNNELS = re.compile(r"^[0-9]{1,6}$")
MAX_USERS_BYTES = 4 << 20


class UsersFileError(Exception):
    """The users file cannot be read, or a line is not `name:hash` (named by number)."""


def hash_password(password: str) -> str:
    """A users-file hash of `password`, with a fresh salt."""
    salt = secrets.token_bytes(SALT_BYTES)
    key = _scrypt(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    return f"{SCHEME}${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${key.hex()}"


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(
        password.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * n * r, dklen=KEY_BYTES
    )


def _parts(encoded: str) -> tuple[int, int, int, bytes, bytes] | None:
    fields = encoded.split("$")
    if len(fields) != 6 or fields[0] != SCHEME:
        return None
    try:
        n, r, p = int(fields[1]), int(fields[2]), int(fields[3])
        salt, key = bytes.fromhex(fields[4]), bytes.fromhex(fields[5])
    except ValueError:
        return None
    if n & (n - 1) or not MIN_N <= n <= MAX_N or not 1 <= r <= 16 or not 1 <= p <= 4:
        return None
    if len(salt) < 8 or len(key) != KEY_BYTES:
        return None
    return n, r, p, salt, key


def verify(password: str, encoded: str) -> bool:
    """Whether `password` is the one `encoded` was made from (constant-time compare)."""
    parts = _parts(encoded)
    if parts is None or len(password) > MAX_PASSWORD:
        return False
    n, r, p, salt, key = parts
    return hmac.compare_digest(_scrypt(password, salt, n, r, p), key)


@dataclass(frozen=True)
class User:
    """One line of the users file: the password's hash, the zones the user may use
    (None: any; else every username of theirs must name one, `-zone-<zone>`), and
    how many tunnels it may hold open at once (None: no limit)."""

    hash: str
    zones: frozenset[str] | None = None
    tunnels: int | None = None


def unknown_user_hash(users: Iterable[User]) -> str:
    """A hash no password verifies, as costly to check as the users' own.

    Checked for a name that is none of the file's, so that an unknown name
    takes as long to refuse as a known one with a wrong password: the
    scrypt parameters most of the users' hashes have (hash_password's when
    there are none), a salt as long as hash_password's, and a random key,
    which no password's key matches but by a 2**-256 chance.
    """
    costs = Counter(parts[:3] for user in users if (parts := _parts(user.hash)) is not None)
    n, r, p = costs.most_common(1)[0][0] if costs else (SCRYPT_N, SCRYPT_R, SCRYPT_P)
    salt, key = secrets.token_bytes(SALT_BYTES), secrets.token_bytes(KEY_BYTES)
    return f"{SCHEME}${n}${r}${p}${salt.hex()}${key.hex()}"


def parse_users(text: str, source: str, fleet_user: str) -> dict[str, User]:
    """Name -> User for each line of a users file; UsersFileError naming each bad line.

    A bad line is named by its number only: it may hold a hash, or a
    password typed where a hash belongs.
    """
    users: dict[str, User] = {}
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, rest = line.partition(":")
        words = rest.split()
        encoded, limits = (words[0] if words else ""), words[1:]
        zones, tunnels, bad_limit = _limits(limits)
        if not sep or not NAME.fullmatch(name):
            problems.append(f"line {number}: not `name:hash` with a name of A-Z a-z 0-9 . _")
        elif name in (fleet_user, fleet_user.partition("-")[0]):
            # The fleet's `my-proxy-...` usernames would read as a user `my`'s.
            problems.append(f"line {number}: {name!r} is (the start of) the fleet's username")
        elif name in users:
            problems.append(f"line {number}: {name!r} again")
        elif _parts(encoded) is None:
            problems.append(
                f"line {number}: the hash is not one `python -m gateway.users hash` makes"
            )
        elif bad_limit:
            problems.append(f"line {number}: {bad_limit}")
        else:
            users[name] = User(encoded, zones, tunnels)
    if problems:
        raise UsersFileError(f"{source}: {'; '.join(problems)}")
    return users


def _limits(words: list[str]) -> tuple[frozenset[str] | None, int | None, str]:
    """The zones= and tunnels= limits among a line's words after the hash, and what is
    wrong with them (the first problem, naming its field; never the value)."""
    zones: frozenset[str] | None = None
    tunnels: int | None = None
    seen: set[str] = set()
    for word in words:
        key, _, value = word.partition("=")
        if key not in LIMIT_PROBLEMS:
            return None, None, f"{key[:20]!r} is not a limit (zones=<zone>,<zone>, tunnels=<n>)"
        if key in seen:
            return None, None, f"{key}= given twice"
        seen.add(key)
        if key == "zones":
            zones = _zones(value)
            bad = zones is None
        else:
            tunnels = _tunnels(value)
            bad = tunnels is None
        if bad:
            return None, None, LIMIT_PROBLEMS[key]
    return zones, tunnels, ""


def _zones(value: str) -> frozenset[str] | None:
    names = value.split(",")
    return frozenset(names) if all(ZONE.fullmatch(zone) for zone in names) else None


def _tunnels(value: str) -> int | None:
    # Digits only: int() would also take "+3", " 3", "1_000" and other scripts' digits.
    if not TUNNELS.fullmatch(value) or not 1 <= int(value) <= MAX_TUNNELS:
        return None
    return int(value)


LIMIT_PROBLEMS = {
    "zones": "zones= takes zone names (1 to 64 of A-Z a-z 0-9 . _ ~ + = -), commas between",
    "tunnels": f"tunnels= takes a whole number of tunnels from 1 to {MAX_TUNNELS}",
}


def read_users(path: str, fleet_user: str) -> dict[str, User]:
    """The users of the file at `path`; UsersFileError naming what is wrong."""
    return parse_users(read_users_text(path), path, fleet_user)


class FollowedUsers:
    """The users of a file that the router reads as the gateway replaces it.

    `refresh` reads it again when its inode, size or mtime changed (the
    gateway replaces it atomically, never removes it); a version that does
    not parse is reported on stderr (the router's router.err) and the users
    read before stay.
    """

    def __init__(self, path: str, fleet_user: str, reader: str) -> None:
        self._path, self._fleet, self._reader = path, fleet_user, reader
        self._signature: tuple[int, int, int, int] | None = None
        self.users: dict[str, User] = {}

    def refresh(self) -> bool:
        """Read the file again if it changed; whether `users` did."""
        try:
            st = os.stat(self._path)
        except OSError:
            return False  # keep what was read
        signature = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)
        if signature == self._signature:
            return False
        try:
            self.users = read_users(self._path, self._fleet)
        except UsersFileError as err:
            print(f"{self._reader}: keeping the users read before: {err}", file=sys.stderr)
            return False
        self._signature = signature
        return True


@dataclass(frozen=True)
class Verdict:
    """What a username and password were found to be: the account they log in as (None:
    refused, for `refusal`) and how many tunnels it may hold (None: no limit)."""

    account: str | None
    tunnels: int | None = None
    refusal: str = ""


# Answers remembered per (user, password digest) until the file changes: a
# scrypt check costs tens of milliseconds, and a crawl asks with the same
# few credentials all day.
MAX_REMEMBERED = 10_000


class Checker:
    """Every account's credentials: the fleet's, and the users file's followed as it changes.

    The fleet's password is checked as a users-file password is, against a
    scrypt hash of it made at start, so how long a refusal takes says
    neither whether a name has an account nor which name is the fleet's.
    """

    def __init__(self, fleet_user: str, fleet_password: str, path: str | None) -> None:
        self._fleet_user = fleet_user
        self._fleet = User(hash_password(fleet_password))
        self._file = FollowedUsers(path, fleet_user, "router") if path else None
        self._right: set[tuple[str, bytes]] = set()
        self._unknown = unknown_user_hash([self._fleet])

    def check(self, username: str, password: str) -> Verdict | None:
        """The verdict on `username` with `password`, or None if it is no account's username.

        Every username costs one scrypt check of its password, against its
        account's hash or `unknown_user_hash`, unless the same account's
        same password was found right before: a made-up name takes as long
        to refuse as a real one, and only right answers are remembered, so
        no flood of made-up names pushes an account's out.
        """
        if self._file is not None and self._file.refresh():
            self._right.clear()
            self._unknown = unknown_user_hash([self._fleet, *self._file.users.values()])
        if not password:
            return None  # refused unchecked: no password is no one's
        user: User | None
        if parse_gateway_username(username, self._fleet_user) is not None:
            account, user = self._fleet_user, self._fleet
        else:
            account = username.partition("-")[0]
            user = self._file.users.get(account) if self._file is not None else None
        key = (account, hashlib.sha256(password.encode()).digest())
        if key not in self._right:
            right = verify(password, self._unknown if user is None else user.hash)
            if right and user is not None:
                if len(self._right) >= MAX_REMEMBERED:
                    self._right.clear()
                self._right.add(key)
        parsed = parse_gateway_username(username, account) if user else None
        if user is None or parsed is None:
            return None
        if key not in self._right:
            return Verdict(None, refusal="wrong password")
        if user.zones is not None and parsed.filters.get("zone") not in user.zones:
            return Verdict(None, refusal="this user must name one of its zones (-zone-<zone>)")
        return Verdict(account, user.tunnels)


def read_users_text(path: str) -> str:
    try:
        return read_small_text(path, MAX_USERS_BYTES)
    except ValueError as err:
        raise UsersFileError(str(err)) from None


def read_small_text(path: str, limit: int) -> str:
    """A UTF-8 file of at most `limit` bytes (the gateway's tokens and users files);
    ValueError saying why not, with its path."""
    try:
        with open(path, "rb") as file:
            data = file.read(limit + 1)
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err}") from None
    if len(data) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def main(argv: list[str]) -> int:
    """`python -m gateway.users hash NAME`: the users-file line for NAME.

    The password comes from standard input (its first line), or is asked
    for twice at a terminal; it is never an argument (which `ps` would show).
    """
    if len(argv) != 3 or argv[1] != "hash":
        print("usage: python -m gateway.users hash NAME  (password on stdin)", file=sys.stderr)
        return 2
    name = argv[2]
    if not NAME.fullmatch(name):
        print(f"error: NAME: {name!r} is not 1 to 64 of A-Z a-z 0-9 . _", file=sys.stderr)
        return 2
    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {name}: ")
        if getpass.getpass("again: ") != password:
            print("error: the two passwords differ", file=sys.stderr)
            return 2
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password or len(password) > MAX_PASSWORD:
        print(f"error: the password must be 1 to {MAX_PASSWORD} characters", file=sys.stderr)
        return 2
    print(f"{name}:{hash_password(password)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
