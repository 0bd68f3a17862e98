"""Ends the gateway's Squid when the gateway process dies, however it dies.

    python -m gateway.watchdog <squid pid> <service name>

The gateway starts this beside its Squid with a pipe on our stdin and keeps
the pipe's other end open for as long as it lives; it never writes to it.
End of input therefore means the gateway is gone: it stopped Squid itself
and closed the pipe, or it was killed (SIGKILL included) and the kernel
closed it. Then we kill Squid's whole process group.

Why: Squid runs in a session of its own, so nothing else ends it with the
gateway. A killed gateway would leave a Squid that accepts connections with
no process that keeps its membership current (the router ends with the
gateway: its standard input closes). A gateway is stateless, so the safe
outcome is no Squid at all: the port refuses, and the supervisor (a
Deployment, systemd) starts a new gateway, which starts a new Squid.

We ignore SIGINT and SIGHUP and run in a session of our own, so a Ctrl-C or
a closed terminal that stops the gateway gracefully leaves the order of
things to the gateway.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from squid.process import remove_shm


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[1].isdigit():
        print("usage: python -m gateway.watchdog SQUID_PID SERVICE", file=sys.stderr)
        return 2
    squid, service = int(argv[1]), argv[2]
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    while os.read(sys.stdin.fileno(), 4096):
        pass  # nobody writes; only end of input matters
    # Squid was started in a session of its own, so its pid is its process
    # group: the master and its worker.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(squid, signal.SIGKILL)
    remove_shm(service)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
