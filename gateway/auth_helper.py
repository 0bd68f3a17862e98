"""Squid's basic-auth helper for the gateway: every username form checks USER's password.

    auth_param basic program <python> auth_helper.py USER /usr/lib/squid/basic_ncsa_auth HTPASSWD

Squid writes one `username password` line per check, both %-encoded, and
reads one answer line (`OK` or `ERR ...`). Every form of
`providers.squid.parse_gateway_username` (`USER`, with routing filters, a
session or a pin) is passed on to the wrapped helper as `USER password`,
so the password is verified by Squid's own `basic_ncsa_auth` against the
htpasswd the renderer wrote, whatever hash it uses; any other username is
refused without asking it. Squid keeps the full username for its ACLs: that
is what routes the request.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

# Run by Squid as a script: the repository (or site-packages) root holds providers/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from providers.squid import gateway_account


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: auth_helper.py USER HELPER [ARGS...]", file=sys.stderr)
        return 2
    user, wrapped = argv[1], argv[2:]
    checker = subprocess.Popen(
        wrapped, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert checker.stdin is not None and checker.stdout is not None
    for line in sys.stdin:
        username, _, password = line.rstrip("\n").partition(" ")
        account = gateway_account(unquote(username), user)
        if account is None or not password:
            answer = "ERR unknown user"
        else:
            checker.stdin.write(f"{account} {password}\n")
            answer = checker.stdout.readline().rstrip("\n")
            if not answer:
                return 1  # the wrapped helper died: Squid starts a new one of us
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()
    checker.stdin.close()
    return checker.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
