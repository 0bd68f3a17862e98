"""The gateway's Squid auth helper (gateway/auth_helper.py) run as Squid runs it, for tests and
benchmarks: over a users file, the fleet's own username going on to the real `basic_ncsa_auth`."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from providers.squid import NCSA_AUTH_HELPER, sha512_crypt
from tests.helpers.config import PASSWORD, USERNAME

ROOT = Path(__file__).resolve().parents[2]


class AuthHelper:
    """One auth helper process, asked one `username password` line at a time."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process

    def ask(self, username: str, password: str) -> str:
        """The helper's answer line (`OK ...` or `ERR ...`), %-encoding both as Squid does."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{quote(username)} {quote(password)}\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().rstrip("\n")


@contextmanager
def auth_helper(users: str) -> Iterator[AuthHelper]:
    """The helper for the fleet's USERNAME/PASSWORD and the users file text `users`."""
    with tempfile.TemporaryDirectory(prefix="proxy-operator-auth-") as directory:
        users_file, htpasswd = Path(directory, "users"), Path(directory, "htpasswd")
        users_file.write_text(users)
        htpasswd.write_text(f"{USERNAME}:{sha512_crypt(PASSWORD)}\n")
        helper = [sys.executable, str(ROOT / "gateway" / "auth_helper.py"), USERNAME]
        process = subprocess.Popen(
            [*helper, "--users", str(users_file), NCSA_AUTH_HELPER, str(htpasswd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            yield AuthHelper(process)
        finally:
            assert process.stdin is not None
            process.stdin.close()
            process.wait(timeout=30)
