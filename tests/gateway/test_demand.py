"""The gateway's demand (gateway/demand.py) and its autoscaling flags, without a pool.

Open tunnels are the router's count (tests/gateway/test_squid.py checks it
against real tunnels); the reports themselves are tested against a pool in
tests/workflows/test_pool_autoscale_e2e.py.
"""

from __future__ import annotations

import pytest

from gateway.demand import DemandMeter, Sample, gateway_name, moved
from gateway.main import UsageError, checked, parse_args
from gateway.squid import GatewayError


def test_the_meter_reports_the_peak_since_the_last_report_and_the_granted_tunnels() -> None:
    counts = iter([2, 5, 1, 0, 0])
    meter = DemandMeter(lambda: next(counts))
    assert [meter.sample(), meter.sample(), meter.sample()] == [2, 5, 1]
    count = meter.counting(lambda line: None)
    for line in ("1 2 200 TCP_TUNNEL/200 ...", "", "1 2 407 TCP_DENIED/407 ...", "200"):
        count(line)  # only a granted tunnel is demand: not a refused client
    assert meter.take() == Sample(open_tunnels=5, new_tunnels=1)
    assert meter.take() == Sample(open_tunnels=0, new_tunnels=0)


def test_a_look_the_router_did_not_answer_keeps_the_last_count() -> None:
    answers: list[int] = [3]

    def router_count() -> int:
        if not answers:
            raise GatewayError("the router did not answer in 30s")
        return answers.pop()

    meter = DemandMeter(router_count)
    assert [meter.sample(), meter.sample()] == [3, 3]
    assert meter.take() == Sample(open_tunnels=3, new_tunnels=0)


@pytest.mark.parametrize(
    ("last", "now", "worth"),
    [
        (None, Sample(0, 0), True),
        (Sample(0, 0), Sample(0, 0), False),
        (Sample(0, 0), Sample(1, 0), True),
        (Sample(3, 0), Sample(0, 0), True),
        (Sample(0, 0), Sample(0, 4), True),
        (Sample(100, 5), Sample(109, 7), False),
        (Sample(100, 5), Sample(111, 7), True),
    ],
)
def test_only_a_demand_that_moved_is_reported_again(
    last: Sample | None, now: Sample, worth: bool
) -> None:
    assert moved(last, now) is worth


def test_the_default_name_is_the_host_and_the_listen_port() -> None:
    name = gateway_name(("0.0.0.0", 8888))
    assert name.endswith(":8888") and name[0].isalnum()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--gateway-name", "a b"], "--gateway-name: 'a b' must be 1-100 letters"),
        (["--gateway-name", "x" * 101], "--gateway-name"),
        (["--gateway-name", "gw\n"], "--gateway-name"),
        (["--report-interval", "1"], "--report-interval: 1.0 is not between 5 and 300"),
        (["--report-interval", "nan"], "--report-interval: nan is not between"),
        (["--wake-timeout", "-1"], "--wake-timeout: -1.0 is not between 0 and 600 seconds"),
        (["--wake-timeout", "inf"], "--wake-timeout: inf is not between"),
    ],
)
def test_bad_reporting_flags_are_named(
    argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROXY_OPERATOR_CONFIG", "providers.yaml")
    with pytest.raises(UsageError, match=expected.replace("(", r"\(")):
        checked(parse_args(["--pool", "web", *argv]))
