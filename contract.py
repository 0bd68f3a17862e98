"""The names workflows, activities, the worker and users share.

Both sides import this module and nothing else of each other's, so loading
an activity never loads a workflow (see docs/architecture.md, "Layout").
Every value here is part of the contract with running workflows and with the
people who start, query and list them: renaming one breaks them.
"""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum
from typing import Any

from temporalio.common import SearchAttributeKey

TASK_QUEUE = "proxy-operator"
# A pool started on a task queue named with this suffix runs in a worker of its
# own (`worker.py --serve pools` polls "proxy-operator-pools"), away from the
# CPU its members' workflow tasks and probes take: a 1,000-member pool sharing
# a worker with them waits for the interpreter lock on every task. Its members
# and every activity it asks for run on the queue without the suffix.
POOL_QUEUE_SUFFIX = "-pools"
POOL_TASK_QUEUE = TASK_QUEUE + POOL_QUEUE_SUFFIX

# Workflow type names, as `temporal workflow start --type` spells them.
PROXY_LIFECYCLE = "ProxyLifecycle"
ORPHAN_GC = "OrphanGC"
PROXY_POOL = "ProxyPool"

# Signals, as `temporal workflow signal --name` spells them. A ProxyLifecycle
# takes `terminate` and `rotate`, and a member `instance_failing` from its
# pool's monitor; a ProxyPool takes `terminate`, and `member_changed` from
# its own members.
TERMINATE_SIGNAL = "terminate"
ROTATE_SIGNAL = "rotate"
INSTANCE_FAILING_SIGNAL = "instance_failing"
MEMBER_CHANGED_SIGNAL = "member_changed"

# The Temporal Schedule every worker keeps running OrphanGC.
ORPHAN_GC_SCHEDULE_ID = "proxy-operator-orphan-gc"

# Search attributes a ProxyLifecycle upserts.
STATE = SearchAttributeKey.for_keyword("ProxyState")
PROVIDER = SearchAttributeKey.for_keyword("ProxyProvider")
ENDPOINT = SearchAttributeKey.for_keyword("ProxyEndpoint")
# Every instance a lifecycle owns or is creating, by name: orphan GC keeps an
# instance only while its owner lists it here.
INSTANCES = SearchAttributeKey.for_keyword_list("ProxyInstances")
KEYWORDS = (STATE, PROVIDER, ENDPOINT)
# The pool a ProxyLifecycle belongs to, set when the pool starts it; a
# ProxyPool sets it to its own id, so `ProxyPool='pool-demo'` lists pool and members.
POOL = SearchAttributeKey.for_keyword("ProxyPool")
SEARCH_ATTRIBUTES: tuple[SearchAttributeKey[Any], ...] = (*KEYWORDS, INSTANCES, POOL)
# The memo key under which a ProxyPool keeps a digest of its `endpoints`
# answer (workflows/pool_feed.py): a gateway describes the pool, which is not
# billed, and queries `endpoints` only when the digest moved.
ENDPOINTS_DIGEST_MEMO = "endpoints_digest"


def members_task_queue(pool_queue: str) -> str:
    """Where a pool on `pool_queue` starts its members and runs its activities.

    The queue without POOL_QUEUE_SUFFIX; a pool on any other queue keeps all
    on its own, as pools always have. Derived from the queue the pool runs
    on, never from its input: a member's queue decides which worker's code
    reports its endpoint, and so where the fleet's credentials go.
    """
    return pool_queue.removesuffix(POOL_QUEUE_SUFFIX) or pool_queue


class ProxyState(StrEnum):
    """A proxy's state: `status.state` and the ProxyState search attribute."""

    PROVISIONING = "Provisioning"
    READY = "Ready"
    UNHEALTHY = "Unhealthy"
    REPLACING = "Replacing"
    TERMINATING = "Terminating"
    TERMINATED = "Terminated"
    FAILED = "Failed"


class PoolState(StrEnum):
    """A pool's state: its `status.state` and its ProxyState search attribute."""

    SCALING = "Scaling"
    READY = "Ready"
    DEGRADED = "Degraded"
    TERMINATING = "Terminating"
    TERMINATED = "Terminated"


class ErrorType(StrEnum):
    """Every `ApplicationError` type this system raises, the only ones retries select on."""

    # The provider taxonomy: providers/errors.py's class names.
    NOT_FOUND = "NotFound"
    QUOTA_EXCEEDED = "QuotaExceeded"
    TRANSIENT = "Transient"
    PERMANENT = "Permanent"
    # Raised by activities: the instance died or vanished while provisioning.
    INSTANCE_LOST = "InstanceLost"
    # Raised by activities: the platform took the instance away (a preemption,
    # a spot interruption, an eviction), no failure of the proxy's.
    INSTANCE_DISRUPTED = "InstanceDisrupted"
    # Raised by activities and workflows: bad input, naming the field.
    INVALID_INPUT = "InvalidInput"
    # Raised by activities on a draining worker, so the server retries elsewhere.
    WORKER_SHUTDOWN = "WorkerShutdown"
    # A lifecycle's end after too many failed instances in a row.
    CRASH_LOOP = "CrashLoop"
    # A lifecycle's end on an error that carried no type of its own.
    UNCLASSIFIED = "Failed"
    # A lifecycle's end on a state transition its table does not allow: a bug
    # (workflows/lifecycle_states.py).
    ILLEGAL_TRANSITION = "IllegalTransition"
    # OrphanGC's end when a sweep would have deleted too much of what it saw;
    # it deleted nothing on that provider (docs/security.md).
    GC_CIRCUIT_OPEN = "GcCircuitOpen"


# The four the provider taxonomy maps onto one to one.
PROVIDER_ERRORS = frozenset(
    {ErrorType.NOT_FOUND, ErrorType.QUOTA_EXCEEDED, ErrorType.TRANSIENT, ErrorType.PERMANENT}
)

# QuotaExceeded comes back in minutes, not seconds, unless the provider says
# when (Retry-After): its own hint wins.
QUOTA_RETRY_DELAY = timedelta(minutes=3)
# A lifecycle's delete that failed neither for good (Permanent: the proxy
# gives up and fails) nor with trouble it waits out (quota, an outage) is
# tried again after this long.
PERMANENT_DELETE_RETRY_DELAY = timedelta(minutes=5)
