"""Build the configured providers from a type -> constructor map.

The map is passed in by the composition root (worker.py), so this module
imports no concrete provider and a provider's SDK is only imported when a
config actually uses that type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from providers.base import Provider
from providers.config import Config, ProviderEntry
from providers.metrics import MeteredProvider

Constructor = Callable[[ProviderEntry, Config], Provider]


class UnknownProviderType(KeyError):
    pass


def build_providers(config: Config, constructors: Mapping[str, Constructor]) -> dict[str, Provider]:
    """One metered provider per config entry, keyed by the entry's name."""
    providers: dict[str, Provider] = {}
    for entry in config.providers:
        try:
            construct = constructors[entry.type]
        except KeyError:
            raise UnknownProviderType(
                f"providers: no constructor for type {entry.type!r} (entry {entry.name!r})"
            ) from None
        providers[entry.name] = MeteredProvider(construct(entry, config), entry.name)
    return providers
