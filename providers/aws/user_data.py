"""The instance's user data: install Squid, write its config and htpasswd, report progress.

The script is `user_data.sh.tmpl` next to this module, shipped as package
data; cloud-init runs it as root on the first boot. Squid's config comes from
the project's one renderer (squid/conf.py), as for every other provider.

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
reason. A spot instance's script then watches for EC2's interruption notice
(`spot_watch.sh.tmpl`) and reports `interrupted <action> <time>` when it
comes: that report is final, whatever the console shows after it. Before
the notice, EC2 may recommend rebalancing (the instance is at elevated risk
of interruption): the watcher reports `rebalance <time>` once, a report
apart from the state, on which the proxy is replaced make-before-break. The
provider reads it with GetConsoleOutput (`Latest`), which needs no
credentials on the instance: a proxy VM has no IAM role to steal.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from providers.boot_script import (
    MAX_REASON_CHARS,
    SQUID_CONF,
    STARTUP_FAILED_PREFIX,
    STARTUP_READY,
    fill,
    load_template,
)
from squid.conf import ProxySettings
from squid.htpasswd import SHA512_CRYPT_ROUNDS

# The console line the script writes at each step: `<marker> <state>`.
STATE_MARKER = "proxy-operator-state:"
# What the state is before the script's first report.
STARTUP_BOOTING = "booting"

# The report of a spot interruption notice: `interrupted <action> <time>`.
STARTUP_INTERRUPTED = "interrupted"
# The report of a rebalance recommendation: `rebalance <time>`.
REBALANCE = "rebalance"
# Why the proxy's workflow is asked to rotate on one (the `rotate` signal's reason).
REBALANCE_REASON = "EC2 rebalance recommendation"
# How often the spot watcher asks IMDS; AWS suggests every 5 seconds.
SPOT_POLL_SECONDS = 5

_SALT_ALPHABET = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_SALT_CHARS = 16

TEMPLATE_FILE = "user_data.sh.tmpl"
SPOT_WATCH_FILE = "spot_watch.sh.tmpl"

# Read once, at import: a wheel without the template fails at once, not at the first create.
TEMPLATE = load_template(Path(__file__).with_name(TEMPLATE_FILE))
SPOT_WATCH = load_template(Path(__file__).with_name(SPOT_WATCH_FILE)).substitute(
    INTERRUPTED=STARTUP_INTERRUPTED,
    REBALANCE=REBALANCE,
    SPOT_POLL_SECONDS=str(SPOT_POLL_SECONDS),
)

__all__ = [
    "REBALANCE_REASON",
    "SQUID_CONF",
    "STARTUP_FAILED_PREFIX",
    "STARTUP_INTERRUPTED",
    "STARTUP_READY",
    "console_report",
    "interruption_notice",
    "user_data",
]


def user_data(proxy: ProxySettings, *, spot: bool, name: str) -> str:
    """The boot script for instance `name` serving `proxy`; a `spot` one watches for its notice.

    The same for every render of one name: RunInstances compares a retried
    request with its client token's first, parameter by parameter, and a
    fresh salt in the htpasswd would make every retry a different request
    (IdempotentParameterMismatch). So the hash's salt is `htpasswd_salt(name)`.
    """
    return fill(
        TEMPLATE,
        proxy,
        password_setting=f"$6$rounds={SHA512_CRYPT_ROUNDS}${htpasswd_salt(name)}",
        STATE_MARKER=STATE_MARKER,
        SPOT_WATCH=SPOT_WATCH if spot else "",
    )


def htpasswd_salt(name: str) -> str:
    """The htpasswd hash's salt for instance `name`: unique per instance, the same on a retry.

    From the name alone, never the password: a salt is public (it is in the
    hash), and one computed quickly from the password would let anyone who
    reads the user data test guesses without SHA-512-crypt's rounds. Names
    are unique per installation, namespace, owner and generation, so no
    two instances share a salt, which is all a salt is for.
    """
    digest = hashlib.sha256(f"proxy-operator htpasswd salt\x00{name}".encode()).digest()
    return "".join(_SALT_ALPHABET[b % len(_SALT_ALPHABET)] for b in digest[:_SALT_CHARS])


def interruption_notice(report: str) -> str | None:
    """The reason a console report of a spot interruption notice gives, else None."""
    words = report.split()
    if not words or words[0] != STARTUP_INTERRUPTED:
        return None
    action, when = [*words[1:], "unknown", "unknown"][:2]
    said = f"spot interruption notice: {action} at {when}"[:MAX_REASON_CHARS]
    # Written by the instance: shown to users, so printable only.
    return "".join(c if c.isprintable() else "?" for c in said)


@dataclass(frozen=True)
class ConsoleReport:
    """What the user data last reported on the serial console."""

    # The script's state: `installing`, `ready`, `failed: ...`, an interruption notice.
    state: str
    # Whether EC2 recommended rebalancing this (spot) instance.
    rebalance: bool = False


def console_report(output: str | None) -> ConsoleReport:
    """The script's reports in GetConsoleOutput's `Output`; STARTUP_BOOTING before any.

    botocore has already decoded the base64 the API sends. The console holds
    the last 64 KB only; the script's latest line is the one that counts, so
    the last marker wins, but for a spot interruption notice: the instance
    goes whatever follows it, so the latest notice wins over any later line.
    A rebalance recommendation is no state: Squid still serves after it.
    """
    reports = [
        line.split(STATE_MARKER, 1)[1].strip()
        for line in (output or "").splitlines()
        if STATE_MARKER in line
    ]
    rebalance = [report for report in reports if report.split()[:1] == [REBALANCE]]
    states = [report for report in reports if report not in rebalance]
    notices = [state for state in states if interruption_notice(state) is not None]
    latest = (notices or states or [STARTUP_BOOTING])[-1]
    return ConsoleReport(latest, rebalance=bool(rebalance))
