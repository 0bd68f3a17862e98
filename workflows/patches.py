"""Which patched paths a run takes, at one marker a run instead of one a patch.

Each `workflow.patched(id)` that a run takes first records a marker and,
through the SDK, an upsert of `TemporalChangeVersion`: two Temporal Cloud
actions (a marker batch, when its workflow task has no other marker, and the
upsert). By 0.3.8 a pool member's first workflow task asked four patches, a
pool run seven at its start and up to three later, a standalone proxy's
first rotation in a run one more: every marker after a run's first bought
nothing but the actions.

A release marker stands for every patch of a release at once. A run that
records it takes all the patches it covers without asking each; a run that
started before it (its history has no such marker) asks each patch as
before, so every recorded history replays unchanged. A patch added after
the newest release marker is asked on its own until the next marker covers
it. What a release marker covers is fixed once a release has recorded it:
a run that took it may not later find a patch it never knew taken.

Retiring the patches a marker covers is one step for them all
(docs/upgrades.md, Release markers).
"""

from __future__ import annotations

from dataclasses import dataclass

from temporalio import workflow

# The marker of 0.3.9, the first release to have one: it covers every patch
# of ProxyLifecycle and ProxyPool up to 0.3.9 (LIFECYCLE_RELEASE_0_3_9, POOL_RELEASE).
RELEASE_0_3_9 = "release-0.3.9"
# 0.3.10's, ProxyLifecycle's only (LIFECYCLE_RELEASE): the pool has no new patch,
# so its runs go on recording 0.3.9's.
RELEASE_0_3_10 = "release-0.3.10"


@dataclass(frozen=True)
class ReleaseMarker:
    """A patch id whose marker means: every patch in `covers` is taken."""

    patch: str
    covers: frozenset[str]


class Patches:
    """One run's patch decisions; ask `taken(id)` where `workflow.patched(id)` was asked.

    The release markers are asked at the run's first `taken`, newest first,
    so a new run records only the newest. That first ask stands where the
    run's first `workflow.patched` stood before, which keeps every marker
    before the local activities of the same workflow task, as a replay needs.
    Both workflows ask a patch at the start of every run, so an older run
    meets the question while replaying its first task and answers "no".
    Were a run's first question to come only after it went live on a new
    build, the marker would be recorded there and every covered patch taken
    from then on: what asking each for the first time live answers too.
    """

    def __init__(self, *releases: ReleaseMarker) -> None:
        # Newest first: a new run stops at the first, an old one asks them all.
        self._releases = releases
        self._covered: frozenset[str] | None = None

    def taken(self, patch: str) -> bool:
        """Whether this run takes `patch`'s new path (as `workflow.patched` answers)."""
        if self._covered is None:
            self._covered = self._release_covers()
        return patch in self._covered or workflow.patched(patch)

    def _release_covers(self) -> frozenset[str]:
        for release in self._releases:
            if workflow.patched(release.patch):
                return release.covers
        return frozenset()
