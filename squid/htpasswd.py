"""The htpasswd's hash: SHA-512-crypt, which Squid's `basic_ncsa_auth` verifies.

Every proxy's htpasswd (squid/conf.py) holds one line, its username and
this hash of the password; the password itself is never written anywhere
Squid reads.
"""

from __future__ import annotations

import hashlib
import secrets

_ITOA64 = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
SHA512_CRYPT_ROUNDS = 20_000
# What a setting without `rounds=` means.
SHA512_CRYPT_DEFAULT_ROUNDS = 5000
_SALT_CHARS = 16
# The order in which SHA-crypt's spec spreads the 64 digest bytes over the
# 86 output characters: 21 groups of three, rotated by one each time, then byte 63.
_SHA512_ORDER = [(i, i + 21, i + 42)[i % 3 :] + (i, i + 21, i + 42)[: i % 3] for i in range(21)]


def sha512_crypt(password: str, setting: str | None = None) -> str:
    """SHA-512-crypt (`$6$`), as specified at https://www.akkadia.org/drepper/SHA-crypt.txt.

    `basic_ncsa_auth` hands the hash to crypt(3), which on Debian and Ubuntu
    (glibc, libxcrypt) verifies `$6$`. Written out here because Python's
    `crypt` module is deprecated and gone in 3.13; the spec's test vectors
    hold it to the C implementation (tests/squid/test_conf.py).

    Like crypt(3), `setting` is `$6$[rounds=N$]salt`, or a whole hash to check
    a password against (`sha512_crypt(pw, hashed) == hashed`); None draws a
    fresh 16-character salt and SHA512_CRYPT_ROUNDS. Each round is a SHA-512
    pass: 20,000 is four times glibc's default, and costs Squid's helper a few
    milliseconds once per credentials TTL.
    """
    if setting is None:
        salt = "".join(secrets.choice(_ITOA64) for _ in range(_SALT_CHARS))
        rounds: int | None = SHA512_CRYPT_ROUNDS
    else:
        salt, rounds = _parse_setting(setting)
    pw = password.encode()
    salt_b = salt.encode()[:_SALT_CHARS]

    def repeated(block: bytes, length: int) -> bytes:
        return (block * (length // len(block) + 1))[:length]

    alternate = hashlib.sha512(pw + salt_b + pw).digest()
    ctx = hashlib.sha512(pw + salt_b + repeated(alternate, len(pw)))
    n = len(pw)
    while n:
        ctx.update(alternate if n & 1 else pw)
        n >>= 1
    digest = ctx.digest()
    p_bytes = repeated(hashlib.sha512(pw * len(pw)).digest(), len(pw))
    s_bytes = repeated(hashlib.sha512(salt_b * (16 + digest[0])).digest(), len(salt_b))

    for rnd in range(rounds or SHA512_CRYPT_DEFAULT_ROUNDS):
        step = p_bytes if rnd & 1 else digest
        if rnd % 3:
            step += s_bytes
        if rnd % 7:
            step += p_bytes
        step += digest if rnd & 1 else p_bytes
        digest = hashlib.sha512(step).digest()

    encoded = "".join(
        _to64((digest[a] << 16) | (digest[b] << 8) | digest[c], 4) for a, b, c in _SHA512_ORDER
    )
    encoded += _to64(digest[63], 2)
    # A setting without `rounds=` gets a hash without it, as in crypt(3).
    spec = "" if rounds is None else f"rounds={rounds}$"
    return f"$6${spec}{salt_b.decode()}${encoded}"


def _parse_setting(setting: str) -> tuple[str, int | None]:
    """The salt and rounds (None: not given, the default) of `$6$[rounds=N$]salt[$hash]`."""
    if not setting.startswith("$6$"):
        raise ValueError("a sha512-crypt setting starts with $6$")
    rest = setting.removeprefix("$6$")
    if not rest.startswith("rounds="):
        return rest.partition("$")[0], None
    count, _, rest = rest.removeprefix("rounds=").partition("$")
    if not count.isdigit() or not 1000 <= int(count) <= 999_999_999:
        raise ValueError(f"sha512-crypt rounds must be 1000..999999999, not {count!r}")
    return rest.partition("$")[0], int(count)


def _to64(value: int, count: int) -> str:
    out = ""
    for _ in range(count):
        out += _ITOA64[value & 0x3F]
        value >>= 6
    return out
