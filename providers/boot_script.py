"""The boot scripts of the VM providers: a template filled in, and what their reports mean.

GCP's startup script and EC2's user data ship as template files (package
data) and read (and diff) as the bash they are. Only `@UPPER_CASE@` is a
placeholder, so bash's own `$` and `"${APT[@]}"` need no escaping. Both
install Squid, write the config from the project's one renderer
(squid/conf.py) and report progress where the provider can read it:
`installing`, then READY once Squid listens, or `failed: <why>`.
"""

from __future__ import annotations

import dataclasses
import re
import string
from pathlib import Path

from providers.base import Instance, InstanceState
from squid.conf import SQUID_USER, ProxySettings, SquidPaths, render

STARTUP_READY = "ready"
STARTUP_FAILED_PREFIX = "failed"
SQUID_CONF = "/etc/squid/squid.conf"
# A failure report is written by the VM and shown to users: kept this short.
MAX_REASON_CHARS = 300


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


def load_template(path: Path) -> ScriptTemplate:
    """The template at `path`; read at import, so a wheel without it fails at once."""
    return ScriptTemplate(path.read_text(encoding="utf-8"))


def fill(
    template: ScriptTemplate,
    proxy: ProxySettings,
    *,
    password_setting: str | None = None,
    **where_to_report: str,
) -> str:
    """`template` for a VM serving `proxy`; `where_to_report` fills the provider's own placeholders.

    `password_setting` is the htpasswd hash's salt and rounds (squid/conf.py, `render`).
    Every placeholder must be filled: `substitute` raises on a missing one.
    """
    paths = SquidPaths()
    rendered = render(proxy, paths, password_setting=password_setting)
    return template.substitute(
        READY=STARTUP_READY,
        FAILED=STARTUP_FAILED_PREFIX,
        SQUID_CONF=SQUID_CONF,
        SQUID_CONF_TEXT=rendered.squid_conf.rstrip("\n"),
        SQUID_USER=SQUID_USER,
        HTPASSWD=paths.htpasswd,
        HTPASSWD_TEXT=rendered.htpasswd.rstrip("\n"),
        PORT=str(proxy.port),
        **where_to_report,
    )


def with_report(instance: Instance, report: str, *, script: str, machine: str) -> Instance:
    """A RUNNING `instance` as its boot script's last `report` says it is.

    READY leaves it RUNNING; a failure ends it (TERMINATED with the script's
    reason), so the workflow replaces it at once instead of waiting out its
    deadline; anything else is still PROVISIONING, without an address.
    `script` and `machine` name them in the reason ("startup script", "VM").
    """
    if report == STARTUP_READY:
        return instance
    if report.startswith(STARTUP_FAILED_PREFIX):
        # Written by the VM: shown to users, so kept short and printable.
        said = "".join(c if c.isprintable() else "?" for c in report[:MAX_REASON_CHARS])
        return dataclasses.replace(
            instance, state=InstanceState.TERMINATED, ip="", reason=f"{script} {said}"
        )
    return dataclasses.replace(
        instance,
        state=InstanceState.PROVISIONING,
        ip="",
        reason=f"{machine} running, waiting for its {script} to start Squid ({report})",
    )
