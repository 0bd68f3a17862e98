"""Compute Engine VMs running Squid, one per proxy (provider type `gcp`).

Each proxy is a small VM (e2-micro by default) with an ephemeral external IP. Squid is
installed and configured by a startup script carried in the instance metadata,
rendered by squid/conf.py like every other provider's config. One firewall
rule per installation opens the proxy port to `allowed_cidrs` only, for VMs
carrying the installation's network tag.

Compute Engine calls a VM RUNNING as soon as it boots, minutes before its
startup script has installed Squid. The script reports its progress in a
guest attribute (written through the metadata server, so the VM needs no
service account), and `get` says RUNNING only once it reads "ready" there,
or TERMINATED with the script's reason if it reports a failure.

One module per concern, the provider class last:

- `settings`: the `gcp:` config block, and checks across entries.
- `naming`: tags as GCP labels, the firewall rule's default name.
- `instances`: the status table, and a VM's metadata as the contract's `Instance`.
- `startup`: the boot script, a template file (`startup.sh.tmpl`) filled in.
- `firewall`: the installation's firewall rule.
- `operations`: call timeouts, and waiting for long-running operations.
- `errors`: the error edge, Compute Engine failures as the taxonomy.
- `provider`: `GcpProvider` and this type's `PROVIDER_TYPE`.

Design choices, and why:

- Credentials come from Application Default Credentials (`from_config`), never
  from the YAML; tests inject clients pointed at a fake server instead.
- Writes use the `*_unary` client methods and wait through the injected
  operations clients (providers.gcp.operations).
- The SDK's built-in retries (up to 10 minutes on 503) are switched off on
  every call: Temporal's activity retry policy is the one retry layer, derived
  from the error taxonomy.
- Labels select instances server-side (`list_by_tag`), but GCP label values are
  short and restricted, so the exact tags live in a JSON metadata item as well
  and `Instance.tags` always round-trips what `create` was given.
- Errors are translated once, at the edge (providers.gcp.errors), from the
  API's HTTP status and error reasons, or from the error codes of a failed
  operation.
- The provider acts only on its own: `delete` reads the instance's tags first
  and a `create` that meets an existing instance adopts it only when owner,
  installation, generation (and namespace, when tagged) match
  (providers.naming.ownership_mismatch).
- An instance is looked up by name with one `instances.get` per candidate
  zone, not an aggregated list (which costs list quota and is incomplete
  whenever a zone is unreachable). A twin that an earlier attempt left in a
  zone no longer configured is deleted once a create has its VM.
"""

from providers.gcp.instances import PORT_METADATA_KEY, STARTUP_SCRIPT_KEY
from providers.gcp.naming import firewall_name, labels
from providers.gcp.provider import PROVIDER_TYPE, GcpProvider
from providers.gcp.settings import GcpConfig
from providers.gcp.startup import (
    SQUID_CONF,
    STARTUP_READY,
    STARTUP_STATE_ATTRIBUTE,
    startup_script,
)

__all__ = [
    "PORT_METADATA_KEY",
    "PROVIDER_TYPE",
    "SQUID_CONF",
    "STARTUP_READY",
    "STARTUP_SCRIPT_KEY",
    "STARTUP_STATE_ATTRIBUTE",
    "GcpConfig",
    "GcpProvider",
    "firewall_name",
    "labels",
    "startup_script",
]
