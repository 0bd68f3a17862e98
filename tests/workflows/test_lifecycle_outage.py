"""A provider outage is waited out: six simulated hours of 503s cost no proxy.

The Kubernetes API is the fake of tests/fakes/kubernetes.py answering every
request with 503 (what an API server behind a failing load balancer or an
overloaded apiserver returns: https://kubernetes.io/docs/reference/using-api/api-concepts/
lists 503 among the responses a client must retry); the real `kubernetes`
client, the real provider and the real worker run on top, and a real Squid
behind every Pod. The time-skipping test server jumps over the workflow's
"waiting for provider" timers, which only works because the waits are
workflow timers: an activity retrying inside Temporal would hold the clock
at wall-clock pace (tests/helpers/time_skipping.py).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
from temporalio.testing import WorkflowEnvironment

from providers.kubernetes import KubernetesProvider
from tests.fakes.kubernetes import FakeKubernetes
from tests.helpers.config import lifecycle_instance_name
from tests.helpers.histories import record_history
from tests.helpers.network import free_port
from tests.helpers.squid_upstream import SquidUpstreams, requires_squid
from tests.helpers.stacks import ProviderStack, StackFactory
from tests.helpers.time_skipping import skip_past_pending_timer
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import status_of, wait_for, wait_status
from tests.workflows.test_lifecycle_kubernetes import (  # noqa: F401 (fake, provider: fixtures)
    NAMESPACE,
    PROVIDER,
    Kubelet,
    cluster_config,
    fake,
    leftover_pods,
    provider,
)

pytestmark = [pytest.mark.slow, requires_squid]

OUTAGE = timedelta(hours=6)
# Virtual time skipped per step: each step's timers fire and their calls fail
# within the client's 30 s deadline for one skip.
STEP = timedelta(minutes=30)
VERBS = ("GET", "POST", "PUT", "PATCH", "DELETE")


async def test_six_hours_of_503_are_waited_out_and_every_proxy_comes_back(
    time_skipping_env: WorkflowEnvironment,
    provider_stack_on: StackFactory,
    provider: KubernetesProvider,  # noqa: F811
    fake: FakeKubernetes,  # noqa: F811
    squid_upstreams: SquidUpstreams,
    tls_origin: TlsOrigin,
) -> None:
    env = time_skipping_env
    stack: ProviderStack = await provider_stack_on(
        env, {PROVIDER: provider}, cluster_config(tls_origin.port)
    )
    kubelet = Kubelet(fake, squid_upstreams, free_port())
    handles = [await stack.start(PROVIDER, port=kubelet.port) for _ in range(2)]
    for handle in handles:
        await kubelet.run_pod(lifecycle_instance_name(handle.id, 0))
        await wait_status(handle, lambda s: s.state == "Ready", "generation 0 Ready")

    # The outage: every API request answers 503, and every Pod dies with it,
    # so every proxy needs a replacement that cannot be made.
    for method in VERBS:
        fake.fail(
            method, ".", 503, "the server is currently unable to handle the request", times=None
        )
    for handle in handles:
        await kubelet.crash(lifecycle_instance_name(handle.id, 0))
    for handle in handles:
        waiting = await wait_status(
            handle,
            lambda s: (s.waiting_for or "").startswith("waiting for provider:"),
            "the replacement's create waiting for the provider",
        )
        assert waiting.state == "Replacing" and "503" in (waiting.waiting_for or ""), waiting

    outage_ends = await env.get_current_time() + OUTAGE
    while (now := await env.get_current_time()) < outage_ends:
        await env.sleep(min(STEP, outage_ends - now))
        for handle in handles:
            status = await status_of(handle)
            assert status.state == "Replacing", status
            assert status.failures_in_a_row == 1, "the outage spent the crash budget"
            assert (status.waiting_for or "").startswith("waiting for provider:"), status

    fake.clear_failures()
    for handle in handles:
        # Its next provider timer fires: the new Pod is made, the old one deleted.
        replacement = lifecycle_instance_name(handle.id, 1)

        async def replacement_created() -> bool:
            if kubelet.pod(replacement) is None:  # noqa: B023 (awaited within the iteration)
                with contextlib.suppress(AssertionError):  # no timer pending: a call runs
                    await skip_past_pending_timer(env, handle)  # noqa: B023
            return kubelet.pod(replacement) is not None  # noqa: B023

        await wait_for(replacement_created, "the replacement's pod once the API is back")
        await kubelet.finish_deletion(lifecycle_instance_name(handle.id, 0))
        await kubelet.run_pod(lifecycle_instance_name(handle.id, 1))
    for handle in handles:
        ready = await wait_status(
            handle, lambda s: s.state == "Ready" and s.generation == 1, "generation 1 Ready"
        )
        assert ready.waiting_for is None and ready.replacements == 1, ready
    assert sorted(leftover_pods(provider)) == sorted(
        f"{NAMESPACE}/{lifecycle_instance_name(h.id, 1)}" for h in handles
    )

    for handle in handles:
        await handle.signal("terminate")
        await kubelet.finish_deletion(lifecycle_instance_name(handle.id, 1))
        result = await handle.result()
        assert result["state"] == "Terminated", result
    assert leftover_pods(provider) == []
    await record_history(handles[0], "provider_outage_waited_out")
