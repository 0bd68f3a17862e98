"""The control API's bearer tokens: read from a file, kept as SHA-256 digests only.

    # one token per line; blank lines and `#` comments are ignored
    3q2+7w...   (at least MIN_TOKEN_LENGTH characters of RFC 6750's token68 alphabet)

The file is a Kubernetes Secret's key, or a file only the gateway's user
reads. Its tokens never stay in memory as text: each is hashed when read, and
a presented token is hashed and compared with every digest in constant time
(`hmac.compare_digest`, no early exit), so neither the answer nor its timing
says how much of a guess was right. The file is read again when it changes
(checked at most every RECHECK_SECONDS, by its inode, size and mtime: a Secret
update swaps a symlink) or on SIGHUP; a file that cannot be read then keeps the
tokens the gateway has and logs why, and a file with no tokens revokes them all.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from pathlib import Path

from gateway.users import read_small_text

log = logging.getLogger("proxy_operator.gateway")

# A token's alphabet (RFC 6750, b64token) and length: shorter ones are guessable.
TOKEN = re.compile(r"^[A-Za-z0-9._~+/-]+=*$")
MIN_TOKEN_LENGTH = 16
MAX_TOKEN_LENGTH = 512
MAX_FILE_BYTES = 1 << 20
RECHECK_SECONDS = 1.0


class TokenFileError(Exception):
    """The tokens file cannot be read or holds a line that is not a token (named)."""


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, source: str) -> frozenset[bytes]:
    """The digests of the tokens in `text`; TokenFileError naming each bad line (not its text)."""
    digests: set[bytes] = set()
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not MIN_TOKEN_LENGTH <= len(line) <= MAX_TOKEN_LENGTH or not TOKEN.fullmatch(line):
            # The line may be a real token with a typo: its text stays out of the error.
            problems.append(
                f"line {number}: a token is {MIN_TOKEN_LENGTH} to {MAX_TOKEN_LENGTH} of "
                "A-Z a-z 0-9 . _ ~ + / - (then '=' padding), with no spaces"
            )
            continue
        digests.add(digest(line))
    if problems:
        raise TokenFileError(f"{source}: {'; '.join(problems)}")
    return frozenset(digests)


def _read(path: Path) -> str:
    try:
        return read_small_text(str(path), MAX_FILE_BYTES)
    except ValueError as err:
        raise TokenFileError(str(err)) from None


class TokenStore:
    """The digests of the tokens in one file, followed as it changes."""

    def __init__(self, path: Path, flag: str = "--api-tokens-file") -> None:
        """Read `path` now; TokenFileError (naming `flag`) if it is unreadable, bad or empty."""
        self.path = path
        try:
            self._digests = parse_tokens(_read(path), str(path))
        except TokenFileError as err:
            raise TokenFileError(f"{flag}: {err}") from None
        if not self._digests:
            raise TokenFileError(f"{flag}: {path} holds no token")
        self._signature = self._stat()
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            # Follows symlinks: a Secret volume swaps `..data`, the file's target changes.
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns

    def reload(self) -> None:
        """Read the file again (SIGHUP, or it changed); a bad file keeps the tokens there are."""
        self._signature = self._stat()
        try:
            digests = parse_tokens(_read(self.path), str(self.path))
        except TokenFileError as err:
            log.error("keeping the API tokens read before: %s", err)
            return
        if digests != self._digests:
            log.info("API tokens reloaded from %s: %d tokens", self.path, len(digests))
        self._digests = digests

    def _follow(self) -> None:
        now = time.monotonic()
        if now - self._checked < RECHECK_SECONDS:
            return
        self._checked = now
        if self._stat() != self._signature:
            self.reload()

    def match(self, token: str) -> bytes | None:
        """The digest of `token` if the file holds it (compared in constant time), else None."""
        self._follow()
        presented = digest(token)
        found = False
        for known in self._digests:  # every one, whatever matched: no early exit
            found |= hmac.compare_digest(presented, known)
        return presented if found else None
