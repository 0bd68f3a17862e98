"""The workflow types as a worker of a Worker Deployment registers them, each with its behaviour.

A worker started with a deployment version (worker.py `--deployment-name`
and `--build-id`) registers these instead of the classes they extend: the
same names, signals, queries and code, plus the versioning behaviour Worker
Versioning requires of every type. docs/upgrades.md says how a release
reaches a fleet with them.

- ProxyLifecycle and ProxyPool: AUTO_UPGRADE. They run for months; pinned,
  every old version would need its workers until its last proxy or pool
  ended. Each moves to the deployment's current version at its next
  workflow task, so a change to their commands goes behind a patch
  (workflows/patches.py) and the replay corpus (tests/histories/) checks it.
- OrphanGC: PINNED. A sweep lasts minutes and the schedule starts the next
  one on the current version, so a sweep finishes on the code that began
  it and an old version drains within one sweep.

Why not `versioning_behavior=` on the classes' own `@workflow.defn`: the
server refuses a workflow task completed with a behaviour by a worker that
has no deployment version ("versioning behavior cannot be specified without
deployment options being set with versioned mode", server 1.32), and
unversioned workers stay the default.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.common import VersioningBehavior

from workflows import lifecycle, pool
from workflows.lifecycle import ProxyLifecycle, ProxyResult
from workflows.orphan_gc import GcResult, OrphanGC
from workflows.pool import PoolResult, ProxyPool

with workflow.unsafe.imports_passed_through():
    from contract import ORPHAN_GC, PROXY_LIFECYCLE, PROXY_POOL

# The SDK takes a class's run method only from the class itself, hence each
# `run` below that calls its parent's.


@workflow.defn(
    name=PROXY_LIFECYCLE,
    versioning_behavior=VersioningBehavior.AUTO_UPGRADE,
    sandboxed=lifecycle.SANDBOXED,
)
class VersionedProxyLifecycle(ProxyLifecycle):
    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> ProxyResult:
        return await super().run(raw, carried, *extra)


@workflow.defn(
    name=PROXY_POOL, versioning_behavior=VersioningBehavior.AUTO_UPGRADE, sandboxed=pool.SANDBOXED
)
class VersionedProxyPool(ProxyPool):
    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> PoolResult:
        return await super().run(raw, carried, *extra)


@workflow.defn(name=ORPHAN_GC, versioning_behavior=VersioningBehavior.PINNED)
class VersionedOrphanGC(OrphanGC):
    @workflow.run
    async def run(self, raw: Any = None, carried: Any = None, *extra: Any) -> GcResult:
        return await super().run(raw, carried, *extra)
