"""ProxyPool and ProxyLifecycle inside the SDK's workflow sandbox, to check what running
them outside gives up.

workflows/pool.py and workflows/lifecycle.py run their workflows unsandboxed
(`SANDBOXED`) for speed. These twins have the same names, code and commands,
so replaying the recordings with them (tests/workflows/test_replay.py) fails
if workflow code reads a clock, does I/O or draws randomness outside the
workflow API on any recorded path.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from workflows.lifecycle import ProxyLifecycle, ProxyResult
from workflows.pool import PoolResult, ProxyPool

with workflow.unsafe.imports_passed_through():
    from contract import PROXY_LIFECYCLE, PROXY_POOL


# The SDK takes a class's run method only from the class itself.
@workflow.defn(name=PROXY_POOL, sandboxed=True)
class SandboxedProxyPool(ProxyPool):
    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> PoolResult:
        return await super().run(raw, carried, *extra)


@workflow.defn(name=PROXY_LIFECYCLE, sandboxed=True)
class SandboxedProxyLifecycle(ProxyLifecycle):
    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> ProxyResult:
        return await super().run(raw, carried, *extra)
