"""The fleet benchmark's report: the worker's records over the window, as tables."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from typing import Any

from bench.fleet.parameters import (
    CAPACITY_CONCURRENCY,
    CPUS,
    GC_REPORT_MS,
    INTERVAL,
    LAG_SLEEP,
    MAX_GAP_INTERVALS,
    MIN_ON_TIME,
    MIN_RATE,
    ON_TIME_TOLERANCE,
    SLOW_PROBE_MS,
)
from bench.fleet.sampling import CpuSnapshot, Memory
from bench.fleet.squids import Capacity
from bench.stats import percentile as pct


@dataclass
class Measured:
    window: float
    probes: int
    expected: float
    gaps: list[float]
    open_gaps: list[float]
    instances: int
    silent: int
    failures: Counter[str]
    millis: list[float]
    lag: list[float]
    monitor_starts: int
    monitor_ends: Counter[str]
    counter_total: float
    recorded_total: int
    slow_stages: Counter[str]
    collections: list[tuple[int, float]]


STAGES = ("TCP connect to the Squid", "CONNECT reply (Squid connects to the origin)", "TLS", "HEAD")


def _slowest_stage(connect: float, reply: float, tls: float, total: float) -> str:
    times = (connect, reply, tls, total - connect - reply - tls)
    return STAGES[times.index(max(times))]


def analyse(data: dict[str, Any], t0: float, t1: float, proxies: int) -> Measured:
    gaps: list[float] = []
    open_gaps: list[float] = []
    millis: list[float] = []
    probes = 0
    recorded = 0
    probed_instances = 0
    for starts_raw, ms_raw in data["probes"].values():
        records = sorted(zip(starts_raw, ms_raw, strict=True))
        recorded += len(records)
        previous: float | None = None
        last_before_end: float | None = None
        for start, ms in records:
            if start >= t1:
                break
            if start >= t0:
                probes += 1
                if ms >= 0:
                    millis.append(ms)
                if previous is not None:
                    gaps.append(start - previous)
            previous = last_before_end = start
        if last_before_end is not None and last_before_end >= t0:
            probed_instances += 1
        if last_before_end is not None:
            # Time since the last probe when the window closed: a gap still open.
            open_gaps.append(t1 - last_before_end)
    lag_at, lag = data["lag"]
    failures: Counter[str] = Counter(
        failure for start, _, failure, _ in data["failures"] if t0 <= start < t1
    )
    return Measured(
        window=t1 - t0,
        probes=probes,
        expected=proxies * (t1 - t0) / INTERVAL,
        gaps=gaps,
        open_gaps=open_gaps,
        instances=len(data["probes"]),
        silent=proxies - probed_instances,
        failures=failures,
        millis=millis,
        lag=[v for at, v in zip(lag_at, lag, strict=True) if t0 <= at < t1],
        monitor_starts=sum(1 for at, _ in data["monitor_starts"] if t0 <= at < t1),
        monitor_ends=Counter(reason for at, reason in data["monitor_ends"] if t0 <= at < t1),
        counter_total=data["counter_total"],
        recorded_total=recorded,
        slow_stages=Counter(
            _slowest_stage(*stages) for start, *stages in data["slow"] if t0 <= start < t1
        ),
        collections=[(gen, took) for end, gen, took in data["collections"] if t0 <= end < t1],
    )


@dataclass
class Run:
    args: argparse.Namespace
    measured: Measured
    before: CpuSnapshot
    after: CpuSnapshot
    memory: Memory
    ready_seconds: float
    terminate_seconds: float
    capacity: Capacity


def print_report(run: Run) -> None:
    m, b, a, args = run.measured, run.before, run.after, run.args
    wall = a.at - b.at
    limit = INTERVAL * (1 + ON_TIME_TOLERANCE)
    on_time = sum(1 for g in m.gaps if g <= limit)
    on_time_share = on_time / len(m.gaps) if m.gaps else 0.0
    worst = max([*m.gaps, *m.open_gaps], default=float("nan"))
    missed = sum(1 for g in [*m.gaps, *m.open_gaps] if g > MAX_GAP_INTERVALS * INTERVAL)
    rate = m.probes / m.expected if m.expected else 0.0
    verdict = (
        rate >= MIN_RATE
        and on_time_share >= MIN_ON_TIME
        and worst <= MAX_GAP_INTERVALS * INTERVAL
        and m.silent == 0
    )
    worker_cpu = a.worker - b.worker

    def share(seconds: float) -> str:
        return f"{seconds / wall / CPUS * 100:.1f}% of {CPUS} cores ({seconds:.1f} CPU-s)"

    failures = ", ".join(f"{k} {v}" for k, v in m.failures.most_common()) or "none"
    busy = (a.system[0] - b.system[0]) / max(1.0, a.system[1] - b.system[1]) * 100
    cap = run.capacity
    ends = ", ".join(f"{k} {v}" for k, v in m.monitor_ends.items()) or "none"
    print(
        f"\nfleet monitoring: {args.proxies} proxies on {args.squids} Squids, "
        f"probes every {INTERVAL:g} s, one worker process, {wall:.0f} s window"
    )
    rows = [
        ("probes completed / expected", f"{m.probes} / {m.expected:.0f} ({rate * 100:.2f}%)"),
        (
            f"probes on time (<= {limit:g} s after the previous one)",
            f"{on_time_share * 100:.2f}% ({on_time} of {len(m.gaps)})",
        ),
        (
            "gap between an instance's probes p50 / p99 / p99.9 / max",
            f"{pct(m.gaps, 50):.3f} / {pct(m.gaps, 99):.3f} / {pct(m.gaps, 99.9):.3f} / "
            f"{max(m.gaps, default=float('nan')):.3f} s",
        ),
        (
            f"windows missed (a gap over {MAX_GAP_INTERVALS * INTERVAL:g} s, open ones too)",
            f"{missed} (longest gap {worst:.2f} s; {m.silent} proxies with no probe)",
        ),
        ("probe failures", failures),
        (
            "probe latency p50 / p99 / max",
            f"{pct(m.millis, 50):.1f} / {pct(m.millis, 99):.1f} / "
            f"{max(m.millis, default=float('nan')):.1f} ms",
        ),
        (
            "worker CPU (process, all threads)",
            f"{share(worker_cpu)}; {worker_cpu / max(1, m.probes) * 1000:.2f} ms per probe",
        ),
        (
            "worker RSS end / max in window / peak",
            f"{run.memory.rss_kib[-1] / 1024:.0f} / {max(run.memory.rss_kib) / 1024:.0f} / "
            f"{run.memory.hwm_kib / 1024:.0f} MiB ({run.memory.threads} threads)",
        ),
        (
            f"worker event-loop lag ({LAG_SLEEP * 1000:g} ms sleep) p50 / p99 / max",
            f"{pct(m.lag, 50) * 1000:.1f} / {pct(m.lag, 99) * 1000:.1f} / "
            f"{max(m.lag, default=float('nan')) * 1000:.1f} ms ({len(m.lag)} samples)",
        ),
        (
            f"probes over {SLOW_PROBE_MS:g} ms, by their slowest stage",
            f"{sum(m.slow_stages.values())}: "
            + (", ".join(f"{k} {v}" for k, v in m.slow_stages.most_common()) or "none"),
        ),
        (
            "worker garbage collections: oldest generation / any over "
            f"{GC_REPORT_MS:g} ms, longest",
            f"{sum(1 for g, _ in m.collections if g == 2)} / "
            f"{sum(1 for _, t in m.collections if t * 1000 >= GC_REPORT_MS)}, "
            f"{max((t for _, t in m.collections), default=0) * 1000:.0f} ms",
        ),
        ("monitor activities started / ended in the window", f"{m.monitor_starts} / {ends}"),
        (
            "probes on time (all three: rate >= 99%, >= 99% on time, no window missed)",
            "**yes**" if verdict else "**no**",
        ),
    ]
    _table(("what", "measured"), rows)
    print("\ncontext (same window)")
    context = [
        ("machine CPU busy (everything)", f"{busy:.0f}% of {CPUS} cores"),
        ("load average (1/5/15 min) at start -> end", f"{b.load} -> {a.load}"),
        ("dev server CPU", share(a.dev_server - b.dev_server)),
        (f"{args.squids} Squids (with helpers) CPU", share(a.squids - b.squids)),
        ("this process (TLS origin, polling) CPU", share(a.bench - b.bench)),
        ("TCP listen-queue overflows (machine-wide)", str(a.overflows - b.overflows)),
        (
            "Squid pool, capacity check before the run",
            f"{cap.probes / cap.seconds:.0f} probes/s ({CAPACITY_CONCURRENCY} at a time, "
            f"{cap.failed} failed), p50 {pct(cap.millis, 50):.1f} ms, "
            f"p99 {pct(cap.millis, 99):.1f} ms",
        ),
        ("fleet start -> all Ready", f"{run.ready_seconds:.0f} s ({args.concurrency} at a time)"),
        ("terminate signal -> none running", f"{run.terminate_seconds:.0f} s"),
        (
            "probes counter (proxy_operator_probes_total) / recorded, whole run",
            f"{m.counter_total:.0f} / {m.recorded_total}",
        ),
    ]
    _table(("what", "measured"), context)


def _table(headers: tuple[str, str], rows: list[tuple[str, str]]) -> None:
    print(f"| {headers[0]} | {headers[1]} |")
    print("| --- | --- |")
    for what, value in rows:
        print(f"| {what} | {value} |")
