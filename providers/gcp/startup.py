"""The VM's startup script: install Squid, write its config and htpasswd, report progress.

The script is `startup.sh.tmpl` next to this module, shipped as package data
and kept as a shell file so it reads (and diffs) as the bash it is. Its
`@NAME@` placeholders are filled here; bash's own `$` needs no escaping.

It runs as root on every boot, so a VM that restarts comes back with the
config in its metadata. The htpasswd is created group-readable by Squid's
user only, before the hash is written into it.

First boots are where images differ: unattended-upgrades may hold the dpkg
lock for minutes, and a third-party apt repository on the image may fail
`apt-get update`. apt waits for the lock (DPkg::Lock::Timeout), a failed
update does not stop the install from Debian's own lists, and the install is
retried. Progress goes to the guest attribute STARTUP_STATE_ATTRIBUTE
(written through the metadata server, so the VM needs no service account):
`installing`, then `ready` once Squid listens, or `failed: <why>` from
whichever step failed, which ends the instance with that reason.
"""

from __future__ import annotations

from pathlib import Path

from providers.boot_script import (
    SQUID_CONF,
    STARTUP_FAILED_PREFIX,
    STARTUP_READY,
    fill,
    load_template,
)
from squid.conf import ProxySettings

# Where the startup script reports its progress: `installing`, `ready`, or
# `failed: <why>`. Any process on the VM could write it; only Squid runs there.
STARTUP_STATE_ATTRIBUTE = "proxy-operator/state"

TEMPLATE_FILE = "startup.sh.tmpl"

# Read once, at import: a wheel without the template fails at once, not at the first create.
TEMPLATE = load_template(Path(__file__).with_name(TEMPLATE_FILE))

__all__ = [
    "SQUID_CONF",
    "STARTUP_FAILED_PREFIX",
    "STARTUP_READY",
    "STARTUP_STATE_ATTRIBUTE",
    "TEMPLATE",
    "TEMPLATE_FILE",
    "startup_script",
]


def startup_script(proxy: ProxySettings) -> str:
    """The boot script for a VM serving `proxy` (see the module docstring)."""
    return fill(TEMPLATE, proxy, STATE_ATTRIBUTE=STARTUP_STATE_ATTRIBUTE)
