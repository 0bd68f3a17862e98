"""Every provider type, and the module that describes it, loaded only when used.

The table is the one place that lists provider types. Each module it names
declares itself in one `PROVIDER_TYPE` near its top: the type name, the
placement keys a workflow may pass, its config block and how to build it.
Config validation, input validation and the worker all ask the catalog, so a
new provider is one new module and one row here (docs/architecture.md,
"Adding a provider"). A module, and with it its SDK, is imported only when a
config uses its type: a local-only worker never loads the Kubernetes or
Google clients.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from providers.base import Provider
    from providers.config import Config, ProviderEntry, ProviderSettings

# Provider type -> the module that declares it. Order is the order users see.
MODULES: dict[str, str] = {
    "local": "providers.local",
    "kubernetes": "providers.kubernetes",
    "gcp": "providers.gcp",
    "aws": "providers.aws",
    "memory": "providers.memory",
}
TYPE_NAMES: tuple[str, ...] = tuple(MODULES)

S = TypeVar("S", bound="ProviderSettings")


@dataclass(frozen=True)
class ProviderType(Generic[S]):
    """What a provider module says about itself.

    `settings` is the model of the entry's block named after the type;
    `block_optional` lets an entry leave that block out when every setting has
    a sensible default on any machine. `build` makes the provider from a
    validated entry (the module's `from_config`). Placement values are judged
    against the entry's settings by `settings.placement_problems` (a
    Kubernetes namespace outside `allowed_namespaces`). `config_problems`,
    where set, judges the whole validated config for this type (entries
    together, the proxy defaults they share), each problem naming its path.
    """

    name: str
    settings: type[S]
    placement_keys: frozenset[str]
    build: Callable[[ProviderEntry, Config], Provider]
    block_optional: bool = False
    config_problems: Callable[[Config], list[str]] | None = None

    def settings_of(self, entry: ProviderEntry) -> S:
        """The entry's block, refused the same way by every `from_config` if of another type."""
        if not isinstance(entry.settings, self.settings):
            raise TypeError(f"provider {entry.name!r} is of type {entry.type!r}, not {self.name!r}")
        return entry.settings


@functools.cache
def provider_type(name: str) -> ProviderType[Any]:
    """Import the module of type `name` (KeyError for a type not in the table)."""
    declared = getattr(importlib.import_module(MODULES[name]), "PROVIDER_TYPE", None)
    if not isinstance(declared, ProviderType) or declared.name != name:
        raise TypeError(f"{MODULES[name]} must declare PROVIDER_TYPE = ProviderType({name!r}, ...)")
    return declared
