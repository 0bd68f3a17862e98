"""Deterministic instance names and the tags that tie an instance to its owner.

The name is a pure function of (installation, Temporal namespace, owner
workflow id, generation), so a create that Temporal retries after a crash
adopts the instance the first attempt made instead of creating a second one,
and two installations or namespaces sharing a project or cluster never derive
the same name. A replacement bumps the generation. See docs/architecture.md,
"Naming", for the formula before installations were hashed, which the
workflows started before then keep using.
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
# The Temporal namespace of the owner workflow: orphan GC looks owners up in
# its own namespace only, so it must only ever judge instances made there.
NAMESPACE_KEY = "proxy-operator/namespace"
# Tags whose values are free text (user-chosen workflow ids, Temporal
# namespace names with dots): providers that limit label values always store
# them hashed, so the label has one predictable form.
HASHED_IN_LABELS = frozenset({OWNER_KEY, NAMESPACE_KEY})
USER_LABEL_PREFIX = "label/"

RFC1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def instance_name(
    owner_id: str, generation: int, *, installation: str | None = None, namespace: str = ""
) -> str:
    """`proxy-` + 16 lowercase base32 characters of a SHA-256 over the owner's scope.

    22 characters in all: a valid GCE name, DNS-1123 label and RFC 1035 label
    (base32's alphabet is a-z and 2-7, and the prefix starts with a letter).
    With `installation`, the hash covers installation, namespace, owner id
    and generation; without it, owner id and generation only: the formula
    of lifecycles started before installations were hashed, which keep it
    for every generation so their running instances keep their names.
    """
    scope = () if installation is None else (installation, namespace)
    parts = (*scope, owner_id, str(generation))
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    encoded = base64.b32encode(digest).decode("ascii").lower()
    return NAME_PREFIX + encoded[:NAME_HASH_CHARS]


def owner_tags(
    installation: str,
    owner_id: str,
    generation: int,
    labels: dict[str, str] | None = None,
    *,
    namespace: str | None = None,
) -> dict[str, str]:
    """The tags every instance carries; orphan GC finds owners through them.

    User labels from the workflow input are kept under their own prefix so they
    can never overwrite the tags GC relies on. The activities always pass the
    owner's Temporal namespace; an instance without one predates the tag.
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
    if namespace is not None:
        tags[NAMESPACE_KEY] = namespace
    return tags


def ownership_mismatch(
    tags: Mapping[str, str],
    installation: str,
    *,
    owner_id: str | None = None,
    generation: int | None = None,
    namespace: str | None = None,
) -> str | None:
    """Why an instance is not ours to act on, or None when it is.

    Providers call this before they delete an instance, and before a create
    adopts one that already carries the requested name: another installation
    sharing the project or cluster, or something a person made by hand, must
    never be deleted or silently adopted. Delete checks the installation only
    (orphan GC deletes instances of owners that are gone); adopt also checks
    the owner and generation the name was derived from, and the namespace
    when the instance carries one (instances made before the namespace tag
    existed do not).
    """
    expected: dict[str, str] = {MANAGED_BY_KEY: MANAGED_BY_VALUE, INSTALLATION_KEY: installation}
    if owner_id is not None:
        expected[OWNER_KEY] = owner_id
    if generation is not None:
        expected[GENERATION_KEY] = str(generation)
    if namespace is not None and NAMESPACE_KEY in tags:
        expected[NAMESPACE_KEY] = namespace
    wrong = [
        f"{key}={tags.get(key)!r} (expected {value!r})"
        for key, value in expected.items()
        if tags.get(key) != value
    ]
    return "not managed by this installation: " + ", ".join(wrong) if wrong else None


def adoption_mismatch(
    tags: Mapping[str, str], installation: str, requested: Mapping[str, str]
) -> str | None:
    """Why an existing instance is not the one a create with tags `requested` makes.

    The create-side form of `ownership_mismatch`: the owner, generation and
    namespace to match come from the request's own tags, which every provider
    stores unchanged.
    """
    generation = requested.get(GENERATION_KEY, "")
    return ownership_mismatch(
        tags,
        installation,
        owner_id=requested.get(OWNER_KEY, ""),
        generation=int(generation) if generation.isdigit() else -1,
        namespace=requested.get(NAMESPACE_KEY),
    )


def short_hash(value: str, length: int = 16) -> str:
    """A label-safe stand-in for a value a provider cannot store as a label.

    Used where label values are limited (63 characters, a restricted alphabet):
    the full value goes into an annotation or metadata, the hash into the label
    so list_by_tag can still select on it.
    """
    digest = hashlib.sha256(value.encode()).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:length]
