"""What a pool's stand-in matches filters by (gateway/wake.py), from the pool's input alone.

Waking itself, and the tunnel once the member is up, are tested against real
pools in tests/workflows/test_pool_autoscale_e2e.py and test_gateway_pools.py.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload, Payloads, WorkflowType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import StartWorkflowExecutionRequest
from temporalio.testing import WorkflowEnvironment

from gateway.wake import Placed, placed, placed_by
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


@pytest.mark.parametrize(
    "payload",
    [
        Payload(metadata={"encoding": b"binary/who-knows"}, data=b"x"),
        Payload(metadata={"encoding": b"json/plain"}, data=b"[" * 100_000),
        Payload(metadata={"encoding": b"json/plain"}, data=b'{"replicas": "many"}'),
    ],
    ids=["unknown encoding", "nested too deep", "not a pool input"],
)
async def test_a_pool_started_with_an_unreadable_input_gets_a_stand_in_fixing_nothing(
    temporal_env: WorkflowEnvironment, payload: Payload
) -> None:
    """Anyone in the namespace may start a pool with any payload: the gateway that fronts
    it logs that it cannot read it and carries on, its stand-in matching no filter."""
    pool_id = f"pool-{uuid.uuid4().hex[:8]}"
    await temporal_env.client.workflow_service.start_workflow_execution(
        StartWorkflowExecutionRequest(
            namespace=temporal_env.client.namespace,
            workflow_id=pool_id,
            workflow_type=WorkflowType(name="ProxyPool"),
            task_queue=TaskQueue(name=f"nobody-{pool_id}"),
            input=Payloads(payloads=[payload]),
            request_id=uuid.uuid4().hex,
        )
    )
    handle = temporal_env.client.get_workflow_handle(pool_id)
    try:
        assert await placed(temporal_env.client, pool_id) == Placed()
    finally:
        await handle.terminate("test done")
