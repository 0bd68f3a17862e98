"""Squid's basic-auth helper for the gateway: every username form checks its account's password.

    auth_param basic program <python> auth_helper.py USER [--users FILE] \\
        /usr/lib/squid/basic_ncsa_auth HTPASSWD

Squid writes one `username password` line per check, both %-encoded, and
reads one answer line (`OK` or `ERR ...`). Every form of
`providers.squid.parse_gateway_username` for the fleet's `USER` (`USER`,
with routing filters, a session or a pin) is passed on to the wrapped helper
as `USER password`, so the password is verified by Squid's own
`basic_ncsa_auth` against the htpasswd the renderer wrote. With `--users`,
the same forms for each user of that file (gateway/users.py) are checked
against the user's scrypt hash here; the file is read again whenever it
changes (the gateway replaces it atomically), so a removed user is refused
and a new one accepted from the next check on, without a reload. Any other
username is refused without asking anyone, but only after checking its
password against a hash as costly as the users' (`unknown_user_hash`): a
name's refusal takes as long whether or not the file has an account of that
name, and the zone limit is looked at only once the password is right.
Squid keeps the full username for its ACLs: that is what routes the request.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

# Run by Squid as a script: the repository (or site-packages) root holds providers/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.users import FollowedUsers, unknown_user_hash, verify
from providers.squid import TUNNEL_LIMIT_NOTE, gateway_account, parse_gateway_username

# Checks remembered per (user, password digest) until the file changes: a
# scrypt check costs tens of milliseconds, and every session key is a
# username of its own that Squid checks again each credentials TTL.
MAX_REMEMBERED = 10_000


class Users:
    """The users file's accounts, followed as it changes, with checks remembered."""

    def __init__(self, path: str, fleet_user: str) -> None:
        self._file = FollowedUsers(path, fleet_user, "auth_helper")
        self._checked: dict[tuple[str, bytes], bool] = {}
        self._unknown = unknown_user_hash(())

    def check(self, username: str, password: str) -> str | None:
        """The answer for a username of the file's users, or None if it is none of theirs.

        Every username costs the same: one scrypt check of its password, a
        user's hash or `unknown_user_hash`, remembered alike; what the check
        found is told only to the names of a user in the file.
        """
        if self._file.refresh():
            self._checked.clear()
            self._unknown = unknown_user_hash(self._file.users.values())
        account = username.partition("-")[0]
        user = self._file.users.get(account)
        key = (account, hashlib.sha256(password.encode()).digest())
        if key not in self._checked:
            if len(self._checked) >= MAX_REMEMBERED:
                self._checked.clear()
            right = verify(password, self._unknown if user is None else user.hash)
            self._checked[key] = right and user is not None
        parsed = parse_gateway_username(username, account) if user else None
        if user is None or parsed is None:
            return None
        if not self._checked[key]:
            return "ERR wrong password"
        if user.zones is not None and parsed.filters.get("zone") not in user.zones:
            return "ERR this user must name one of its zones (-zone-<zone>)"
        # Marks the user's requests for the tunnel helper (gateway/tunnel_helper.py).
        return "OK" if user.tunnels is None else f"OK {TUNNEL_LIMIT_NOTE}={user.tunnels}"


def main(argv: list[str]) -> int:
    args = argv[1:]
    if args[1:2] == ["--users"]:
        user, users_path, wrapped = args[0], args[2] if len(args) > 2 else "", args[3:]
    else:
        user, users_path, wrapped = (args[0] if args else ""), "", args[1:]
    if not user or not wrapped:
        print("usage: auth_helper.py USER [--users FILE] HELPER [ARGS...]", file=sys.stderr)
        return 2
    users = Users(users_path, user) if users_path else None
    checker = subprocess.Popen(
        wrapped, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert checker.stdin is not None and checker.stdout is not None
    for line in sys.stdin:
        username, _, password = line.rstrip("\n").partition(" ")
        name = unquote(username)
        theirs = users.check(name, unquote(password)) if users and password else None
        if theirs is not None:
            answer = theirs
        elif gateway_account(name, user) is None or not password:
            answer = "ERR unknown user"
        else:
            checker.stdin.write(f"{user} {password}\n")
            answer = checker.stdout.readline().rstrip("\n")
            if not answer:
                return 1  # the wrapped helper died: Squid starts a new one of us
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()
    checker.stdin.close()
    return checker.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
