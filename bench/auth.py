"""The router's users-file check: how long a refusal takes, for a name with and without an account.

    python -m bench.auth [--checks 30]

The check the gateway's router runs (gateway/users.py, `Checker`, over a
users file of 3 accounts, as the router reads it). `--checks` times each
kind, interleaved so both see the same machine, with a fresh wrong password
every time (a right one is answered from memory): a users-file account, and
a name with no account. Prints p50 and p99 of each and the ratio of a name
without an account to one with: near 1 means a refusal's time does not say
whether an account exists. The fleet's own username is not timed: the
router compares its password in constant time, with no hash.

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
from tests.helpers.config import USERNAME

ACCOUNTS = ("alice", "bob", "carol")
NAMES = {
    "users-file account": "alice",
    "no such account": "zed",
}


def refusal_ms(checker: Checker, username: str) -> float:
    """Milliseconds for the check to refuse `username` with a password never tried before."""
    start = time.perf_counter()
    verdict = checker.check(username, secrets.token_hex(8))
    took = (time.perf_counter() - start) * 1000
    if verdict is not None and verdict.account is not None:
        raise RuntimeError(f"{username}: a random password was let in: {verdict}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checks", type=int, default=30)
    args = parser.parse_args()
    times: dict[str, list[float]] = {kind: [] for kind in NAMES}
    with tempfile.TemporaryDirectory(prefix="bench-auth-") as directory:
        users = Path(directory) / "users"
        users.write_text(
            "".join(f"{name}:{hash_password(secrets.token_hex(8))}\n" for name in ACCOUNTS)
        )
        checker = Checker(str(users), USERNAME)
        for _ in range(args.checks):
            for kind, username in NAMES.items():
                times[kind].append(refusal_ms(checker, username))
    print(f"\nusers-file refusals, wrong password, {args.checks} of each interleaved")
    print(f"{'username':<22} {'p50 ms':>8} {'p99 ms':>8}")
    for kind, measured in times.items():
        print(f"{kind:<22} {percentile(measured, 50):>8.1f} {percentile(measured, 99):>8.1f}")
    known, unknown = (percentile(times[kind], 50) for kind in NAMES)
    print(f"p50 ratio no account / account: {unknown / known:.2f}")


if __name__ == "__main__":
    main()
