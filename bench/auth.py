"""The gateway's credentials check: how long a refusal takes, with and without an account.

    python -m bench.auth [--checks 30]

The router's checker (gateway/users.py `Checker`, as the router runs it, in
this process) over a users file of 3 accounts and the fleet's credentials.
`--checks` times each, interleaved so all three see the same machine, with a
fresh wrong password every time (a repeated one is answered from memory):
a users-file account, a name with no account, and the fleet's own username.
Prints p50 and p99 of each and the ratio of a name without an account to one
with: near 1 means a refusal's time does not say whether an account exists.

Asserts nothing: the figures feed docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import secrets
import tempfile
import time
from pathlib import Path

from bench.stats import percentile
from gateway.users import Checker, hash_password
from tests.helpers.config import PASSWORD, USERNAME

ACCOUNTS = ("alice", "bob", "carol")
NAMES = {
    "users-file account": "alice",
    "no such account": "zed",
    "the fleet's username": USERNAME,
}


def refusal_ms(checker: Checker, username: str) -> float:
    """Milliseconds for the checker to refuse `username` with a password never tried before."""
    start = time.perf_counter()
    verdict = checker.check(username, secrets.token_hex(8))
    took = (time.perf_counter() - start) * 1000
    if verdict is not None and verdict.account is not None:
        raise RuntimeError(f"{username}: a random password was let in")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checks", type=int, default=30)
    args = parser.parse_args()
    users = "".join(f"{name}:{hash_password(secrets.token_hex(8))}\n" for name in ACCOUNTS)
    times: dict[str, list[float]] = {kind: [] for kind in NAMES}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "users"
        path.write_text(users)
        checker = Checker(USERNAME, PASSWORD, str(path))
        for _ in range(args.checks):
            for kind, username in NAMES.items():
                times[kind].append(refusal_ms(checker, username))
    print(f"\ncredentials refusals, wrong password, {args.checks} of each interleaved")
    print(f"{'username':<22} {'p50 ms':>8} {'p99 ms':>8}")
    for kind, measured in times.items():
        print(f"{kind:<22} {percentile(measured, 50):>8.1f} {percentile(measured, 99):>8.1f}")
    known, unknown = (percentile(times[kind], 50) for kind in list(NAMES)[:2])
    print(f"p50 ratio no account / account: {unknown / known:.2f}")


if __name__ == "__main__":
    main()
