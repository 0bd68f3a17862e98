"""What a pool's stand-in matches filters by (gateway/wake.py), from the pool's input alone.

Waking itself, and the tunnel once the member is up, are tested against real
pools in tests/workflows/test_pool_autoscale_e2e.py and test_gateway_pools.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.wake import Placed, placed_by
from workflows.pool_input import PoolInput


def pool(**fields: Any) -> PoolInput:
    return PoolInput.model_validate({"autoscale": {"max_replicas": 2}, **fields})


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        # One zone: every member is there.
        (
            {"template": {"provider": "gce", "placement": {"zone": "europe-west1-b"}}},
            Placed("europe-west1-b", "europe-west1", "gce"),
        ),
        # No zone: the provider picks one, so only the provider is sure.
        ({"template": {"provider": "ec2"}}, Placed(provider="ec2")),
        # A spread over two zones of one region, one provider.
        (
            {
                "template": {"provider": "gce"},
                "spread": [
                    {"provider": "gce", "placement": {"zone": "us-east1-b"}},
                    {"provider": "gce", "placement": {"zone": "us-east1-c"}},
                ],
            },
            Placed(region="us-east1", provider="gce"),
        ),
        # A spread over two providers: nothing is the same for every member.
        (
            {
                "template": {"provider": "gce"},
                "spread": [
                    {"provider": "gce", "placement": {"zone": "us-east1-b"}},
                    {"provider": "ec2"},
                ],
            },
            Placed(),
        ),
    ],
)
def test_a_stand_in_fixes_only_what_every_member_of_its_pool_would_have(
    fields: dict[str, Any], where: Placed
) -> None:
    assert placed_by(pool(**fields)) == where
