"""Compute Engine instances as the contract's `Instance`: the state table and the metadata.

Label values are short and restricted (providers.gcp.naming), so the exact
tags live in a JSON metadata item as well, and `Instance.tags` always
round-trips what `create` was given.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime

from google.cloud import compute_v1

from providers.base import Instance, InstanceState, public_exit, state_table
from providers.errors import Permanent
from providers.naming import RFC1035_LABEL

# Metadata keys this provider owns on every instance.
TAGS_METADATA_KEY = "proxy-operator-tags"
PORT_METADATA_KEY = "proxy-operator-port"
STARTUP_SCRIPT_KEY = "startup-script"
# Predefined metadata keys (compute/docs/metadata/predefined-metadata-keys):
# let the guest write guest attributes, and keep project-wide SSH keys off
# the proxies (only instance-level keys or OS Login can reach them).
GUEST_ATTRIBUTES_KEY = "enable-guest-attributes"
BLOCK_PROJECT_SSH_KEYS_KEY = "block-project-ssh-keys"

# GCE instance status -> common state (Libcloud style). RUNNING is only
# reported once the VM has an external IP and its startup script reports
# Squid ready; see `to_instance` and `GcpProvider._with_readiness`.
# REPAIRING (Compute Engine recovering the VM after a host error) is STOPPED:
# the VM is not serving and may come back rebooted, so its workflow replaces it.
INSTANCE_STATES = state_table(
    {
        InstanceState.PROVISIONING: ("PENDING", "PROVISIONING", "STAGING"),
        InstanceState.RUNNING: ("RUNNING",),
        InstanceState.STOPPED: (
            "PENDING_STOP",
            "STOPPING",
            "STOPPED",
            "SUSPENDING",
            "SUSPENDED",
            "REPAIRING",
            "TERMINATED",
            "DEPROVISIONING",
        ),
    }
)
# A status newer than this table is not usable yet, but not proof of death
# either: PROVISIONING lets the workflow's provisioning deadline decide.
_UNKNOWN_STATE = InstanceState.PROVISIONING


def to_instance(gce: compute_v1.Instance) -> Instance:
    """The status table applied; readiness is `GcpProvider._with_readiness`'s."""
    metadata = _metadata(gce)
    ip = next(
        (ac.nat_i_p for nic in gce.network_interfaces for ac in nic.access_configs if ac.nat_i_p),
        "",
    )
    state = INSTANCE_STATES.get(gce.status, _UNKNOWN_STATE)
    if state is InstanceState.RUNNING and not ip:
        state = InstanceState.PROVISIONING  # never publish an empty endpoint
    return Instance(
        provider_id=f"{zone_of(gce)}/{gce.name}",
        name=gce.name,
        state=state,
        ip=ip if state is InstanceState.RUNNING else "",
        port=int(metadata.get(PORT_METADATA_KEY, "0")),
        tags=tags_of(gce),
        created_at=datetime.fromisoformat(gce.creation_timestamp),
        exit_address=public_exit(ip, state),
    )


def tags_of(gce: compute_v1.Instance) -> dict[str, str]:
    """The exact tags from metadata; none for a VM this provider did not make.

    Labels are not a fallback: they hold hashes and sanitised keys, and a VM
    that merely copies our labels must not look like ours to orphan GC.
    """
    with contextlib.suppress(ValueError):
        parsed = json.loads(_metadata(gce).get(TAGS_METADATA_KEY, ""))
        if isinstance(parsed, dict):
            return {str(k): str(v) for k, v in parsed.items()}
    return {}


def preemptible(gce: compute_v1.Instance) -> bool:
    """Whether Compute Engine may preempt the VM: a Spot or a preemptible one."""
    scheduling = gce.scheduling
    return scheduling.provisioning_model == "SPOT" or bool(scheduling.preemptible)


def reports_readiness(gce: compute_v1.Instance) -> bool:
    """Whether the VM's startup script can report (VMs made before that cannot)."""
    return _metadata(gce).get(GUEST_ATTRIBUTES_KEY, "").upper() == "TRUE"


def zone_of(gce: compute_v1.Instance) -> str:
    return gce.zone.rsplit("/", 1)[-1]


def parse_provider_id(provider_id: str) -> tuple[str, str]:
    """`<zone>/<name>`, each checked, since both go into API paths."""
    zone, _, name = provider_id.partition("/")
    if not (RFC1035_LABEL.fullmatch(zone) and RFC1035_LABEL.fullmatch(name)):
        raise Permanent(f"malformed GCP provider_id {provider_id!r}: expected <zone>/<name>")
    return zone, name


def _metadata(gce: compute_v1.Instance) -> dict[str, str]:
    return {item.key: item.value for item in gce.metadata.items}
