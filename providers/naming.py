"""Deterministic instance names and the tags that tie an instance to its owner.

The name is a pure function of (owner workflow id, generation), so a create
that Temporal retries after a crash adopts the instance the first attempt made
instead of creating a second one. A replacement bumps the generation.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping

NAME_PREFIX = "proxy-"
NAME_HASH_CHARS = 16

MANAGED_BY_KEY = "managed-by"
MANAGED_BY_VALUE = "proxy-operator"
INSTALLATION_KEY = "proxy-operator/installation"
OWNER_KEY = "proxy-operator/owner"
GENERATION_KEY = "proxy-operator/generation"
USER_LABEL_PREFIX = "label/"

RFC1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def instance_name(owner_id: str, generation: int) -> str:
    """`proxy-` + 16 lowercase base32 characters of SHA-256(owner id + generation).

    22 characters in all: a valid GCE name, DNS-1123 label and RFC 1035 label
    (base32's alphabet is a-z and 2-7, and the prefix starts with a letter).
    """
    digest = hashlib.sha256(f"{owner_id}\x00{generation}".encode()).digest()
    encoded = base64.b32encode(digest).decode("ascii").lower()
    return NAME_PREFIX + encoded[:NAME_HASH_CHARS]


def owner_tags(
    installation: str, owner_id: str, generation: int, labels: dict[str, str] | None = None
) -> dict[str, str]:
    """The tags every instance carries; orphan GC finds owners through them.

    User labels from the workflow input are kept under their own prefix so they
    can never overwrite the tags GC relies on.
    """
    tags = {f"{USER_LABEL_PREFIX}{k}": v for k, v in (labels or {}).items()}
    tags.update(
        {
            MANAGED_BY_KEY: MANAGED_BY_VALUE,
            INSTALLATION_KEY: installation,
            OWNER_KEY: owner_id,
            GENERATION_KEY: str(generation),
        }
    )
    return tags


def ownership_mismatch(
    tags: Mapping[str, str],
    installation: str,
    *,
    owner_id: str | None = None,
    generation: int | None = None,
) -> str | None:
    """Why an instance is not ours to act on, or None when it is.

    Providers call this before they delete an instance, and before a create
    adopts one that already carries the requested name: another installation
    sharing the project or cluster, or something a person made by hand, must
    never be deleted or silently adopted. Delete checks the installation only
    (orphan GC deletes instances of owners that are gone); adopt also checks
    the owner and generation the name was derived from.
    """
    expected: dict[str, str] = {MANAGED_BY_KEY: MANAGED_BY_VALUE, INSTALLATION_KEY: installation}
    if owner_id is not None:
        expected[OWNER_KEY] = owner_id
    if generation is not None:
        expected[GENERATION_KEY] = str(generation)
    wrong = [
        f"{key}={tags.get(key)!r} (expected {value!r})"
        for key, value in expected.items()
        if tags.get(key) != value
    ]
    return "not managed by this installation: " + ", ".join(wrong) if wrong else None


def short_hash(value: str, length: int = 16) -> str:
    """A label-safe stand-in for a value a provider cannot store as a label.

    Used where label values are limited (63 characters, a restricted alphabet):
    the full value goes into an annotation or metadata, the hash into the label
    so list_by_tag can still select on it.
    """
    digest = hashlib.sha256(value.encode()).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:length]
