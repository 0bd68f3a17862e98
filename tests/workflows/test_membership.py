"""`member_changed` reports as untrusted input: parsed and capped, never raising."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.converter import default

from workflows.membership import (
    MAX_ENDPOINT_LENGTH,
    MAX_ERROR_LENGTH,
    MAX_ID_LENGTH,
    MemberReport,
    parse_report,
    signal_input,
)

GOOD: dict[str, Any] = {
    "member": "pool-a/0",
    "state": "Ready",
    "endpoint": "127.0.0.1:20000",
    "provider": "local",
    "generation": 2,
    "ready_since": "2026-12-01T10:00:00+00:00",
    "at": "2026-12-01T10:00:01+00:00",
    "seq": 7,
    "last_error": None,
}


def test_a_lifecycles_report_parses_to_the_same_report() -> None:
    report, problem = parse_report(GOOD)
    assert problem is None
    assert report == MemberReport(**GOOD)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"at": "not-a-date"}, "at"),
        ({"at": "2099-01-01T00:00:00"}, "at: has no time zone"),
        ({"at": None}, "at"),
        ({"ready_since": 12}, "ready_since"),
        # A pool adds a lifetime to it: at the end of the calendar that overflowed.
        ({"ready_since": "9999-12-31T23:59:59+00:00"}, "ready_since: later than at"),
        ({"ready_since": "2026-12-01T10:00:02+00:00"}, "ready_since: later than at"),
        ({"ready_since": "0001-01-01T00:00:00+14:00"}, "ready_since: before 2000"),
        ({"at": "1969-12-31T23:59:59+00:00"}, "at: before 2000"),
        ({"state": "Owned"}, "state"),
        ({"state": ["Ready"]}, "state"),
        ({"member": None}, "member"),
        ({"endpoint": {"host": "evil"}}, "endpoint"),
        ({"generation": -1}, "generation"),
        ({"generation": True}, "generation"),
        ({"generation": 2**70}, "generation"),
        ({"seq": "1"}, "seq"),
        ({"last_error": 5}, "last_error"),
    ],
)
def test_a_bad_field_is_named_and_nothing_is_taken(change: dict[str, Any], named: str) -> None:
    report, problem = parse_report(GOOD | change)
    assert report is None
    assert problem is not None and named in problem


@pytest.mark.parametrize("raw", [None, "Ready", 42, [GOOD], b"\x00", {"member": {}}, {}])
def test_what_is_not_a_report_object_is_refused_without_raising(raw: Any) -> None:
    report, problem = parse_report(raw)
    assert report is None and problem


def test_huge_strings_are_capped_at_the_edge() -> None:
    report, _ = parse_report(
        GOOD
        | {
            "member": "m" * 100_000,
            "endpoint": "e" * 100_000,
            "last_error": "x" * 100_000,
        }
    )
    assert report is not None
    assert len(report.member) == MAX_ID_LENGTH
    assert len(report.endpoint) == MAX_ENDPOINT_LENGTH
    assert report.last_error is not None and len(report.last_error) == MAX_ERROR_LENGTH


@pytest.mark.parametrize(
    "endpoint", ["10.0.0.1:3128 ", "\U0001f525:1", 'a"b:1', "host:1/path", "a\\b:1", "x y:1"]
)
def test_an_endpoint_that_is_no_address_and_port_is_refused(endpoint: str) -> None:
    """Every character of it may reach the pool's carried state: only an address's are taken."""
    report, problem = parse_report(GOOD | {"endpoint": endpoint})
    assert report is None and problem == "endpoint: not an address and port"


def test_addresses_of_every_shape_a_provider_reports_are_taken() -> None:
    for endpoint in ("10.0.0.1:3128", "[fd00::1]:3128", "[fe80::1%eth0]:3128", ""):
        report, problem = parse_report(GOOD | {"endpoint": endpoint})
        assert problem is None and report is not None and report.endpoint == endpoint


def test_unknown_keys_are_ignored() -> None:
    report, problem = parse_report(GOOD | {"owner": "someone else", "password": "x"})
    assert problem is None and report == MemberReport(**GOOD)


def test_the_signal_input_leads_with_a_summary_and_parses_to_the_report() -> None:
    """The Web UI cuts a signal's input short: it must begin with who and what, not a timestamp."""
    report = MemberReport(**GOOD)
    raw = signal_input(report)
    [payload] = default().payload_converter.to_payloads([raw])
    assert payload.data.decode().startswith(
        '{"_summary":"pool-a/0 Ready, 127.0.0.1:20000, generation 2"'
    )
    assert parse_report(raw) == (report, None)
