"""Following the gateway's users file: each valid change goes to the router.

The file is checked every FOLLOW_SECONDS (its inode, size and mtime: a
Kubernetes Secret's update swaps a symlink) and on SIGHUP. A change that
parses is copied to where the router reads it (GatewaySquid.install_users), in
force at the next check of each username; one that does not is logged, and
the users read before stay.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from gateway.squid import GatewaySquid
from gateway.users import UsersFileError, parse_users, read_users_text

log = logging.getLogger("proxy_operator.gateway")

FOLLOW_SECONDS = 1.0


def load_users(path: Path, fleet_user: str) -> str:
    """The users file's text once it parses; UsersFileError naming what is wrong."""
    text = read_users_text(str(path))
    parse_users(text, str(path), fleet_user)
    return text


def signature(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns


class UsersFollower:
    """Copies each valid version of the users file to the gateway's Squid."""

    def __init__(self, path: Path, fleet_user: str, squid: GatewaySquid) -> None:
        self._path, self._fleet, self._squid = path, fleet_user, squid
        self._signature = signature(path)

    def reload(self) -> None:
        self._signature = signature(self._path)
        try:
            text = load_users(self._path, self._fleet)
        except UsersFileError as err:
            log.error("keeping the users read before: %s", err)
            return
        self._squid.install_users(text)
        log.info("users reloaded from %s", self._path)

    async def follow(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_SECONDS)
            if signature(self._path) != self._signature:
                self.reload()
