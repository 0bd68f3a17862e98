"""What a member's placement says about where it is, for routing filters and the API.

A pool's members carry their provider's placement (`{"zone": "europe-west1-b"}`
on Compute Engine, `{"namespace": ...}` on Kubernetes, nothing locally). A
username's `-zone-` and `-region-` filters, and `/v1/members`, read the zone
as given and the region as given or, for a zone named `<region>-<letter>`
(Compute Engine's), from the zone.
"""

from __future__ import annotations

import re
from typing import Any

ZONE_IN_REGION = re.compile(r"^(?P<region>[a-z0-9-]+)-[a-z]$")


def zone_of(placement: Any) -> str | None:
    zone = placement.get("zone") if isinstance(placement, dict) else None
    return zone if isinstance(zone, str) and zone else None


def region_of(placement: Any) -> str | None:
    """The placement's region: named, or the region of a Compute Engine zone."""
    if not isinstance(placement, dict):
        return None
    region = placement.get("region")
    if isinstance(region, str) and region:
        return region
    match = ZONE_IN_REGION.match(zone_of(placement) or "")
    return match["region"] if match else None
