"""A fault-injecting wrapper around a real provider, for workflow tests.

It is the only stand-in provider in the suite, used where a fault must be
injected (quota, transient errors, a create that hangs, instances that die);
everything else passes through to the real provider underneath, so probes
still tunnel through real Squid processes.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter, defaultdict, deque

from providers.base import CreateRequest, Instance, InstanceState, Provider
from providers.errors import ProviderError


class FaultyProvider:
    def __init__(self, inner: Provider) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self._faults: defaultdict[str, deque[ProviderError]] = defaultdict(deque)
        # Errors raised by every call of an operation, until `recover`.
        self._outages: dict[str, ProviderError] = {}
        self._lock = threading.Lock()
        # While cleared, create blocks (a slow cloud); set it to let creates through.
        self.create_gate = threading.Event()
        self.create_gate.set()
        self.create_entered = threading.Event()
        # The same for deletes.
        self.delete_gate = threading.Event()
        self.delete_gate.set()
        self.delete_entered = threading.Event()
        # When set, every instance is destroyed right after it is created;
        # `doomed_creates` does that to the next this many only.
        self.doomed = False
        self.doomed_creates = 0

    def fail(self, operation: str, *errors: ProviderError) -> None:
        """Queue errors that the next calls of `operation` raise, one each."""
        with self._lock:
            self._faults[operation].extend(errors)

    def fail_until_recovered(self, operation: str, error: ProviderError) -> None:
        """Every call of `operation` raises `error` from now until `recover(operation)`."""
        with self._lock:
            self._outages[operation] = error

    def recover(self, operation: str) -> None:
        with self._lock:
            self._outages.pop(operation, None)

    def create(self, req: CreateRequest) -> Instance:
        self._enter("create")
        self.create_entered.set()
        self.create_gate.wait(timeout=120)
        instance = self.inner.create(req)
        with self._lock:
            doomed = self.doomed or self.doomed_creates > 0
            self.doomed_creates = max(0, self.doomed_creates - 1)
        if doomed:
            self.inner.delete(instance.provider_id)
        return instance

    def get(self, provider_id: str) -> Instance:
        self._enter("get")
        return self.inner.get(provider_id)

    def delete(self, provider_id: str) -> None:
        self._enter("delete")
        self.delete_entered.set()
        self.delete_gate.wait(timeout=120)
        self.inner.delete(provider_id)

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        self._enter("list_by_tag")
        return self.inner.list_by_tag(key, value)

    def running(self) -> list[Instance]:
        """Instances that still exist underneath, in any state but gone."""
        return [
            i
            for i in self.inner.list_by_tag("managed-by", "proxy-operator")
            if i.state is not InstanceState.TERMINATED
        ]

    def _enter(self, operation: str) -> None:
        with self._lock:
            self.calls[operation] += 1
            queue = self._faults[operation]
            error = queue.popleft() if queue else self._outages.get(operation)
        if error is not None:
            # A copy for each call, as a real provider raises a new error
            # each time: raising one instance again adds each call's frames
            # to its traceback, so every failure in the history (its stack
            # trace included) would be longer than the last. A month of quota
            # calls would then cost minutes of formatting, and its runs would
            # end on the server's history-size suggestion, not EVENT_BUDGET.
            fresh = copy.copy(error)
            fresh.__cause__ = error.__cause__
            raise fresh
