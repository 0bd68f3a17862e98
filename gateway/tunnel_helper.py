"""Squid's external ACL helper that holds each users-file user to its `tunnels=` limit.

    external_acl_type gateway_tunnels ttl=0 negative_ttl=0 %ul %>a %>p %>la %>lp \\
        <python> tunnel_helper.py USER USERS_FILE LEDGER

Squid has no limit on one user's connections (`maxconn` counts a client
address's, `max_user_ip` a user's addresses), so the back workers ask this
helper about every CONNECT of a user whose line has `tunnels=N` (the auth
helper marks those users' requests with TUNNEL_LIMIT_NOTE; others never
reach it). Squid writes `username client-address client-port local-address
local-port`, %-encoded; the client is the front worker, whose connection to
the back carries exactly one tunnel and lives as long as it. The helper
answers `OK` (a slot: the tunnel is recorded) or `ERR message=...` (the user
holds N tunnels already; the back answers TUNNEL_LIMIT_STATUS).

What it admitted is kept in LEDGER, `account local-end remote-end` a line
(each end as the kernel's socket table writes it), shared by the helpers of
both backs under an exclusive lock (flock) and kept across a back's reload
(which restarts its helpers). A tunnel holds its slot while its connection is
ESTABLISHED in the kernel's socket table (gateway/socket_table.py); at each
check, those that closed are dropped. The limit is read from the users file
as it is at each check, so a lowered limit refuses new tunnels at once and
closes none. Passwords never reach this helper.

Standard library only: Squid runs it under its own user with whatever
python3 the system has, from the gateway's directory (gateway/squid.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

# Run by Squid as a script: the gateway's helper directory holds gateway/ and providers/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.socket_table import (
    TCP_TABLES,
    Connection,
    as_written,
    established_as_written,
    unmapped,
)
from gateway.users import FollowedUsers
from providers.squid import TUNNEL_REFUSED_NOTE

# An admitted tunnel: the account, and its connection's (local, remote) ends as
# the kernel's socket table writes them (gateway/socket_table.as_written).
Entry = tuple[str, tuple[str, str]]
FIELDS = 5  # %ul %>a %>p %>la %>lp


class Ledger:
    """The tunnels admitted so far, in a file the helpers of both backs share."""

    def __init__(self, path: str) -> None:
        self._path = path

    def admit(self, account: str, connection: tuple[str, str], limit: int) -> int | None:
        """Record `connection` (as written) as one of `account`'s tunnels and return None
        if the account holds fewer than `limit` open ones; else how many (nothing recorded)."""
        with self._locked() as fd:
            entries = _parse(os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace"))
            live = established_as_written()
            # A connection carries one tunnel: an entry of the same connection is a
            # closed one whose ports the kernel gave again, or this same request.
            kept = [(a, c) for a, c in entries if c in live and c != connection]
            held = sum(1 for a, _ in kept if a == account)
            admitted = held < limit
            if admitted:
                kept.append((account, connection))
            if kept != entries:
                text = "".join(f"{a} {local} {remote}\n" for a, (local, remote) in kept)
                os.ftruncate(fd, 0)
                os.pwrite(fd, text.encode(), 0)
        return None if admitted else held

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # and the lock with it


def _parse(text: str) -> list[Entry]:
    """The ledger's entries; a line a killed helper left half written is dropped (and
    one that is no connection is never found open, so goes at the next write)."""
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3:
            entries.append((fields[0], (fields[1], fields[2])))
    return entries


def _connection(fields: list[str]) -> Connection | None:
    """`local-address local-port remote-address remote-port` as a Connection, or None."""
    try:
        local, remote = (unmapped(ipaddress.ip_address(fields[i])) for i in (0, 2))
        local_port, remote_port = int(fields[1]), int(fields[3])
    except ValueError:
        return None
    if not (0 < local_port < 65536 and 0 < remote_port < 65536):
        return None
    return local, local_port, remote, remote_port


def answer(line: str, users: FollowedUsers, ledger: Ledger) -> str:
    """Squid's answer to one request line: OK (a slot, or no limit), ERR (the limit), BH."""
    # Squid appends the ACL's arguments (%DATA): "-", as the ACL has none.
    fields = [unquote(field) for field in line.split()[:FIELDS]]
    if len(fields) != FIELDS:
        return _result("BH", "the gateway's tunnel helper got a malformed request")
    username, remote, remote_port, local, local_port = fields
    connection = _connection([local, local_port, remote, remote_port])
    if connection is None:
        return _result("BH", "the gateway's tunnel helper got no connection")
    users.refresh()
    account = username.partition("-")[0]
    user = users.users.get(account)
    if user is None or user.tunnels is None:
        return "OK"  # no limit (any more)
    held = ledger.admit(account, as_written(connection), user.tunnels)
    if held is None:
        return "OK"
    tunnels = "tunnel" if held == 1 else "tunnels"
    return _result(
        "ERR", f"{account} holds {held} open {tunnels}, its limit is tunnels={user.tunnels}"
    )


def _result(code: str, message: str) -> str:
    """A result whose message goes to Squid's error page (%o) and, as a note, to the
    backs' TUNNEL_REFUSED_HEADER: no `"`, `\\`, CR nor LF in it."""
    return f'{code} message="{message}" {TUNNEL_REFUSED_NOTE}="{message}"'


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: tunnel_helper.py USER USERS_FILE LEDGER", file=sys.stderr)
        return 2
    if not os.access(TCP_TABLES[0], os.R_OK):
        # Every tunnel would look closed, and no limit would hold.
        print(f"tunnel_helper: cannot read {TCP_TABLES[0]}", file=sys.stderr)
        return 1
    fleet_user, users_path, ledger_path = argv[1:]
    users, ledger = FollowedUsers(users_path, fleet_user, "tunnel_helper"), Ledger(ledger_path)
    for line in sys.stdin:
        sys.stdout.write(answer(line, users, ledger) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
