"""Members' exit addresses as the gateway takes them from the pool and exports them."""

from __future__ import annotations

from prometheus_client import REGISTRY

from gateway import metrics
from gateway.membership import parse_endpoints


def test_exit_addresses_are_taken_only_when_they_are_one_ip_address() -> None:
    members = parse_endpoints(
        [
            {"member": "p/0", "endpoint": "10.0.0.1:3128", "exit_address": "203.0.113.1"},
            {"member": "p/1", "endpoint": "10.0.0.2:3128", "exit_address": "2001:DB8::1"},
            {"member": "p/2", "endpoint": "10.0.0.3:3128", "exit_address": 'x"} 1\nevil 2'},
            {"member": "p/3", "endpoint": "10.0.0.4:3128", "exit_address": ["203.0.113.9"]},
            {"member": "p/4", "endpoint": "10.0.0.5:3128"},  # from a pool of an earlier release
        ]
    )

    assert [m.exit_address for m in members] == ["203.0.113.1", "2001:db8::1", None, None, None]


def test_the_metrics_list_each_members_exit_and_count_the_distinct_ones() -> None:
    members = parse_endpoints(
        [
            {"member": "p/0", "endpoint": "10.0.0.1:3128", "exit_address": "203.0.113.1"},
            {"member": "p/1", "endpoint": "10.0.0.2:3128", "exit_address": "203.0.113.1"},
            {"member": "p/2", "endpoint": "10.0.0.3:3128"},
        ]
    )

    metrics.set_members(members)
    metrics.set_members(members[1:])  # p/0 left: its series goes with it

    def value(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    assert value("proxy_operator_gateway_members") == 2
    assert value("proxy_operator_gateway_distinct_exits") == 1
    info = "proxy_operator_gateway_member_exit_info"
    assert value(info, member="p/1", exit_address="203.0.113.1") == 1
    assert value(info, member="p/0", exit_address="203.0.113.1") is None
