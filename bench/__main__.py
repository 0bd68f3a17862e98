"""Every benchmark with its defaults: `python -m bench` (what `make bench` runs).

Each prints tables for docs/benchmarks.md; none asserts anything.
"""

import runpy
import sys

BENCHMARKS = (
    "bench.local_squid",
    "bench.lifecycle",
    "bench.provider_ready",
    "bench.orphan_gc",
    "bench.fleet",
    "bench.gateway",
    "bench.router_change",
    "bench.ban_loop",
    "bench.pool",
    "bench.reconfigure",
    "bench.cost",
    "bench.autoscale",
    "bench.auth",
)

for module in BENCHMARKS:
    print(f"\n=== {module}", flush=True)
    sys.argv = [module]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
