"""The gateway's auth helper: how long a refusal takes, for a name with and without an account.

    python -m bench.auth [--checks 30]

One real auth helper (gateway/auth_helper.py, as Squid runs it: the fleet's
username going on to `basic_ncsa_auth`) over a users file of 3 accounts.
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
import time

from bench.stats import percentile
from gateway.users import hash_password
from tests.helpers.auth_helper import AuthHelper, auth_helper
from tests.helpers.config import USERNAME

ACCOUNTS = ("alice", "bob", "carol")
NAMES = {
    "users-file account": "alice",
    "no such account": "zed",
    "the fleet's username": USERNAME,
}


def refusal_ms(helper: AuthHelper, username: str) -> float:
    """Milliseconds for the helper to refuse `username` with a password never tried before."""
    start = time.perf_counter()
    answer = helper.ask(username, secrets.token_hex(8))
    took = (time.perf_counter() - start) * 1000
    if not answer.startswith("ERR"):
        raise RuntimeError(f"{username}: a random password was answered {answer!r}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checks", type=int, default=30)
    args = parser.parse_args()
    users = "".join(f"{name}:{hash_password(secrets.token_hex(8))}\n" for name in ACCOUNTS)
    times: dict[str, list[float]] = {kind: [] for kind in NAMES}
    with auth_helper(users) as helper:
        for _ in range(args.checks):
            for kind, username in NAMES.items():
                times[kind].append(refusal_ms(helper, username))
    print(f"\nauth helper refusals, wrong password, {args.checks} of each interleaved")
    print(f"{'username':<22} {'p50 ms':>8} {'p99 ms':>8}")
    for kind, measured in times.items():
        print(f"{kind:<22} {percentile(measured, 50):>8.1f} {percentile(measured, 99):>8.1f}")
    known, unknown = (percentile(times[kind], 50) for kind in list(NAMES)[:2])
    print(f"p50 ratio no account / account: {unknown / known:.2f}")


if __name__ == "__main__":
    main()
