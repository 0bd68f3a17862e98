"""What one pytest-xdist worker owns alone, so `make test` can run the suite in parallel.

`make test` runs the tests in several processes (pytest-xdist; the Makefile
says how many). Session fixtures (dev server, test server, TLS origin) are
already per process, and every test has its own task queue and state_dir.
What would still be shared on one machine is split by worker here:

- the local provider's port range: two state_dirs do not see each other's
  reserved ports, so two workers' Squids would race for the same port;
- the installation id: it scopes instance names (providers/naming.py), hence
  Squid's service names and their /dev/shm segments, which are machine-wide.
  Without it, two workers running one workflow id would share segments.

Not here, but the same rule: fixed ports. A worker process started by a test
serves no metrics unless the test gives it a free port
(tests/helpers/worker_process.py), as the default, 9464, is the machine's;
any other listener takes `free_port()`.

A module whose tests name Squids explicitly ("proxy-a", "member-0") would
still share names across workers: it carries `pytest.mark.xdist_group(<its
name>)`, so all its tests run on one worker (`--dist loadgroup`).

Outside xdist (a plain `pytest`, the benchmarks) nothing changes: the
installation is `test` and the provider's default ports apply.
"""

from __future__ import annotations

import os
import re

# "gw0", "gw1", ... in an xdist worker; unset in a plain run and in the controller.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
# Ports for local Squids: 21000.. in blocks, below the ephemeral range (32768..),
# clear of free_port's 24000..24999 (tests/helpers/network.py) and of the
# benchmarks' 25000..25999.
PORT_BASE = 21000
PORT_BLOCK = 200
PORT_BLOCKS = 15  # 21000..23999; a 16th worker shares the first block


def worker_number() -> int | None:
    """N of worker gwN, or None outside xdist."""
    match = re.fullmatch(r"gw(\d+)", WORKER)
    return int(match.group(1)) if match else None


def scoped(name: str) -> str:
    """`name` made this worker's own (`test` -> `test-gw1`); unchanged outside xdist."""
    return f"{name}-{WORKER}" if worker_number() is not None else name


def local_ports(
    base: int = PORT_BASE, block: int = PORT_BLOCK, blocks: int = PORT_BLOCKS
) -> dict[str, int]:
    """This worker's `first_port`/`last_port` for the local provider; {} outside xdist."""
    number = worker_number()
    if number is None:
        return {}
    first = base + block * (number % blocks)
    return {"first_port": first, "last_port": first + block - 1}
