"""GCP names for the contract's tags and for the installation's firewall rule.

Labels select instances server-side (`list_by_tag`), but GCP label keys and
values are short and restricted: a tag becomes a valid label here, and its
exact value travels in the instance metadata (providers.gcp.instances).
"""

from __future__ import annotations

import re

from providers.naming import HASHED_IN_LABELS, short_hash

FIREWALL_PREFIX = "proxy-operator-"

# Label keys and values, and resource names such as the firewall rule's.
_LABEL_MAX = 63
_LABEL_KEY_START = re.compile(r"^[a-z]")
_LABEL_KEY_INVALID = re.compile(r"[^a-z0-9_-]")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")


def labels(tags: dict[str, str]) -> dict[str, str]:
    """GCP labels for `tags`: what `list_by_tag` filters on server-side."""
    return {label_key(k): label_value(k, v) for k, v in tags.items()}


def label_key(key: str) -> str:
    """A tag key as a label key: lowercase, `/` and other invalid characters as `_`.

    `proxy-operator/installation` becomes `proxy-operator_installation`. A key
    too long after that keeps a readable prefix and a hash of the original.
    """
    sanitised = _LABEL_KEY_INVALID.sub("_", key.lower())
    if not _LABEL_KEY_START.match(sanitised):
        sanitised = f"k_{sanitised}"
    if len(sanitised) > _LABEL_MAX:
        suffix = short_hash(key)
        sanitised = f"{sanitised[: _LABEL_MAX - len(suffix) - 1]}_{suffix}"
    return sanitised


def label_value(key: str, value: str) -> str:
    """A tag value as a label value: itself when valid, else its short hash.

    The owner (a user-chosen workflow id) and the Temporal namespace are
    always hashed (HASHED_IN_LABELS), so their labels have one predictable
    form and no free text reaches labels, which billing exports copy. The
    exact value is in the instance metadata.
    """
    if key not in HASHED_IN_LABELS and _LABEL_VALUE.fullmatch(value):
        return value
    return short_hash(value)


def firewall_name(installation: str) -> str:
    """`proxy-operator-<installation>`, shortened with a hash past 63 characters."""
    name = f"{FIREWALL_PREFIX}{installation}"
    if len(name) <= _LABEL_MAX:
        return name
    suffix = short_hash(installation)
    return f"{name[: _LABEL_MAX - len(suffix) - 1]}-{suffix}"
