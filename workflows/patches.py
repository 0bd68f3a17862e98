"""Every patch the workflows ask, each declared with the release that may delete it.

A change to the commands a running workflow issues is asked as a patch
(`taken`): a run that meets the question live records the patch's marker
and takes the new path; a run replaying a history without the marker takes
the old one (docs/upgrades.md, "A patch, from birth to retirement").

The project upgrades from the release before only (docs/upgrades.md, "The
floor"): 0.3.10 for 1.0. The runs 0.3.10 started took every patch before
it, so the code keeps only their new paths. What those runs recorded at
their start is still in their histories, and the SDK fails a replay on a
marker the code does not ask ("Non-deprecated patch marker encountered"):
each workflow asks its floor marker with `workflow.deprecate_patch`
(`keep_floor`), which accepts the marker and needs none.

`retire_in` is the first release that may delete a declaration: for a
floor marker, the call; for a patch, its old path (its id then becomes the
next floor's marker). tests/workflows/test_patches.py fails once the
project's version reaches it and the declaration is still here.
"""

from __future__ import annotations

from dataclasses import dataclass

from temporalio import workflow

from contract import ORPHAN_GC, PROXY_LIFECYCLE, PROXY_POOL


@dataclass(frozen=True)
class Patch:
    """A patch id, the workflow type that asks it, and the release that may delete it."""

    id: str
    workflow: str
    retire_in: str


# The release this code upgrades from: its recordings are the replay corpus.
FLOOR_RELEASE = "0.3.10"

# The floor: the marker each workflow's 0.3.10 runs recorded at their start.
# A lifecycle recorded 0.3.10's release marker, a pool 0.3.9's (0.3.10 added no
# pool patch), a sweep the one patch it asked live. 1.1 upgrades from 1.0 only,
# whose runs record these as deprecated markers, which a replay may skip.
LIFECYCLE_FLOOR = Patch("release-0.3.10", PROXY_LIFECYCLE, retire_in="1.1")
POOL_FLOOR = Patch("release-0.3.9", PROXY_POOL, retire_in="1.1")
ORPHAN_GC_FLOOR = Patch("end-members-of-closed-pools", ORPHAN_GC, retire_in="1.1")

# Added after 0.3.10, each asked on its own where it decides. In 1.1 (which
# upgrades from 1.0 only, whose runs all took them) the old path goes and the
# id is asked with `keep_floor` instead.
#
# A terminate that finds the cancelled monitor still running waits for it at
# most MONITOR_LET_GO past its next probe, once every instance is gone, rather
# than until the heartbeat timeout of a monitor whose worker was lost.
LET_GO_OF_LOST_MONITOR = Patch("let-go-of-lost-monitor", PROXY_LIFECYCLE, retire_in="1.1")
# An instance its platform took away (preempted, interrupted, evicted) is
# replaced at once and counted apart; the crash budget is the proxy's own.
DISRUPTIONS_SPARE_THE_CRASH_BUDGET = Patch(
    "disruptions-spare-the-crash-budget", PROXY_LIFECYCLE, retire_in="1.1"
)
# A member's endpoint check that meets a quota is asked again after the
# error's delay, rather than refusing the member's report.
VERIFY_WAITS_OUT_QUOTA = Patch("verify-waits-out-quota", PROXY_POOL, retire_in="1.1")
# A pool keeps a digest of its `endpoints` in its memo, so a gateway queries
# them once per change rather than whenever the history moved (pool_feed.py).
PUBLISH_ENDPOINTS_DIGEST = Patch("publish-endpoints-digest", PROXY_POOL, retire_in="1.1")

FLOOR = (LIFECYCLE_FLOOR, POOL_FLOOR, ORPHAN_GC_FLOOR)
PATCHES = (
    LET_GO_OF_LOST_MONITOR,
    DISRUPTIONS_SPARE_THE_CRASH_BUDGET,
    VERIFY_WAITS_OUT_QUOTA,
    PUBLISH_ENDPOINTS_DIGEST,
)


def taken(patch: Patch) -> bool:
    """Whether this run takes `patch`'s new path (recording its marker, if live)."""
    return workflow.patched(patch.id)


def keep_floor(floor: Patch) -> None:
    """Accept the floor's marker where the floor's runs recorded it; the code has one path.

    Asked where the floor's runs asked their first patch, before any local
    activity of the same workflow task.
    """
    workflow.deprecate_patch(floor.id)
