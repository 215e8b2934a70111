"""What a config chooses by name, in one place: the layouts a source may have and the
eviction policies a cache may follow.

A base module, so that the config (which never imports the ingest layer or the store)
validates ``source.layout`` and ``cache.eviction`` against these names and the reference pages
list them with their help, while the layer that uses one imports its class only when it is
used: `epochcache.ingest.layouts.layout_of` a layout's `Source` class when a source is opened
(so a layout's library, pyarrow, is imported only by those who read that layout), the store a
policy's class when a cache opens.

A new layout is one entry in `LAYOUTS` and its module in ``ingest/layouts/``; a new eviction
policy one `register_policy` line at the end and its module in ``store/``
(docs/contributing.md). A user's own policy registers its class the same way before the cache
opens.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """A layout a source may have.

    Attributes:
        target: ``module:Class`` of its `Source` subclass.
        help: what its objects are, one line (the reference pages).
        pattern: what is listed when the config gives no pattern, manifest or shard list.
        shards: whether it takes ``source.shards`` (a brace pattern of shard keys).
        requires: a module it needs that epochcache does not depend on (None: none)...
        extra: ...and the extra of ``pip install 'epochcache[extra]'`` that installs it.
    """

    target: str
    help: str
    pattern: str = "**"
    shards: bool = False
    requires: str | None = None
    extra: str | None = None


LAYOUTS: dict[str, Layout] = {
    "files": Layout("epochcache.ingest.layouts.files:FilesSource", "one object per sample"),
    "tar": Layout("epochcache.ingest.layouts.tar:TarSource",
                  "WebDataset shards, a sample per basename", pattern="**/*.tar", shards=True),
    "parquet": Layout("epochcache.ingest.layouts.parquet:ParquetSource",
                      "Parquet files, a sample per row (read a row group at a time)",
                      pattern="**/*.parquet", requires="pyarrow", extra="parquet"),
}


def layout(name: str) -> Layout:
    """The layout named ``name``.

    Raises:
        ValueError: no layout has that name (the message lists those that do).
    """
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"source layout {name!r}: expected one of "
                         f"{', '.join(sorted(LAYOUTS))}") from None


def missing_requirement(name: str) -> str | None:
    """What layout ``name`` needs and is not installed, as a sentence saying how to install
    it; None when nothing is missing."""
    entry = layout(name)
    if entry.requires is None or importlib.util.find_spec(entry.requires) is not None:
        return None
    return (f"layout {name} needs {entry.requires}, which is not installed: "
            f"pip install 'epochcache[{entry.extra}]'")


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
