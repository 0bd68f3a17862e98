"""The fleet benchmark's settings: the fleet, its probes, and what "on time" means."""

from __future__ import annotations

import os
from collections.abc import Sequence

from providers.config import Config
from tests.helpers.config import build_config, local_entry

INSTALLATION = "bench-fleet"
PASSWORD = "bench-fleet-password-8d1e"  # at least 16 characters, as the config requires
FLEET_PROVIDER = "fleet"
SQUID_PROVIDER = "local"
INTERVAL = 10.0
# A probe is on time when it starts within this share of an interval late.
ON_TIME_TOLERANCE = 0.10
# The fleet is "on time" when all three hold.
MIN_RATE = 0.99
MIN_ON_TIME = 0.99
MAX_GAP_INTERVALS = 2.0
# Every monitor is in its probe loop this long after the last proxy is Ready.
SETTLE_SECONDS = 2 * INTERVAL
LAG_SLEEP = 0.1
SLOW_PROBE_MS = 500.0
GC_REPORT_MS = 20.0
CAPACITY_SECONDS = 3.0
CAPACITY_CONCURRENCY = 20
CPUS = os.cpu_count() or 1


def config_for(origin_ports: Sequence[int], state_dir: str, provider: str) -> Config:
    """The worker's config: one local-type provider entry named `provider`."""
    return build_config(
        local_entry(state_dir, provider),
        connect_ports=list(origin_ports),
        installation=INSTALLATION,
        password=PASSWORD,
    )
