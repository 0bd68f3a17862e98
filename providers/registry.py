"""Build the configured providers, each through the catalog entry of its type.

Only the modules of types the config uses are imported (providers/catalog.py),
so a provider's SDK is loaded only when a config needs it.
"""

from __future__ import annotations

from providers.base import Provider
from providers.catalog import provider_type
from providers.config import Config
from providers.metrics import MeteredProvider


def build_providers(config: Config) -> dict[str, Provider]:
    """One metered provider per config entry, keyed by the entry's name."""
    return {
        entry.name: MeteredProvider(provider_type(entry.type).build(entry, config), entry.name)
        for entry in config.providers
    }
