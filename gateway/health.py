"""The gateway's /healthz and /readyz: whether it works, and whether to send it clients.

Liveness (/healthz): the gateway has started, and its supervising loop,
which ends the process when the gateway's Squid exits, checked that Squid
within LIVE_SECONDS. A restart is what cures a gateway that fails it.

Readiness (/readyz), besides liveness:

- the gateway can learn its membership: Temporal answered a question about
  each open pool (the follower's describe or `endpoints` query, or a wake
  hold's query) within `stale_after`, STALE_POLLS polls plus
  SDK_RETRY_SECONDS, the time the SDK retries one call before it fails. A
  change applied to the router does not count against it: the gateway asks
  nothing meanwhile. A pool that has closed is not asked any more, and does
  not count either: the gateway serves the others (gateway/pools.py);
- it has a member to route to, or it holds clients for an autoscaled pool
  at zero (gateway/wake.py). A CONNECT to such a gateway wakes the pool, so
  it stays ready at zero: a gateway that turned unready there would keep
  away the very clients that wake the pool. With `--wake-timeout 0` it
  holds no one, and at zero it is not ready.

A gateway that is not ready still forwards to the members it has; readiness
is the word to a load balancer (a Kubernetes Service) to send clients to
another gateway meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import cli
from gateway.wake import real
from squid.gateway import GatewayMember

LIVE_SECONDS = 30.0
STALE_POLLS = 3
# temporalio.service.RetryConfig's max_elapsed_time: a call to an
# unreachable server fails after about this long.
SDK_RETRY_SECONDS = 10.0
MAX_ERROR = 200


def stale_after(poll_seconds: float, debounce_seconds: float) -> float:
    """Seconds without an answer from Temporal after which the membership is not known."""
    return STALE_POLLS * max(poll_seconds, debounce_seconds) + SDK_RETRY_SECONDS


class GatewayHealth(cli.Health):
    """The gateway's liveness and readiness, fed by its supervising loop and membership follower."""

    def __init__(self, pools: Sequence[str], stale_seconds: float) -> None:
        self.pools = tuple(pools)
        self.stale_seconds = stale_seconds
        now = time.monotonic()
        self._checked_at = now
        # Per open pool: when Temporal last answered about it, and its last error.
        self._known_at = dict.fromkeys(self.pools, now)
        self._errors = dict.fromkeys(self.pools, "")
        self._applying = False
        self._members = 0
        self._holding = False

    def checked_squid(self) -> None:
        """The supervising loop found the gateway's Squid running."""
        self._checked_at = time.monotonic()

    def answered(self, pool: str) -> None:
        """Temporal answered a question about `pool`'s membership."""
        if pool in self._known_at:
            self._known_at[pool] = time.monotonic()
            self._errors[pool] = ""

    def failed(self, pool: str, err: BaseException) -> None:
        """A question about `pool`'s membership failed: said in /readyz once it is stale."""
        if pool in self._errors:
            self._errors[pool] = " ".join(str(err).split())[:MAX_ERROR] or type(err).__name__

    def closed(self, pool: str) -> None:
        """`pool` has closed: nothing more is asked of it, so it cannot go stale."""
        self._known_at.pop(pool, None)
        self._errors.pop(pool, None)

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        """While a change goes to the router: the follower asks again once it is in force."""
        self._applying = True
        try:
            yield
        finally:
            self._applying = False
            now = time.monotonic()
            self._known_at = {pool: max(at, now) for pool, at in self._known_at.items()}

    def routes(self, members: Sequence[GatewayMember]) -> None:
        """What the backs forward to now: the pool's members, or the wake holder."""
        self._members = len(real(members))
        self._holding = len(members) > self._members

    def not_live(self) -> str | None:
        problem = super().not_live()
        age = time.monotonic() - self._checked_at
        if problem is None and age > LIVE_SECONDS:
            return f"the gateway's loop has not checked its Squid for {age:.0f}s"
        return problem

    def not_ready(self) -> str | None:
        problem = self.not_live()
        if problem is not None:
            return problem
        now = time.monotonic()
        for pool, known_at in self._known_at.items():
            age = now - known_at
            if not self._applying and age > self.stale_seconds:
                why = f": {self._errors[pool]}" if self._errors[pool] else ""
                return f"cannot learn pool {pool}'s members: no answer for {age:.0f}s{why}"
        if self._members or self._holding:
            return None
        if len(self.pools) == 1:
            return f"pool {self.pools[0]} lists no member to route to"
        return f"pools {', '.join(self.pools)} list no member to route to"
