"""The gateway's demand (gateway/demand.py) and its autoscaling flags, without a pool.

Open tunnels are the router's count (tests/gateway/test_squid.py checks it
against real tunnels); the reports themselves are tested against a pool in
tests/workflows/test_pool_autoscale_e2e.py.
"""

from __future__ import annotations

import time
from typing import cast

import pytest
from temporalio.client import Client

from gateway.demand import DemandMeter, DemandReporter, Sample, gateway_name, moved
from gateway.main import UsageError, checked, parse_args
from gateway.squid import GatewayError, Tunnels


def test_the_meter_gives_each_pool_its_own_peak_and_granted_tunnels() -> None:
    counts = iter(
        [
            Tunnels(2, {"eu": (2, 2)}),
            Tunnels(5, {"eu": (4, 5), "us": (1, 1)}),
            Tunnels(1, {"eu": (0, 5), "us": (1, 1)}),
            Tunnels(1, {"eu": (0, 5), "us": (1, 1)}),
            Tunnels(0, {"eu": (0, 5), "us": (0, 3)}),
        ]
    )
    meter = DemandMeter(lambda: next(counts))
    assert [meter.sample(), meter.sample(), meter.sample()] == [2, 5, 1]
    assert meter.take() == {"eu": Sample(open_tunnels=4, new_tunnels=5), "us": Sample(1, 1)}
    # Since the last take: eu granted none and held none; us held one and granted two more.
    assert meter.take() == {"us": Sample(open_tunnels=1, new_tunnels=2)}


def test_a_look_the_router_did_not_answer_keeps_the_last_count() -> None:
    answers = [Tunnels(3, {"eu": (3, 3)})]

    def router_count() -> Tunnels:
        if not answers:
            raise GatewayError("the router did not answer in 30s")
        return answers.pop()

    meter = DemandMeter(router_count)
    assert [meter.sample(), meter.sample()] == [3, 3]
    assert meter.take() == {"eu": Sample(open_tunnels=3, new_tunnels=3)}


def test_each_pool_is_reported_its_own_demand_when_it_moved() -> None:
    pools = ["eu", "us", "fixed"]
    reporter = DemandReporter(
        cast(Client, None), lambda: pools, DemandMeter(lambda: Tunnels(0, {})), "gw"
    )
    reporter.fixed.add("fixed")
    assert reporter.due({"us": Sample(3, 1)}) == {"eu": Sample(0, 0), "us": Sample(3, 1)}
    reporter.last = {"eu": Sample(0, 0), "us": Sample(3, 1)}
    reporter.last_at = dict.fromkeys(pools, time.monotonic())
    assert reporter.due({"us": Sample(3, 0)}) == {"us": Sample(3, 0)}
    assert reporter.due({"eu": Sample(1, 1), "us": Sample(3, 1)}) == {"eu": Sample(1, 1)}


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
