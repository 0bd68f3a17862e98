"""The `memory` provider: instances that exist only in this process's memory.

For demos, benchmarks and tests, not for serving traffic. It keeps the provider
contract over a dict, so a test or a benchmark can hold thousands of instances
with chosen ages and tags, and refuse deletes, without a Squid per instance.
Creating an instance starts nothing: the instance claims to listen on
127.0.0.1 at the requested proxy port, so its probes pass only if a proxy with
the worker's credentials already listens there (a benchmark points instances at
real Squids by overriding `address`). Everything is forgotten when the worker
exits.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

from providers.base import CreateRequest, Instance, InstanceState
from providers.catalog import ProviderType
from providers.config import ProviderSettings
from providers.errors import NotFound, ProviderError
from providers.naming import instance_name, owner_tags


class MemoryConfig(ProviderSettings):
    """No settings: the instances live in the worker's memory."""

    def member_networks(self) -> tuple[str, ...] | None:
        """Where `MemoryProvider.address` says instances listen; a subclass
        that points them elsewhere needs the gateway's `--member-networks`."""
        return (LOOPBACK,)


PROVIDER_TYPE = ProviderType(
    name="memory",
    settings=MemoryConfig,
    placement_keys=frozenset(),
    # An empty fleet: there is nothing in the entry or the config to read.
    build=lambda entry, config: MemoryProvider(),
    block_optional=True,
)

PROVIDER_ID_PREFIX = "memory/"
LOOPBACK = "127.0.0.1/32"
# Long enough past any grace period a test uses.
OLD = timedelta(days=1)


class MemoryProvider:
    """The provider contract over a dict; thread-safe, as activities call it from threads."""

    def __init__(self) -> None:
        self._instances: dict[str, Instance] = {}
        self._lock = threading.Lock()
        self._undeletable: dict[str, ProviderError] = {}
        self.deleted: list[str] = []

    # -- set-up for tests -----------------------------------------------------

    def add(
        self,
        installation: str,
        owner: str,
        generation: int,
        *,
        age: timedelta = OLD,
        tags: dict[str, str] | None = None,
        namespace: str = "default",
    ) -> Instance:
        """An instance as the lifecycle names and tags it, created `age` ago.

        Its owner runs in Temporal namespace `namespace` (the dev server's default).
        """
        name = instance_name(owner, generation)
        instance = Instance(
            provider_id=PROVIDER_ID_PREFIX + name,
            name=name,
            state=InstanceState.RUNNING,
            ip="127.0.0.1",
            port=3128,
            tags=(
                tags
                if tags is not None
                else owner_tags(installation, owner, generation, namespace=namespace)
            ),
            created_at=datetime.now(UTC) - age,
        )
        with self._lock:
            self._instances[instance.provider_id] = instance
        return instance

    def refuse_delete(self, provider_id: str, error: ProviderError) -> None:
        """Every delete of this instance raises `error`."""
        with self._lock:
            self._undeletable[provider_id] = error

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._instances)

    # -- the Provider contract ------------------------------------------------

    def address(self, req: CreateRequest) -> tuple[str, int]:
        """Where a new instance says it listens; a subclass may point it elsewhere."""
        return "127.0.0.1", req.proxy.port

    def create(self, req: CreateRequest) -> Instance:
        ip, port = self.address(req)
        with self._lock:
            provider_id = PROVIDER_ID_PREFIX + req.name
            existing = self._instances.get(provider_id)
            if existing is not None:
                return existing
            instance = Instance(
                provider_id=provider_id,
                name=req.name,
                state=InstanceState.RUNNING,
                ip=ip,
                port=port,
                tags=dict(req.tags),
                created_at=datetime.now(UTC),
            )
            self._instances[provider_id] = instance
            return instance

    def get(self, provider_id: str) -> Instance:
        with self._lock:
            try:
                return self._instances[provider_id]
            except KeyError:
                raise NotFound(f"{provider_id} does not exist") from None

    def delete(self, provider_id: str) -> None:
        with self._lock:
            error = self._undeletable.get(provider_id)
            if error is not None:
                raise error
            if self._instances.pop(provider_id, None) is not None:
                self.deleted.append(provider_id)

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        with self._lock:
            return [i for i in self._instances.values() if i.tags.get(key) == value]
