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

import re
import string
from pathlib import Path

from providers.squid import SQUID_USER, ProxySettings, SquidPaths, render

# Where the startup script reports its progress: `installing`, `ready`, or
# `failed: <why>`. Any process on the VM could write it; only Squid runs there.
STARTUP_STATE_ATTRIBUTE = "proxy-operator/state"
STARTUP_READY = "ready"
STARTUP_FAILED_PREFIX = "failed"

SQUID_CONF = "/etc/squid/squid.conf"
TEMPLATE_FILE = "startup.sh.tmpl"


class ScriptTemplate(string.Template):
    """`@NAME@` placeholders (upper case), so the shell's `$` stays as written."""

    delimiter = "@"
    # The named group only: a shell script has no use for an escape, and
    # anything else with an `@` (`"${APT[@]}"`) is bash's. A string, which
    # Template compiles (the documented way); typeshed types the compiled one.
    pattern = (
        r"@(?:(?P<named>[A-Z][A-Z_]*)@"  # type: ignore[assignment]
        r"|(?P<escaped>(?!))|(?P<braced>(?!))|(?P<invalid>(?!)))"
    )
    flags = re.RegexFlag(0)  # case-sensitive: `@` followed by lower case is never a placeholder


# Read once, at import: a wheel without the template fails at once, not at the first create.
TEMPLATE = ScriptTemplate(Path(__file__).with_name(TEMPLATE_FILE).read_text(encoding="utf-8"))


def startup_script(proxy: ProxySettings) -> str:
    """The boot script for a VM serving `proxy` (see the module docstring).

    Every placeholder must be filled: `substitute` raises on a missing one.
    """
    paths = SquidPaths()
    rendered = render(proxy, paths)
    return TEMPLATE.substitute(
        STATE_ATTRIBUTE=STARTUP_STATE_ATTRIBUTE,
        READY=STARTUP_READY,
        FAILED=STARTUP_FAILED_PREFIX,
        SQUID_CONF=SQUID_CONF,
        SQUID_CONF_TEXT=rendered.squid_conf.rstrip("\n"),
        SQUID_USER=SQUID_USER,
        HTPASSWD=paths.htpasswd,
        HTPASSWD_TEXT=rendered.htpasswd.rstrip("\n"),
        PORT=str(proxy.port),
    )
