"""How many proxies one worker process monitors at 10 s (the target in docs/benchmarks.md).

    python -m bench.fleet [--proxies 1000] [--squids 10] [--minutes 3]

Target: "1,000 with probes on time" on 2 cores. A real dev server, a local
TLS origin and `--squids` real Squid proxies (the local provider), created up
front. ONE worker (build_worker, ProviderActivities), run as a separate
process so its CPU figure is its own, serves `--proxies` ProxyLifecycle
workflows probing every 10 s. Its provider is a stand-in whose instance i is
squid i % squids, so every probe is a real CONNECT, through a real Squid, and
a real TLS handshake with the origin; only creating and deleting are fake.

Once every proxy is Ready (and two intervals more, so every monitor is in its
loop), the benchmark measures over `--minutes`:

- probes: every probe the worker makes is recorded (a probe injected into
  ProviderActivities) with its start time, per instance; expected
  = proxies * seconds / interval. The `proxy_operator_probes_total` counter
  is read as a cross-check.
- on time: a probe is on time when it starts at most 10% of an interval after
  the instance's previous probe (the monitor's schedule); the fleet's probes
  are on time when at least 99% of the expected probes happened, at least
  99% of them were on time, and no instance went more than two intervals
  without a probe (none missed a window by more than one interval).
- the worker process's CPU (utime + stime from /proc, every thread, the SDK's
  Rust core included) over wall time, as % of all cores; its RSS; and its
  event-loop lag (how late a 100 ms asyncio.sleep wakes, sampled all along).
- context: the CPU of the dev server, the Squids (with their helpers), this
  process (the TLS origin lives here) and the whole machine, since the
  worker shares 2 cores with all of them and with whatever else is running.

Then every workflow is terminated with the `terminate` signal, and the worker,
the Squids and the dev server are stopped, on Ctrl-C or failure too. Prints
markdown tables and asserts nothing.

The parts, one module each:

- `parameters`: the fleet's settings and what "on time" means;
- `worker_process`: the worker, its recording probe, and the handle that
  starts and stops it as a child process;
- `sampling`: CPU and memory of every party, read from /proc;
- `squids`: the real Squid pool every probe goes through;
- `control`: starting, waiting for and terminating the fleet's workflows;
- `report`: turning the worker's records into the printed tables;
- `__main__`: the run, start to end.
"""
