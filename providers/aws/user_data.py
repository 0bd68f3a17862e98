"""The instance's user data: install Squid, write its config and htpasswd, report progress.

The script is `user_data.sh.tmpl` next to this module, shipped as package
data; cloud-init runs it as root on the first boot. Squid's config comes from
the project's one renderer (providers.squid), as for every other provider.

What it carries is what GCP's startup script carries in instance metadata:
the squid.conf and the htpasswd *hash*, never the password, which stays in
the worker. User data stays readable for the instance's life (to the
instance through IMDS, and to principals allowed
ec2:DescribeInstanceAttribute), so the provider requires IMDSv2 with a hop
limit of 1, and Squid's default denied destinations keep proxy users from
the metadata address (docs/providers.md, "AWS EC2").

Progress goes to the serial console, one line per step, starting with
STATE_MARKER: `installing`, then `ready` once Squid listens, or
`failed: <why>` from whichever step failed, which ends the instance with that
reason. The provider reads it with GetConsoleOutput (`Latest`), which needs
no credentials on the instance: a proxy VM has no IAM role to steal.
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
from providers.squid import ProxySettings

# The console line the script writes at each step: `<marker> <state>`.
STATE_MARKER = "proxy-operator-state:"
# What the state is before the script's first report.
STARTUP_BOOTING = "booting"

TEMPLATE_FILE = "user_data.sh.tmpl"

# Read once, at import: a wheel without the template fails at once, not at the first create.
TEMPLATE = load_template(Path(__file__).with_name(TEMPLATE_FILE))

__all__ = ["SQUID_CONF", "STARTUP_FAILED_PREFIX", "STARTUP_READY", "console_state", "user_data"]


def user_data(proxy: ProxySettings) -> str:
    """The boot script for an instance serving `proxy` (see the module docstring)."""
    return fill(TEMPLATE, proxy, STATE_MARKER=STATE_MARKER)


def console_state(output: str | None) -> str:
    """The script's last report in GetConsoleOutput's `Output`, or STARTUP_BOOTING.

    botocore has already decoded the base64 the API sends. The console holds
    the last 64 KB only; the script's latest line is the one that counts, so
    the last marker wins.
    """
    states = [
        line.split(STATE_MARKER, 1)[1].strip()
        for line in (output or "").splitlines()
        if STATE_MARKER in line
    ]
    return states[-1] if states else STARTUP_BOOTING
