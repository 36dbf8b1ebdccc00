"""Who owns what: every rollout, group, environment and episode records the API key that
made it (its id, never the secret); only that key or an admin key may cancel, replace,
delete or take it over. Reads are not checked here (a ``read`` key reads everything).

With keys off (``ARENA_AUTH=off``, or ``auto`` on loopback) nobody is identified: everything
is owned by :data:`ANONYMOUS` and no check is possible. An object made while keys were off
is then changeable by an admin key only. A refusal is 403 ``forbidden``: the object itself is
visible to any reader, so refusing with 404 would hide nothing. docs/rollout.md ("Owners").

A project (the owner's group of keys) will sit beside the key id; today the key is the owner.
"""

from __future__ import annotations

from arena_core.apikeys import ApiKey
from arena_core.errors import Forbidden

#: The owner of everything made while keys are not enforced.
ANONYMOUS = "anonymous"


def owner_of(key: ApiKey | None) -> str:
    """What an object made by ``key`` records as its owner."""
    return key.key_id if key is not None else ANONYMOUS


def may_change(owner: str, key: ApiKey | None) -> bool:
    """Whether ``key`` may change an object owned by ``owner``: always with keys off (``key``
    None), else when it made it or is an admin key."""
    return key is None or key.key_id == owner or key.allows("admin")


def check(owner: str, key: ApiKey | None, what: str) -> None:
    """Raise 403 ``forbidden`` unless ``key`` may change ``what`` (owned by ``owner``)."""
    if not may_change(owner, key):
        raise Forbidden(f"{what} belongs to another API key: only the key that made it, or an admin key, "
                        f"may change it (this key is {key.key_id})")
