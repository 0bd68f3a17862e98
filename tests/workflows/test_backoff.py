"""The workflows' own backoff: the timer durations their histories record."""

from __future__ import annotations

from datetime import timedelta

from workflows.lifecycle_calls import PROVIDER_WAIT
from workflows.policies import REPLACE_BACKOFF, Backoff


def test_doubles_from_first_up_to_cap() -> None:
    backoff = Backoff(first=timedelta(seconds=5), cap=timedelta(minutes=10))

    delays = [backoff.delay(n).total_seconds() for n in range(9)]

    assert delays == [5, 10, 20, 40, 80, 160, 320, 600, 600]


def test_an_outage_of_any_length_keeps_waiting_at_the_cap() -> None:
    # 5 s * 2**45 is past timedelta's range: a day-long outage's 45th wait
    # must still be the cap, not an OverflowError in the workflow task.
    assert PROVIDER_WAIT.delay(45) == timedelta(minutes=10)
    assert PROVIDER_WAIT.delay(10_000) == timedelta(minutes=10)


def test_the_lifecycles_crash_loop_backoff_is_unchanged() -> None:
    assert [REPLACE_BACKOFF.delay(n) for n in range(3)] == [
        timedelta(seconds=10),
        timedelta(seconds=20),
        timedelta(seconds=40),
    ]
