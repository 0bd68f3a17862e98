"""A gateway whose membership changes without end, in a process a test can SIGKILL.

    python -m tests.helpers.changing_gateway STATE_DIR PORT < settings-and-members.json

The input is one JSON object: `settings` (ProxySettings' fields, the password
among them, so it never shows in a process list) and `members` (member,
host, port). The gateway starts on all of them, then changes to every member
but the last and back onto all, again and again, printing `applied` after
each change; `squid pid <pid>` and `router pid <pid>` come once it serves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gateway.squid import GatewaySquid
from squid.conf import ProxySettings
from squid.gateway import GatewayMember


def main(argv: list[str]) -> int:
    state_dir, port = Path(argv[1]), int(argv[2])
    given = json.loads(sys.stdin.readline())
    settings = ProxySettings(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in given["settings"].items()}
    )
    members = [GatewayMember(*member) for member in given["members"]]
    squid = GatewaySquid(settings, state_dir, ("127.0.0.1", port))
    squid.start(members)
    assert squid.process is not None and squid.router_process is not None
    print(f"squid pid {squid.process.pid}", flush=True)
    print(f"router pid {squid.router_process.pid}", flush=True)
    while True:
        for change in (members[:-1], members):
            squid.apply(change)
            print("applied", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
