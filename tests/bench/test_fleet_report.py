"""The fleet benchmark's verdict, on records made up to say yes or no."""

from __future__ import annotations

import argparse

import pytest

from activities.probe import ProbeResult
from bench.fleet.parameters import INTERVAL
from bench.fleet.report import Run, analyse, print_report
from bench.fleet.sampling import CpuSnapshot, Memory
from bench.fleet.squids import Capacity
from bench.fleet.worker_process import Recorder

WINDOW = 60.0
VERDICT = "probes on time (all three: rate >= 99%, >= 99% on time, no window missed)"


def records(skip: tuple[str, float] | None = None) -> Recorder:
    """Three instances probed every interval across the window, but for `skip`."""
    recorder = Recorder()
    for instance in ("a", "b", "c"):
        at = 0.0
        while at < WINDOW + INTERVAL:
            if (instance, at) != skip:
                recorder.probe(instance, at, ProbeResult(ok=True, total_ms=5.0))
            at += INTERVAL
    return recorder


def verdict(recorder: Recorder, capsys: pytest.CaptureFixture[str]) -> str:
    measured = analyse(recorder.dump(), 0.0, WINDOW, proxies=3)
    before = CpuSnapshot(0.0, 0.0, 0.0, 0.0, 0.0, (0.0, 0.0), "0 0 0", 0)
    after = CpuSnapshot(WINDOW, 1.0, 1.0, 1.0, 1.0, (1.0, 2.0), "0 0 0", 0)
    args = argparse.Namespace(proxies=3, squids=1, concurrency=1)
    capacity = Capacity(probes=10, failed=0, seconds=1.0, millis=[5.0] * 10)
    print_report(Run(args, measured, before, after, Memory([1024], 1024, 4), 1, 1, capacity))
    [row] = [line for line in capsys.readouterr().out.splitlines() if VERDICT in line]
    return row.rsplit("|", 2)[1].strip()


def test_a_fleet_probed_every_interval_is_on_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert verdict(records(), capsys) == "**yes**"


def test_one_missed_window_makes_the_fleet_late(capsys: pytest.CaptureFixture[str]) -> None:
    assert verdict(records(skip=("b", 30.0)), capsys) == "**no**"
