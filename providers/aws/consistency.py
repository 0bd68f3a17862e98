"""What EC2 may not show yet: its API is eventually consistent.

AWS, "Eventual consistency in the Amazon EC2 API"
(https://docs.aws.amazon.com/ec2/latest/devguide/eventual-consistency.html):
an `InvalidInstanceID.NotFound` right after RunInstances "does not mean the
instance does not exist", a NotFound from TerminateInstances means the
instance "might still be running", and the same holds for
`InvalidGroup.NotFound` after CreateSecurityGroup. The page says to ask
again with backoff "up to about five minutes". So an instance is taken for
gone only once that window has passed: before, its absence is "not visible
yet" (Transient), and the workflow keeps waiting instead of replacing it.

How old an instance is comes from what this provider object knows: the
launch time RunInstances (or a describe) answered for the instances it made
or saw. An id it knows nothing about (another worker made it, or this
worker restarted) gets its window from the first time it was found
missing: EC2 cannot tell this provider an instance it does not show yet
from one that ended over an hour ago and is no longer listed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime

# The page's "up to about five minutes".
CONSISTENCY_WINDOW_SECONDS = 300.0
# What is older than this is forgotten; asked about again, it starts a new window.
FORGET_AFTER_SECONDS = 24 * 3600.0


class Sightings:
    """Per instance id (or client token key): since when it may exist unseen, in epoch seconds.

    The launch, or the first time it was found missing.
    """

    def __init__(
        self, window: float = CONSISTENCY_WINDOW_SECONDS, clock: Callable[[], float] = time.time
    ) -> None:
        self.window = window
        self._clock = clock
        self._known: dict[str, float] = {}
        self._lock = threading.Lock()

    def seen(self, instance_id: str, at: object) -> None:
        """An instance EC2 showed (or launched) for this provider, `at` its LaunchTime."""
        since = at.timestamp() if isinstance(at, datetime) else self._clock()
        with self._lock:
            self._forget_old()
            self._known.setdefault(instance_id, since)

    def young(self, key: str) -> bool:
        """Whether EC2 may still not show `key` (an instance id, or a client token's key).

        Within the window since it began: at its launch, if this provider
        knows it; else now, the first time it is found missing.
        """
        now = self._clock()
        with self._lock:
            self._forget_old()
            since = self._known.setdefault(key, now)
        return now - since < self.window

    def _forget_old(self) -> None:
        cutoff = self._clock() - FORGET_AFTER_SECONDS
        for key in [k for k, since in self._known.items() if since < cutoff]:
            del self._known[key]
