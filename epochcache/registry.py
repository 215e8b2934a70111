"""What a cache can be told to use, by name: the eviction policies.

A base module, so that the config validates ``cache.eviction`` against the registered names
(and the reference page lists them) without importing the store, while the store resolves a
name to its class only when a cache opens. A built-in policy is one `register_policy` line
below; a user's own policy registers its class the same way before the cache opens.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Registered:
    """One registered name: what it resolves to and a line saying what it does."""

    name: str
    #: ``"module:Class"`` (imported when first used) or the class itself.
    target: str | type
    description: str

    def resolve(self) -> type:
        """The registered class (importing its module the first time)."""
        if isinstance(self.target, type):
            return self.target
        module, _, attr = self.target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if not isinstance(cls, type):
            raise TypeError(f"{self.target}: not a class")
        return cls


#: Eviction policies by name (`epochcache.store.eviction`), in registration order.
EVICTION: dict[str, Registered] = {}


def register_policy(name: str, target: str | type, description: str = "") -> None:
    """Make an eviction policy selectable as ``cache.eviction: <name>`` and
    ``Cache(eviction=<name>)``.

    Args:
        name: the name users choose it by.
        target: its class (an `epochcache.store.eviction.EvictionPolicy`), or
            ``"module:Class"`` to import it when a cache first uses it.
        description: one line for the reference page.
    """
    EVICTION[name] = Registered(name, target, description)


def policy_names() -> list[str]:
    """The names ``cache.eviction`` accepts."""
    return list(EVICTION)


def check_policy(name: str) -> str:
    """``name`` if a policy is registered under it.

    Raises:
        ValueError: it is not (the message lists the names that are).
    """
    if name not in EVICTION:
        raise ValueError(f"expected one of {', '.join(policy_names())}, got {name!r}")
    return name


register_policy("oldest", "epochcache.store.eviction:OldestFirst",
                "the oldest sample no epoch needs goes first (the default)")
register_policy("least-recently-read", "epochcache.store.least_recently_read:LeastRecentlyRead",
                "the sample training read longest ago (or never, inserted longest ago) goes first")
