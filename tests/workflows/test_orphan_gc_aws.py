"""OrphanGC on the AWS provider: an instance whose owner never existed is found and terminated.

A real dev server and worker, the provider on moto's EC2 behind
tests/fakes/ec2.py; the orphan is launched through the provider itself, as
a lifecycle that crashed before recording it would have left it. An owned
instance (a running owner listing it) and another installation's are kept.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
from temporalio.testing import WorkflowEnvironment

from providers.aws import AwsConfig, AwsProvider
from providers.base import CreateRequest
from providers.naming import instance_name, owner_tags
from tests.fakes.ec2 import FakeEc2
from tests.fakes.owners import start_owner
from tests.helpers.config import proxy_config
from tests.workflows.test_orphan_gc import StartGcWorker, sweep
from tests.workflows.test_orphan_gc import gc_worker as gc_worker

pytestmark = pytest.mark.slow

PROVIDER = "aws-gc"


@pytest.fixture
def fake() -> Iterator[FakeEc2]:
    with FakeEc2() as server:
        yield server


async def test_an_aws_orphan_is_found_and_terminated(
    fake: FakeEc2, temporal_env: WorkflowEnvironment, gc_worker: StartGcWorker
) -> None:
    subnet = fake.subnets()[0][0]
    block = {"region": "eu-west-1", "subnets": [subnet]}
    config = proxy_config(443, {"name": PROVIDER, "type": "aws", "aws": block})
    settings = config.provider(PROVIDER).settings
    assert isinstance(settings, AwsConfig)
    provider = AwsProvider(settings, config.installation, ec2=fake.client(), console_interval=0)
    other = AwsProvider(settings, "another-installation", ec2=fake.client(), console_interval=0)
    namespace = temporal_env.client.namespace

    def name_of(installation: str, owner: str) -> str:
        return instance_name(owner, 0, installation=installation, namespace=namespace)

    def launch(on: AwsProvider, installation: str, owner: str) -> str:
        made = on.create(
            CreateRequest(
                name=name_of(installation, owner),
                proxy=config.proxy_settings(),
                tags=owner_tags(installation, owner, 0, namespace=namespace),
            )
        )
        return made.provider_id

    owned_by = f"owner-{uuid.uuid4().hex[:8]}"
    owner = await start_owner(
        temporal_env.client,
        owned_by,
        provider=PROVIDER,
        instances=[name_of(config.installation, owned_by)],
        task_queue=f"nobody-{uuid.uuid4().hex[:8]}",
    )
    orphan, owned, foreign = await asyncio.gather(
        asyncio.to_thread(launch, provider, config.installation, f"never-{uuid.uuid4().hex}"),
        asyncio.to_thread(launch, provider, config.installation, owned_by),
        asyncio.to_thread(launch, other, "another-installation", f"theirs-{uuid.uuid4().hex}"),
    )
    task_queue = gc_worker({PROVIDER: provider}, config)

    result = await sweep(temporal_env.client, task_queue, grace_period_seconds=0)

    [aws] = result.providers
    assert (aws.seen, aws.orphaned, aws.deleted, aws.failed) == (2, 1, 1, 0)
    assert aws.deleted_ids == [orphan]
    states = {instance.id: instance.state for instance in fake.instances()}
    assert states == {orphan: "terminated", owned: "running", foreign: "running"}
    await owner.terminate()
