"""The gateway's demand (gateway/demand.py) and its autoscaling flags, without a pool.

Open tunnels are read from the kernel's socket table, so these tests hold
real connections to a real listener (a stand-in for the router); the
reports themselves are tested against a pool in tests/workflows/test_pool_autoscale_e2e.py.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from gateway.demand import DemandMeter, Sample, connections_to, gateway_name, moved
from gateway.main import UsageError, checked, parse_args

# Loopback addresses no other test listens on or dials: a test elsewhere that
# waits for its own service on 127.0.0.1 and was handed the same port number
# would otherwise connect to this listener, and be counted (it was, once).
HOST = "127.0.0.3"
OTHER_HOST = "127.0.0.4"


@contextlib.contextmanager
def listener_with_clients(count: int, host: str = HOST, port: int = 0) -> Iterator[int]:
    """A listening socket on `host` holding `count` accepted client connections."""
    with socket.socket() as server:
        server.bind((host, port))
        server.listen()
        port = server.getsockname()[1]
        with contextlib.ExitStack() as stack:
            for _ in range(count):
                stack.enter_context(socket.create_connection((host, port)))
                stack.enter_context(server.accept()[0])
            yield port


def test_connections_to_counts_the_dialling_side_of_each_connection_to_the_ends() -> None:
    with listener_with_clients(3) as port:
        # The listener's three accepted sockets have the port as their *local* port.
        assert len(connections_to([(HOST, port)])) == 3
        # Another address with the same port number is another listener.
        with listener_with_clients(2, OTHER_HOST, port):
            assert len(connections_to([(HOST, port)])) == 3
            assert len(connections_to([(HOST, port), (OTHER_HOST, port)])) == 5
    with listener_with_clients(0) as port:
        assert len(connections_to([(HOST, port)])) == 0


def test_the_meter_reports_the_peak_since_the_last_report_and_the_granted_tunnels() -> None:
    with listener_with_clients(2) as port:
        meter = DemandMeter([(HOST, port)])
        assert meter.sample() == 0, "counted once two looks in a row found them open"
        assert meter.sample() == 2
        count = meter.counting(lambda line: None)
        for line in ("1 2 200 TCP_TUNNEL/200 ...", "", "1 2 407 TCP_DENIED/407 ...", "200"):
            count(line)  # only a granted tunnel is demand: not a refused client
    assert meter.take() == Sample(open_tunnels=2, new_tunnels=1)
    assert meter.take() == Sample(open_tunnels=0, new_tunnels=0)


def test_a_connection_that_lives_between_two_looks_is_no_demand() -> None:
    """A refused CONNECT's connection to the router lives while its credentials are
    checked: however many there are, none lasts from one look to the next."""
    with listener_with_clients(1) as port:
        meter = DemandMeter([(HOST, port)])
        meter.sample()
        with contextlib.ExitStack() as stack:  # five more, open at one look only
            for _ in range(5):
                stack.enter_context(socket.create_connection((HOST, port)))
            assert meter.sample() == 1
        assert meter.sample() == 1
    assert meter.take() == Sample(open_tunnels=1, new_tunnels=0)


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
