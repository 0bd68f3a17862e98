"""ProxyPool inside the SDK's workflow sandbox, to check what running it outside gives up.

workflows/pool.py runs the pool unsandboxed (`SANDBOXED`) for speed. This
twin has the same name, code and commands, so replaying a pool's recordings
with it (tests/workflows/test_replay.py) fails if pool code reads a clock,
does I/O or draws randomness outside the workflow API on any recorded path.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from workflows.pool import PoolResult, ProxyPool

with workflow.unsafe.imports_passed_through():
    from contract import PROXY_POOL


@workflow.defn(name=PROXY_POOL, sandboxed=True)
class SandboxedProxyPool(ProxyPool):
    # The SDK takes a class's run method only from the class itself.
    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> PoolResult:
        return await super().run(raw, carried, *extra)
